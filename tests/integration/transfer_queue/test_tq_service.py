"""The memory controller as a service, with real second processes (spawn) and real sockets."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import random
import time

import msgpack
import numpy as np
import pytest
import zmq

from tests.integration.transfer_queue import _procs
from transfer_queue import AsyncTransferQueueClient, Record, TransferQueueConfig, connect
from transfer_queue.codec import pack, unpack

CTX = mp.get_context("spawn")


@pytest.mark.timeout(90)
def test_consumer_killed_between_get_and_ack_is_redelivered(service, tmp_path):
    cfg = service(storage="shm", capacity=64, lease_timeout_s=1.5)
    q = connect(TransferQueueConfig(**cfg))
    groups = [f"g{i}" for i in range(8)]
    for g in groups:
        q.put([Record(f"{g}-{i}", g, group_size=2, tensors={"x": _procs.tensor_for(f"{g}-{i}")}) for i in range(2)])
    out = CTX.Queue()
    doomed = CTX.Process(target=_procs.consume_and_hang, args=(cfg, 4, out), daemon=True)
    doomed.start()
    kind, lost = out.get(timeout=60)
    assert kind == "got" and len(lost) == 8
    doomed.kill()
    doomed.join()

    seen: list[str] = []
    while len(seen) < 16:
        b = q.get("trainer", num_groups=2, timeout=10)
        assert len(b) > 0, f"records lost: have {sorted(seen)}"
        for s, t in zip(b.samples, q.fetch(b, as_torch=False)):
            assert np.array_equal(t["x"], _procs.tensor_for(s.uid))
        seen += b.uids
        q.ack(b)
    assert sorted(seen) == sorted(f"{g}-{i}" for g in groups for i in range(2))  # none lost, none twice
    s = q.stats()
    assert s.acked["trainer"] == 16 and s.redelivered["trainer"] == 8 and s.resident == 0
    assert len(q.get("trainer", timeout=0.3)) == 0
    deadline = time.monotonic() + 5
    while q.storage.arena_used() and time.monotonic() < deadline:  # frees travel back asynchronously
        time.sleep(0.01)
    assert q.storage.arena_used() == 0  # every slot freed once acked


@pytest.mark.timeout(60)
def test_1000_malformed_frames_are_rejected_counted_and_service_still_answers(service):
    cfg = service(storage="shm", capacity=8, max_message_bytes=4096)
    rng = random.Random(0)
    good = pack({"id": 1, "op": "put", "args": {"samples": [{"uid": "u", "group_id": "g", "group_size": 1,
                "version": 0, "meta": {}, "handles": {}, "sealed": True}]}})
    bad = [
        lambda: bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 64))) or b"\xc1",  # garbage
        lambda: good[: rng.randint(1, len(good) - 1)],                                   # truncated
        lambda: pack({"id": 2, "op": "get", "args": {"consumer": "trainer", "x": "y" * 5000}}),  # oversized
        lambda: pack({"id": 3, "op": "shutdown", "args": {}}),                            # unknown op
        lambda: pack({"id": 4, "op": "put", "args": {"samples": [{"uid": 1}]}}),         # wrong types
        lambda: pack([1, 2, 3]),                                                          # not a map
        lambda: msgpack.packb(msgpack.ExtType(7, b"\x80\x04")),                           # ext type
    ]
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(cfg["controller_address"])
    for i in range(1000):
        sock.send(bad[i % len(bad)]())
    for _ in range(1000):
        assert sock.poll(10_000)
        assert unpack(sock.recv(), 1 << 20)["ok"] is False
    sock.close(0)
    q = connect(TransferQueueConfig(**cfg))
    assert q.stats().rejected == 1000
    q.put([Record("ok", "g", tensors={"x": np.arange(5000)})])
    b = q.get("trainer", timeout=5)
    assert q.fetch(b, as_torch=False)[0]["x"][-1] == 4999 and q.ack(b) == 1
    assert q.stats().put == 1


@pytest.mark.timeout(90)
@pytest.mark.parametrize("plane", ["shm", "shm-files", "zmq"])
def test_two_processes_move_tensors(service, plane):
    files = plane == "shm-files"
    cfg = service(storage="shm" if files else plane, capacity=32, shm_arena_bytes=0 if files else 64 << 20)
    out = CTX.Queue()
    prod = CTX.Process(target=_procs.produce, args=(cfg, [f"p{i}" for i in range(6)], 2, out), daemon=True)
    prod.start()
    try:
        assert out.get(timeout=60) == ("produced", 12)
        if files:  # one file per tensor: records outlive the producer
            prod.kill()
        q = connect(TransferQueueConfig(**cfg))
        b = q.get("trainer", num_groups=6, timeout=10)
        assert len(b) == 12
        for s, t in zip(b.samples, q.fetch(b, as_torch=False)):
            assert np.array_equal(t["x"], _procs.tensor_for(s.uid)) and s.meta["sum"] == pytest.approx(float(t["x"].sum()))
        q.ack(b)
        assert q.stats().resident == 0
        q.close()
    finally:
        prod.kill()
        prod.join()


@pytest.mark.timeout(60)
def test_async_client_against_the_service(service):
    cfg = service(storage="shm", capacity=4)

    async def main():
        q = AsyncTransferQueueClient(TransferQueueConfig(**cfg))
        getter = asyncio.create_task(q.get("trainer", num_groups=1, timeout=10))
        await asyncio.sleep(0.2)
        await q.put([Record("a", "g", tensors={"x": np.ones(100_000, dtype=np.float32)})])
        b = await getter
        t = (await q.fetch(b, as_torch=False))[0]["x"]
        assert await q.ack(b) == 1
        await q.close()
        return float(t.sum())

    assert asyncio.run(main()) == 100_000.0
