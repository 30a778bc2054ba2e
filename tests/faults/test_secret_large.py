"""Large requests through listeners that hold a secret (issue 44, item 9): a 1 MiB request through a
TransferQueue service and a 32 MiB tensor through a zmq storage unit, both with `queue.secret`.

CURVE adds its box (a MAC and a nonce) to every frame, and a listener takes frames of at most
`auth.LISTEN_FRAME_BYTES`: parts cut to exactly that size were dropped by ZeroMQ (the request timed
out). Real sockets on 127.0.0.1.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from transfer_queue import Record, TransferQueueConfig, connect
from transfer_queue.service import ControllerService
from transfer_queue.storage.zmq import ZmqStorage, ZmqStorageUnit


@pytest.mark.timeout(60)
def test_a_1_mib_request_reaches_a_service_that_holds_a_secret(tmp_path):
    cfg = TransferQueueConfig(storage="shm", shm_dir=str(tmp_path), capacity=64, run_id="big", secret="run-secret-9", max_message_bytes=8 << 20,
                              inline_max_bytes=2 << 20)
    svc = ControllerService(cfg)
    try:
        q = connect(TransferQueueConfig(**{**cfg.__dict__, "controller_address": svc.address}))
        meta = {"note": "x" * (1 << 20)}  # a 1 MiB request: the put's metadata travels in the request itself
        q.put([Record("u", "g", tensors={"t": torch.arange(4)}, meta=meta)])
        b = q.get("trainer", timeout=10)
        assert b.samples[0].meta["note"] == meta["note"]
        q.close()
    finally:
        svc.close()


@pytest.mark.timeout(60)
def test_a_32_mib_tensor_goes_through_a_zmq_unit_that_holds_a_secret():
    unit = ZmqStorageUnit(secret="run-secret-9")
    try:
        plane = ZmqStorage(address=unit.address, secret="run-secret-9", inline_max_bytes=0, read_timeout_s=20.0)
        x = np.random.default_rng(0).standard_normal(4 << 20)  # 32 MiB of float64
        h = plane.write("u", {"x": x})
        assert np.array_equal(plane.read([h["x"]])[0], x)
        plane.close()
    finally:
        unit.close()
