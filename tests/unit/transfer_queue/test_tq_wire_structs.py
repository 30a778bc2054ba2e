"""The msgspec wire types of the queue and the weight plane: tagged handles, typed op args, strict decoding."""

from __future__ import annotations

import math

import msgpack
import numpy as np
import pytest

from checkpoint_engine.wire import Ack, Group, Malformed, decode as decode_weights, encode as encode_weights
from transfer_queue.codec import WireError, decode, pack
from transfer_queue.protocol import ARGS, PutArgs
from transfer_queue.records import SampleMeta, sample_decoder
from transfer_queue.storage.handles import InlineHandle, ShmHandle, ZmqHandle, check_handle, identity
from transfer_queue.storage.local import LocalStorage


@pytest.mark.timeout(10)
def test_handles_round_trip_tagged_by_plane_and_read_like_maps():
    plane = LocalStorage(inline_max_bytes=16)
    hs = plane.write("u", {"small": np.arange(2, dtype=np.int32), "big": np.arange(100)})
    assert type(hs["small"]) is InlineHandle and hs["big"].plane == "local"
    s = SampleMeta("u", "g", 1, 0, {"r": 1.0}, hs)
    back = sample_decoder.decode(pack(s))
    assert back == s and msgpack.unpackb(pack(hs["big"]))["plane"] == "local"
    assert dict(hs["big"])["key"] == hs["big"].key and hs["big"]["nbytes"] == 800
    assert (plane.read([back.handles["big"]])[0] == np.arange(100)).all()
    arena = ShmHandle(dtype="int64", shape=[4], nbytes=32, path="/dev/shm/tq-x", offset=256, slot=7, free="tcp://h:1")
    assert identity(arena) == ("shm-arena", "tcp://h:1", 256) and identity(hs["small"]) is None


@pytest.mark.timeout(10)
def test_forged_handles_and_args_are_wire_errors():
    ok = {"plane": "zmq", "dtype": "int64", "shape": [2], "nbytes": 16, "address": "tcp://a:1", "key": "k"}
    assert isinstance(check_handle(ok, "zmq", 1 << 20), ZmqHandle)
    for bad in ({**ok, "plane": "pickle"}, {**ok, "evil": 1}, {**ok, "nbytes": 15}, {**ok, "address": "ipc://x"},
                {**ok, "shape": [-1]}, {**ok, "nbytes": True}, {**ok, "dtype": "object"}, {**ok, "plane": "local"},
                {"plane": "shm", "dtype": "int64", "shape": [2], "nbytes": 16, "path": "/p", "offset": 0}):
        with pytest.raises(WireError):
            check_handle(bad, "zmq", 1 << 20)
    for t in (math.nan, math.inf, -1.0, "5", True):
        with pytest.raises(WireError):
            decode(ARGS["put"], pack({"samples": [], "timeout": t, "client_id": "c"}), 1 << 20, "put")
    with pytest.raises(WireError):  # missing field, unknown field
        decode(ARGS["ack"], pack({"consumer": "t", "uids": ["a"]}), 1 << 20, "ack")
    with pytest.raises(WireError):
        decode(ARGS["stats"], pack({"x": 1}), 1 << 20, "stats")
    with pytest.raises(WireError):  # an ext type inside a record's meta
        decode(ARGS["put"], msgpack.packb({"samples": [{"uid": "u", "group_id": "g", "group_size": 1, "version": 0,
                                                        "meta": {"x": msgpack.ExtType(1, b"")}, "handles": {},
                                                        "sealed": True}], "timeout": 0, "client_id": "c"}), 1 << 20)
    assert decode(ARGS["put"], pack(PutArgs(samples=[], timeout=None, client_id="c")), 1 << 20).timeout is None


@pytest.mark.timeout(10)
def test_weight_plane_records_are_tagged_arrays_with_checked_bounds():
    assert msgpack.unpackb(encode_weights(Ack(1, 3))) == ["Ack", 1, 3]
    for frame, reason in ((msgpack.packb(["Group", 1, 1, 2, 2]), "fields"),  # rank must be < world_size
                          (msgpack.packb(["Ack", 1]), "fields"), (msgpack.packb([7, 1]), "kind"),
                          (b"\xdd\xff\xff\xff\xff\x01", "msgpack")):
        with pytest.raises(Malformed) as e:
            decode_weights(frame)
        assert e.value.reason == reason
    assert decode_weights(encode_weights(Group(1, 2, 1, 3))) == Group(1, 2, 1, 3)
