"""Entry points of the processes the integration tests spawn (importable by `spawn`)."""

from __future__ import annotations

import threading
import zlib

import numpy as np

from transfer_queue import Record, TransferQueueConfig, connect


def serve(cfg: dict, out) -> None:
    """A memory controller service; sends its address (and storage address) on `out`."""
    from transfer_queue.service import ControllerService

    svc = ControllerService(TransferQueueConfig(**cfg))
    out.put((svc.address, svc.plane.address()))
    threading.Event().wait()


def tensor_for(uid: str, n: int = 50_000) -> np.ndarray:
    return np.random.default_rng(zlib.crc32(uid.encode())).standard_normal(n).astype(np.float32)


def produce(cfg: dict, groups: list[str], group_size: int, out) -> None:
    q = connect(TransferQueueConfig(**cfg))
    for g in groups:
        uids = [f"{g}-{i}" for i in range(group_size)]
        q.put([Record(u, g, group_size=group_size, version=1, meta={"sum": float(tensor_for(u).sum())},
                      tensors={"x": tensor_for(u)}) for u in uids])
    out.put(("produced", len(groups) * group_size))
    threading.Event().wait()  # stay alive: planes like nixl serve reads from this process


def consume_and_hang(cfg: dict, num_groups: int, out) -> None:
    """Get a batch, check its tensors, then hang without acking (the test kills us)."""
    q = connect(TransferQueueConfig(**cfg), consumer_id="doomed")
    b = q.get("trainer", num_groups=num_groups, timeout=30)
    bad = [s.uid for s, t in zip(b.samples, q.fetch(b, as_torch=False)) if not np.array_equal(t["x"], tensor_for(s.uid))]
    out.put(("got", b.uids) if not bad else ("corrupt", bad))
    threading.Event().wait()


def produce_and_watch_frees(cfg: dict, groups: list[str], group_size: int, out) -> None:
    """Produce into the nixl plane, then report when every slot of the arena was freed."""
    import time

    q = connect(TransferQueueConfig(**cfg))
    for g in groups:
        q.put([Record(f"{g}-{i}", g, group_size=group_size, tensors={"x": tensor_for(f"{g}-{i}")})
               for i in range(group_size)])
    out.put(("produced", q.storage.arena_used()))
    deadline = time.monotonic() + 60
    while q.storage.arena_used() and time.monotonic() < deadline:
        time.sleep(0.05)
    out.put(("freed", q.storage.arena_used()))
    threading.Event().wait()
