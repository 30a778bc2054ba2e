"""Fuzz the queue's sockets: >=10,000 malformed requests each to the controller service and a zmq storage unit.

Over real sockets from raw DEALERs (and, with a secret, from a client holding it). Asserts: the
service thread is alive, `stats` answers within 2 s between bursts and after, records put before the
storm read back byte-identical and a full put/get/ack cycle works after, and the rejected counter
equals exactly the number of malformed requests sent (every one of them reaches the service).
"""

from __future__ import annotations

import math
import random
import time

import msgpack
import numpy as np
import pytest
import zmq

from transfer_queue import Record, TransferQueueConfig, connect
from plane_common.curve import client as curve_client
from transfer_queue.codec import pack, unpack
from transfer_queue.service import ControllerService
from transfer_queue.storage.zmq import ZmqStorage, ZmqStorageUnit

N = 10_000
BURST = 500


def _dealer(address: str, secret: str | None) -> zmq.Socket:
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    if secret:
        curve_client(s, secret, 64 << 20)
    s.connect(address)
    return s


def _controller_garbage(rng: random.Random, handle: dict) -> list[bytes]:
    """One malformed request (a list of frames); each must be answered with an error."""
    good = pack({"id": 1, "op": "put", "args": {"samples": [], "timeout": 0, "client_id": "c"}})
    sample = {"uid": "f", "group_id": "g", "group_size": 1, "version": 0, "meta": {}, "handles": {"x": handle},
              "sealed": True}
    k = rng.randrange(16)
    if k == 0:
        return [bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 40))) or b"\xc1"]
    if k == 1:
        return [good[: rng.randint(1, len(good) - 1)]]
    if k == 2:
        return [b"\xdb\xff\xff\xff\xf0" + b"x" * rng.randint(0, 20)]  # str declaring ~4 GiB
    if k == 3:
        return [pack({"id": 1, "op": "get"}), b"more", b"garbage"][: rng.randint(2, 3)]  # multi-part
    if k == 4:
        return [pack({"id": rng.choice(["1", 1.5, None, -1]), "op": "stats", "args": {}})]
    if k == 5:
        return [pack({"id": 1, "op": rng.choice(["shutdown", "", "Stats", "__init__"]), "args": {}})]
    if k == 6:
        t = rng.choice([math.nan, math.inf, -math.inf, -1.0, 1e30, "5", True])
        return [pack({"id": 1, "op": rng.choice(["get", "put"]),
                      "args": {"consumer": "trainer", "consumer_id": "c", "timeout": t, "samples": [],
                               "client_id": "c"}})]
    if k == 7:
        a = rng.choice([{"num_groups": 10**15}, {"num_samples": -1}, {"group_size": 0}, {"max_staleness": -2,
                        "current_version": 1}, {"max_version": 2**63}, {"num_groups": 1, "num_samples": 1}])
        return [pack({"id": 1, "op": "get", "args": {"consumer": "trainer", "consumer_id": "c", **a}})]
    if k == 8:
        bad = rng.choice([{**handle, "path": "/etc/passwd"}, {**handle, "offset": -5}, {**handle, "nbytes": 1},
                          {**handle, "plane": "nixl"}, {**handle, "evil": True}, dict(handle), {"plane": "shm"},
                          {**handle, "slot": math.nan}])
        return [pack({"id": 1, "op": "put", "args": {"samples": [{**sample, "handles": {"x": bad}}], "timeout": 0,
                                                     "client_id": "c"}})]
    if k == 9:
        s = rng.choice([{**sample, "version": -1}, {**sample, "group_size": 2**40}, {**sample, "uid": ""},
                        {**sample, "meta": []}, {**sample, "sealed": 1}, {"uid": 5}])
        return [pack({"id": 1, "op": "put", "args": {"samples": [s], "timeout": 0, "client_id": "c"}})]
    if k == 10:
        return [pack({"id": 1, "op": rng.choice(["ack", "drop", "nack", "renew"]),
                      "args": {"consumer": "trainer", "uids": [1, 2]}})]  # wrong types, missing fields
    if k == 11:
        return [pack({"id": 1, "op": "ack", "args": {"consumer": "nobody", "uids": ["a"], "client_id": "c"}})]
    if k == 12:
        return [msgpack.packb(msgpack.ExtType(rng.randrange(128), b"\x80\x04"))]
    if k == 13:
        return [pack({"id": 1, "op": "stats", "args": {"x": 1}})]
    if k == 14:
        return [pack({"id": 1, "op": "put", "args": {"samples": [sample] * 100, "timeout": 0, "client_id": "c"}})]
    return [pack({"id": 1, "op": "update", "args": {"uid": "zz", "handles": {}, "meta": {}, "seal": True,
                                                    "client_id": "c"}})]  # no such record: KeyError


def _storm(addr: str, secret: str | None, make, check_alive, n: int, replies_per_msg: int = 1) -> int:
    """Send `n` garbage messages in bursts, drain every reply; returns the number sent."""
    s = _dealer(addr, secret)
    sent = 0
    while sent < n:
        expect = 0
        for _ in range(min(BURST, n - sent)):
            frames, answered = make()
            s.send_multipart(frames)
            sent += 1
            expect += answered
        for _ in range(expect):
            assert s.poll(10_000), "the service stopped answering"
            rep = unpack(s.recv_multipart()[0], 1 << 26)
            assert rep["ok"] is False
        check_alive()
    s.close(0)
    return sent


@pytest.mark.timeout(60)
@pytest.mark.parametrize("secret", ["", "fuzz-secret"])
def test_controller_service_survives_10k_malformed_requests(tmp_path, secret):
    cfg = TransferQueueConfig(storage="shm", capacity=64, shm_dir=str(tmp_path), run_id="fz", secret=secret,
                              max_message_bytes=1 << 16, max_frame_bytes=1 << 20)
    svc = ControllerService(cfg)
    try:
        q = connect(TransferQueueConfig(**{**cfg.__dict__, "controller_address": svc.address}), consumer_id="p")
        before = {f"r{i}": np.random.default_rng(i).integers(0, 1 << 30, 3000) for i in range(4)}
        q.put([Record(u, u, tensors={"x": x}) for u, x in before.items()])
        b = q.get("trainer", num_groups=1, timeout=5)
        handle = b.samples[0].handles["x"]
        q.nack(b)
        rng = random.Random(1)

        def alive():
            t = time.monotonic()
            q.stats()
            assert time.monotonic() - t < 2.0 and svc._thread.is_alive()

        n = _storm(svc.address, secret or None, lambda: (_controller_garbage(rng, handle), 1), alive, N)
        st = q.stats()
        assert st.rejected == n and st.put == 4 and st.resident == 4
        got = q.get("trainer", num_groups=4, timeout=5)
        for s, t in zip(got.samples, q.fetch(got, as_torch=False)):
            assert t["x"].tobytes() == before[s.uid].tobytes()
        assert q.ack(got) == 4
        q.put([Record("after", "a", tensors={"x": np.arange(5000)})])
        b = q.get("trainer", timeout=5)
        assert q.fetch(b, as_torch=False)[0]["x"][-1] == 4999 and q.ack(b) == 1
        assert q.stats().rejected == n
        q.close()
    finally:
        svc.close()


def _unit_garbage(rng: random.Random) -> tuple[list[bytes], int]:
    """One malformed storage-unit request and how many replies it gets (frees get none)."""
    k = rng.randrange(10)
    if k == 0:
        return [bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 40)))], 1
    if k == 1:
        return [pack({"op": "put", "keys": ["a", "b"]})[: rng.randint(1, 10)]], 1
    if k == 2:
        return [pack({"op": rng.choice(["del", "", 3, None]), "keys": []})], 1
    if k == 3:
        return [pack({"op": "put", "keys": [rng.choice([1, "", "k" * 300, None])]}), b"x"], 1
    if k == 4:
        return [pack({"op": "put", "keys": ["k1", "k2"]}), b"only one"], 1
    if k == 5:
        return [pack({"op": "put", "keys": ["held"]}), b"overwrite"], 1  # a key already held
    if k == 6:
        return [pack({"op": "get", "keys": [f"missing{rng.randrange(9)}"]})], 1
    if k == 7:
        return [pack({"op": "get", "keys": ["held"]}), b"junk", b"frames"], 1
    if k == 8:
        return [pack({"op": "free", "keys": [f"nobody{rng.randrange(9)}"]})], 0  # counted, no reply
    return [b"\xdb\xff\xff\xff\xf0abc", *[b"g" * rng.randint(0, 9)] * rng.randint(0, 3)], 1


@pytest.mark.timeout(60)
@pytest.mark.parametrize("secret", ["", "fuzz-secret"])
def test_zmq_storage_unit_survives_10k_malformed_requests(secret):
    unit = ZmqStorageUnit(secret=secret, max_frame_bytes=1 << 20, max_tensor_bytes=1 << 20)
    plane = ZmqStorage(address=unit.address, secret=secret, inline_max_bytes=0)
    try:
        before = {f"r{i}": np.random.default_rng(i).random(2000) for i in range(4)}
        handles = {u: plane.write(u, {"x": x})["x"] for u, x in before.items()}
        s = _dealer(unit.address, secret or None)
        s.send_multipart([pack({"op": "put", "keys": ["held"]}), b"original"])
        assert s.poll(5000) and unpack(s.recv_multipart()[0], 1 << 20)["ok"]
        s.close(0)
        rng = random.Random(2)

        def alive():
            t = time.monotonic()
            assert plane.unit_stats()["count"] == 5 and time.monotonic() - t < 2.0 and unit._thread.is_alive()

        n = _storm(unit.address, secret or None, lambda: _unit_garbage(rng), alive, N)
        st = plane.unit_stats()
        assert st["rejected"] == n and st["count"] == 5
        for u, arr in zip(handles, plane.read(list(handles.values()))):
            assert arr.tobytes() == before[u].tobytes()
        h = plane.write("after", {"x": np.arange(3000)})["x"]
        assert plane.read([h])[0][-1] == 2999
        plane.free([h, *handles.values()])
        deadline = time.monotonic() + 5
        while plane.unit_stats()["count"] != 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert plane.unit_stats()["count"] == 1 and plane.unit_stats()["rejected"] == n
    finally:
        plane.close()
        unit.close()
