"""The nixl plane across two processes: the producer's registered arena is READ by the consumer."""

from __future__ import annotations

import importlib.util
import multiprocessing as mp

import numpy as np
import pytest

from tests.integration.transfer_queue import _procs
from transfer_queue import TransferQueueConfig, connect

pytestmark = pytest.mark.skipif(not any(importlib.util.find_spec(m) for m in ("nixl", "nixl_cu12")),
                                reason="needs the nixl package (pip install nixl-cu12)")
CTX = mp.get_context("spawn")


@pytest.mark.timeout(120)
def test_two_processes_move_tensors_through_nixl(service):
    cfg = service(storage="nixl", capacity=32, nixl_arena_bytes=16 << 20)
    out = CTX.Queue()
    prod = CTX.Process(target=_procs.produce_and_watch_frees, args=(cfg, [f"n{i}" for i in range(4)], 2, out),
                       daemon=True)
    prod.start()
    try:
        kind, used = out.get(timeout=90)
        assert kind == "produced" and used >= 8 * 200_000
        q = connect(TransferQueueConfig(**cfg))
        b = q.get("trainer", num_groups=4, timeout=10)
        assert len(b) == 8 and all(s.handles["x"]["plane"] == "nixl" for s in b.samples)
        h = b.samples[0].handles["x"]
        assert h["md"] and h["descs"] and h["agent"].startswith("tq-")  # the handle carries descriptors + agent metadata
        for s, t in zip(b.samples, q.fetch(b, as_torch=False)):
            assert np.array_equal(t["x"], _procs.tensor_for(s.uid))
        q.ack(b)  # the controller frees the producer's slots
        assert out.get(timeout=60) == ("freed", 0)
        q.close()
    finally:
        prod.kill()
        prod.join()
