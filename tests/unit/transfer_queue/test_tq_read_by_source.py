"""A producer that died or is cut off costs its own records, not the read: `read_by_source` reads one
producer (`Handle.source`) at a time, a zmq `get` past `queue.read_timeout_s` is `StorageUnreachable`
naming the unit, a `get` lost with a broken connection is asked again, and a reply to another request
(its `rid`) is never taken for the answer."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import zmq

from transfer_queue.codec import pack
from transfer_queue.storage.base import StorageUnreachable
from transfer_queue.storage.handles import InlineHandle, LocalHandle, NixlHandle, ShmHandle, ZmqHandle
from transfer_queue.storage.zmq import UnitReply, UnitRequest, ZmqStorage, ZmqStorageUnit, _replies, _requests

ARR = np.arange(1000, dtype=np.int32)


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


def _handle(address: str, key: str = "k0") -> ZmqHandle:
    return ZmqHandle(dtype="int32", shape=[1000], nbytes=4000, address=address, key=key)


def _read_in_thread(plane: ZmqStorage, handles: list) -> tuple[threading.Thread, dict]:
    got: dict = {}

    def go() -> None:
        t0 = time.monotonic()
        try:
            got["arrays"] = plane.read(handles)
        except Exception as e:  # handed to the test thread, which asserts on it
            got["error"] = e
        got["s"] = time.monotonic() - t0

    t = threading.Thread(target=go, daemon=True)
    t.start()
    return t, got


def test_read_by_source_returns_the_live_producers_arrays_and_names_the_dead_one():
    live, dead = ZmqStorage(), ZmqStorage()
    reader = ZmqStorage(read_timeout_s=1.0)
    try:
        mine = live.write("a", {"x": ARR, "y": ARR * 2}, inline=False)
        theirs = dead.write("b", {"x": ARR + 1}, inline=False)["x"]
        dead_address = dead.address()
        dead.close()  # its process "died": the unit holding its bytes is gone
        arrays, failed = reader.read_by_source([mine["x"], theirs, mine["y"]])
        assert np.array_equal(arrays[0], ARR) and np.array_equal(arrays[2], ARR * 2) and arrays[1] is None
        assert list(failed) == [dead_address] == [theirs.source]
        assert "queue.read_timeout_s" in failed[dead_address]
    finally:
        for p in (live, dead, reader):
            p.close()


def test_a_plain_read_of_a_dead_producer_raises_unreachable_naming_its_address_and_the_key():
    dead, reader = ZmqStorage(), ZmqStorage(read_timeout_s=1.0)
    try:
        h = dead.write("b", {"x": ARR}, inline=False)["x"]
        dead.close()
        t0 = time.monotonic()
        with pytest.raises(StorageUnreachable) as e:
            reader.read([h])
        assert 0.9 <= time.monotonic() - t0 < 2.5  # read_timeout_s, not the plane's 120 s timeout
        assert h.address in str(e.value) and "queue.read_timeout_s" in str(e.value)
        assert h.address in e.value.source
    finally:
        reader.close()


@pytest.mark.timeout(20)
def test_a_get_lost_with_a_broken_connection_is_sent_again_and_answered(ctx):
    """The first listener takes the request and goes away (the request is lost with its connection); a
    unit that holds the key then listens on the same port: only the `get` sent again after ~2 s reaches it."""
    gone = zmq.Context()  # the first listener's own: destroying it closes the port before the unit binds it
    first = gone.socket(zmq.ROUTER)
    first.setsockopt(zmq.LINGER, 0)
    port = first.bind_to_random_port("tcp://127.0.0.1")
    address = f"tcp://127.0.0.1:{port}"
    reader = ZmqStorage(read_timeout_s=6.0)
    unit = None
    try:
        t, got = _read_in_thread(reader, [_handle(address)])
        assert first.poll(3000), "the first get never arrived"
        lost = first.recv_multipart()
        assert _requests.decode(lost[1]).op == "get"
        gone.destroy(linger=0)  # the connection breaks with the request in it
        unit = ZmqStorageUnit(port=port)
        put = ctx.socket(zmq.DEALER)
        put.setsockopt(zmq.LINGER, 0)
        put.connect(address)
        put.send_multipart([pack(UnitRequest("put", ["k0"])), ARR.tobytes()])
        assert put.poll(3000) and _replies.decode(put.recv_multipart()[0]).ok
        put.close()
        t.join(8)
        assert "error" not in got, got.get("error")
        assert np.array_equal(got["arrays"][0], ARR)
        assert got["s"] >= 1.9  # answered by the copy sent again, not the first one
    finally:
        reader.close()
        gone.destroy(linger=0)
        if unit is not None:
            unit.close()


@pytest.mark.timeout(20)
def test_a_reply_with_another_requests_rid_is_not_taken_for_the_answer(ctx):
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    reader = ZmqStorage(read_timeout_s=5.0)
    try:
        t, got = _read_in_thread(reader, [_handle(f"tcp://127.0.0.1:{port}")])
        assert router.poll(3000)
        ident, header = router.recv_multipart()
        req = _requests.decode(header)
        assert req.op == "get" and req.keys == ["k0"] and req.rid > 0
        wrong = np.zeros(1000, dtype=np.int32)
        router.send_multipart([ident, pack(UnitReply(False, "an old request's error", rid=req.rid + 7))])
        router.send_multipart([ident, pack(UnitReply(True, parts=[1], rid=req.rid + 1)), wrong.tobytes()])
        router.send_multipart([ident, pack(UnitReply(True, parts=[1], rid=req.rid)), ARR.tobytes()])
        t.join(6)
        assert "error" not in got, got.get("error")
        assert np.array_equal(got["arrays"][0], ARR)
        assert got["s"] < 1.9  # the right reply was taken at once, not after a re-send
    finally:
        reader.close()


def test_handle_source_is_the_process_that_must_answer_a_read():
    head = {"dtype": "int32", "shape": [4], "nbytes": 16}
    assert ZmqHandle(**head, address="tcp://10.0.0.5:7001", key="k").source == "tcp://10.0.0.5:7001"
    nixl = NixlHandle(**head, agent="server-3", md=b"m", descs=b"d", addr=0, offset=0)
    assert nixl.source == "nixl agent server-3"
    assert InlineHandle(**head, data=bytes(16)).source == ""
    # a producer's files: its arena, or the prefix its files per tensor share (removed together once it ended)
    assert ShmHandle(**head, path="/dev/shm/tq-r-12-abcdef-7").source == "shm /dev/shm/tq-r-12-abcdef"
    arena = "/dev/shm/tq-r-12-abcdef-arena"
    assert ShmHandle(**head, path=arena, offset=0, slot=1, free="tcp://127.0.0.1:1").source == f"shm {arena}"
    assert LocalHandle(**head, key="k").source == ""


@pytest.mark.timeout(20)
def test_reads_of_a_dead_unit_keep_failing_in_time_after_its_request_queue_filled(ctx):
    dead = ZmqStorage()
    h = dead.write("b", {"x": ARR}, inline=False)["x"]
    dead.close()
    reader = ZmqStorage(read_timeout_s=0.01)
    reader._ctx.setsockopt(zmq.SNDHWM, 4)  # ZeroMQ's default is 1000: the same wall, met after 4 reads, not 1000
    drain = None
    failed = []

    def go() -> None:
        for _ in range(12):
            try:
                reader.read([h])
            except StorageUnreachable:
                failed.append(1)

    t = threading.Thread(target=go, daemon=True)
    try:
        t.start()
        t.join(1.5)
        in_time = not t.is_alive()
        reads = len(failed)
        drain = ctx.socket(zmq.ROUTER)  # a listener at the dead address takes the queue: the blocked read goes on
        drain.setsockopt(zmq.LINGER, 0)
        drain.bind(h.address)
        t.join(5)
        assert in_time, f"the read after {reads} failed ones was still blocked after 1.5 s (read_timeout_s=0.01)"
        assert reads == 12
    finally:
        reader.close()
        if drain is not None:
            drain.close()
