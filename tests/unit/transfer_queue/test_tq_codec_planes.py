"""Codec (no pickle, closed dtypes, limits), config validation, and the in-process planes."""

from __future__ import annotations

import mmap
import os
import time

import msgpack
import numpy as np
import pytest
import torch

from transfer_queue import Record, TransferQueueConfig, WireError, connect
from transfer_queue.codec import check_header, from_buffer, pack, tensor_header, to_numpy, unpack
from transfer_queue.storage.shm import ShmStorage
from transfer_queue.storage.zmq import ZmqStorage


def test_tensor_roundtrip_keeps_dtype_shape_and_bfloat16():
    for t in [np.arange(12, dtype=np.float32).reshape(3, 4), torch.arange(6, dtype=torch.bfloat16).view(2, 3),
              np.array([True, False]), torch.zeros(0, 5, dtype=torch.int64)]:
        arr, tag = to_numpy(t)
        h = tensor_header(arr, tag)
        back = from_buffer(unpack(pack(h), 1 << 10), arr.tobytes(), 1 << 20)
        assert back.shape == tuple(t.shape) and back.tobytes() == arr.tobytes()
        assert (tag == "bfloat16") == (getattr(t, "dtype", None) == torch.bfloat16)


def test_codec_rejects_what_a_peer_could_abuse():
    with pytest.raises(WireError):
        to_numpy(np.array([object()]))
    with pytest.raises(WireError):
        unpack(msgpack.packb(msgpack.ExtType(1, b"x")) + b"", 100)  # ext types never decode to objects
    with pytest.raises(WireError):
        unpack(b"\x93\x01", 100)  # truncated array
    with pytest.raises(WireError):
        unpack(b"\x00" * 101, 100)  # oversized
    with pytest.raises(WireError):
        check_header({"dtype": "object", "shape": [1], "nbytes": 8}, 100)
    with pytest.raises(WireError):
        check_header({"dtype": "float32", "shape": [4], "nbytes": 8}, 100)  # nbytes lies
    with pytest.raises(WireError):
        from_buffer({"dtype": "float32", "shape": [4], "nbytes": 16}, b"\x00" * 12, 100)  # short buffer


def test_config_errors_name_the_key():
    for kw, key in [({"storage": "nfs"}, "queue.storage"), ({"capacity": 0}, "queue.capacity"),
                    ({"metadata": "etcd"}, "queue.metadata"), ({"consumer_groups": ["a", "a"]}, "queue.consumer_groups"),
                    ({"storage": "local", "controller_address": "tcp://127.0.0.1:1"}, "queue.storage"),
                    ({"lease_timeout_s": 0}, "queue.lease_timeout_s")]:
        with pytest.raises(ValueError, match=key.replace(".", r"\.")):
            TransferQueueConfig(**kw)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("plane", ["local", "shm", "shm-files", "zmq"])
def test_planes_roundtrip_and_free_on_ack(plane, tmp_path):
    files = plane == "shm-files"
    plane = "shm" if files else plane
    cfg = TransferQueueConfig(storage=plane, capacity=8, shm_dir=str(tmp_path), run_id="t",
                              shm_arena_bytes=0 if files else 64 << 20)
    q = connect(cfg)
    big = torch.randn(256, 1024)
    q.put([Record("u", "g", tensors={"big": big, "small": torch.tensor([1, 2, 3])})])
    b = q.get("trainer", timeout=1)
    out = q.fetch(b)[0]
    assert torch.equal(out["big"], big) and out["small"].tolist() == [1, 2, 3]
    assert b.samples[0].handles["small"]["plane"] == "inline" and b.samples[0].handles["big"]["plane"] == plane
    if plane == "shm":
        assert len([n for n in os.listdir(tmp_path) if not n.endswith(".run")]) == 1  # and the run's mark
        raw = q.fetch(b, ["big"], as_torch=False)[0]["big"]
        assert isinstance(_root(raw), mmap.mmap) and not np.shares_memory(raw, big.numpy())  # a view of the mapping
        raw[0, 0] = 42.0  # copy-on-write: private to this consumer
        assert q.fetch(b, ["big"])[0]["big"][0, 0] == big[0, 0] if files else True
    if plane == "shm" and not files:
        assert q.storage.arena_used() == big.numel() * 4
    q.ack(b)
    if files:
        assert os.listdir(tmp_path) == ["tq-t.run"]  # the run's mark, held while the plane is open
        assert torch.equal(out["big"], big)  # the consumer's mapping outlives the unlink
    elif plane == "shm":
        assert _until(lambda: q.storage.arena_used() == 0)  # the slot went back to the producer
    if plane == "zmq":
        assert q.storage.unit_stats()["count"] == 0
    q.close()


def _until(pred, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _root(arr: np.ndarray):
    while isinstance(arr, np.ndarray) or isinstance(arr, memoryview):
        arr = arr.base if isinstance(arr, np.ndarray) else arr.obj
    return arr


def test_shm_refuses_handles_outside_its_directory(tmp_path):
    plane = ShmStorage(shm_dir=str(tmp_path))
    with pytest.raises(WireError):
        plane.read([{"plane": "shm", "dtype": "uint8", "shape": [4], "nbytes": 4, "path": "/etc/passwd"}])


@pytest.mark.timeout(30)
def test_zmq_unit_rejects_and_counts_malformed_messages():
    plane = ZmqStorage()
    import zmq

    s = zmq.Context.instance().socket(zmq.DEALER)
    s.connect(plane.address())
    bad = [[b"\xc1"], [pack({"op": "put", "keys": ["a", "b"]}), b"x"], [pack({"op": "rm"})], [pack([1, 2])]]
    for m in bad:
        s.send_multipart(m)
        assert s.poll(5000)
        assert unpack(s.recv_multipart()[0], 1 << 20)["ok"] is False
    assert plane.unit_stats()["rejected"] == len(bad)
    h = plane.write("u", {"x": np.arange(10_000)})
    assert (plane.read([h["x"]])[0] == np.arange(10_000)).all()
    s.close(0)
    plane.close()


def test_which_planes_keep_a_writers_bytes_after_it_dies(tmp_path):
    """`outlives_writer` decides whether a server snapshots its samples in flight (ServerHost.snapshot):
    shm files live in tmpfs; a zmq plane's own unit, and local memory, die with the writer; a separate
    zmq unit (queue.zmq_address) does not. A snapshot-style write (`inline=False`) stays in the plane."""
    from transfer_queue.storage.local import LocalStorage
    from transfer_queue.storage.shm import ShmStorage
    from transfer_queue.storage.zmq import ZmqStorage

    shm = ShmStorage(shm_dir=str(tmp_path), run_id="keep", arena_bytes=0)
    own, separate = ZmqStorage(), ZmqStorage(address="tcp://127.0.0.1:1")
    try:
        assert [p.outlives_writer for p in (shm, own, separate, LocalStorage())] == [True, False, True, False]
        small = np.arange(4, dtype=np.uint8)
        assert shm.write("u", {"x": small})["x"].plane == "inline"
        h = shm.write("u", {"x": small}, inline=False)["x"]
        assert h.plane == "shm" and shm.read([h])[0].tolist() == [0, 1, 2, 3]
    finally:
        shm.close(), own.close(), separate.close()
