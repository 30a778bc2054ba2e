"""Back-pressure of the arena planes is counted, and a free that does not arrive is an error that names the producer."""

from __future__ import annotations

import logging
import socket
import threading
import time

import numpy as np
import pytest

from transfer_queue.storage.arena import Arena, FreeEndpoint, FreeSender
from transfer_queue.storage.shm import ShmStorage


def _until(pred, timeout: float = 4.0) -> bool:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _closed_port() -> int:
    """A port that was free a moment ago and that nobody listens on (bound, then closed)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def _errors(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR and r.name == "transfer_queue.storage.arena"]


@pytest.mark.timeout(10)
def test_a_full_arena_counts_the_wait_and_its_seconds_and_a_release_unblocks_it():
    arena = Arena(np.empty(1024, dtype=np.uint8), "queue.shm_arena_bytes")
    off, slot = arena.alloc(1024, timeout=1)
    got: list[tuple[int, int]] = []
    waiter = threading.Thread(target=lambda: got.append(arena.alloc(256, timeout=5)))
    waiter.start()
    assert _until(lambda: arena.waiting == 1)
    assert arena.waits == 1 and not got
    time.sleep(0.3)
    assert arena.wait_s >= 0.3  # the wait in progress counts
    assert arena.release(off, 1024, slot)
    waiter.join(2)
    assert got and got[0][0] == 0
    assert arena.waiting == 0 and arena.waits == 1 and 0.3 <= arena.wait_s < 2
    assert arena.backpressure() == {"arena_waits": 1, "arena_wait_s": round(arena.wait_s, 3), "arena_waiting": 0}
    with pytest.raises(TimeoutError, match=r"queue\.shm_arena_bytes.*frees did not come back"):
        arena.alloc(1024, timeout=0.1)  # 256 bytes still held
    assert arena.waits == 2 and arena.waiting == 0


@pytest.mark.timeout(15)
def test_a_plane_shows_its_arena_wait_and_the_free_that_ends_it(tmp_path):
    plane = ShmStorage(shm_dir=str(tmp_path), run_id="bp", arena_bytes=64 << 10)
    try:
        first = plane.write("u0", {"x": np.zeros(48 << 10, dtype=np.uint8)})["x"]
        assert plane.backpressure() == {"arena_waits": 0, "arena_wait_s": 0.0, "arena_waiting": 0, "undelivered_frees": []}
        second = threading.Thread(target=plane.write, args=("u1", {"x": np.ones(48 << 10, dtype=np.uint8)}))
        second.start()
        assert _until(lambda: plane.backpressure()["arena_waiting"] == 1)
        time.sleep(0.05)  # a wait long enough to show in milliseconds
        plane.free([first])  # through the free endpoint, over ZeroMQ
        second.join(4)
        assert not second.is_alive()
        bp = plane.backpressure()
        assert (bp["arena_waits"], bp["arena_waiting"], bp["undelivered_frees"]) == (1, 0, []) and bp["arena_wait_s"] > 0
    finally:
        plane.close()


@pytest.mark.timeout(10)
def test_frees_to_an_endpoint_nobody_listens_on_are_an_error_naming_it(caplog):
    caplog.set_level(logging.WARNING, logger="transfer_queue.storage.arena")
    port = _closed_port()
    addr = f"tcp://127.0.0.1:{port}"
    sender = FreeSender(connect_grace_s=1.0)
    released: list[int] = []
    endpoint = None
    try:
        t0 = time.monotonic()
        sender.send({addr: [[0, 256, 1], [256, 256, 2], [512, 256, 3]]}, {addr: "shm producer pid 42"})
        assert sender.undelivered_by_peer == {} and not _errors(caplog)  # within its grace: it may still connect
        assert _until(lambda: sender.undelivered_by_peer == {addr: 3})
        assert time.monotonic() - t0 < 3
        (line,) = _errors(caplog)
        assert addr in line and "shm producer pid 42" in line and "not delivered" in line
        sender.send({addr: [[768, 256, 4]]})
        assert sender.undelivered_by_peer == {addr: 4} and sender.undelivered == 4
        assert sender.undelivered_frees() == [{"endpoint": addr, "producer": "shm producer pid 42", "frees": 4}]
        assert len(_errors(caplog)) == 1  # reported once
        endpoint = FreeEndpoint(lambda off, n, slot: released.append(off) or True, "127.0.0.1", port=port)  # it comes back
        assert _until(lambda: len(released) == 4, 3)  # ZeroMQ kept them queued
        assert sender.undelivered_by_peer == {}
    finally:
        sender.close()
        if endpoint is not None:
            endpoint.close()


@pytest.mark.timeout(10)
def test_a_full_queue_to_an_endpoint_is_reported_at_once(caplog):
    caplog.set_level(logging.WARNING, logger="transfer_queue.storage.arena")
    addr = f"tcp://127.0.0.1:{_closed_port()}"
    sender = FreeSender(connect_grace_s=60.0)  # only the full queue can report it in this test's time
    try:
        for i in range(5000):  # one message each: past ZeroMQ's send high-water mark
            sender.send({addr: [[i * 256, 256, i + 1]]})
        dropped = sender.undelivered_by_peer.get(addr, 0)
        assert 0 < dropped < 5000
        (line,) = _errors(caplog)
        assert addr in line and "queue is full" in line
    finally:
        sender.close()


@pytest.mark.timeout(10)
def test_an_endpoint_that_listens_a_moment_late_gets_its_frees_and_is_not_reported(caplog):
    caplog.set_level(logging.WARNING, logger="transfer_queue.storage.arena")
    port = _closed_port()
    addr = f"tcp://127.0.0.1:{port}"
    sender = FreeSender(connect_grace_s=1.0)
    released: list[int] = []
    endpoint = None
    try:
        t0 = time.monotonic()
        sender.send({addr: [[0, 256, 1], [256, 256, 2]]}, {addr: "nixl agent late"})
        time.sleep(0.3)
        endpoint = FreeEndpoint(lambda off, n, slot: released.append(off) or True, "127.0.0.1", port=port)
        assert endpoint.address == addr
        assert _until(lambda: sorted(released) == [0, 256], 3)
        time.sleep(max(0.0, t0 + 1.5 - time.monotonic()))  # past its grace
        assert sender.undelivered_by_peer == {} and sender.undelivered_frees() == []
        assert not _errors(caplog)
    finally:
        sender.close()
        if endpoint is not None:
            endpoint.close()


@pytest.mark.timeout(10)
def test_an_endpoint_of_another_secret_is_reported_with_the_handshake(caplog):
    caplog.set_level(logging.WARNING, logger="transfer_queue.storage.arena")
    endpoint = FreeEndpoint(lambda *a: True, "127.0.0.1", secret="run-a")
    sender = FreeSender(secret="run-b", connect_grace_s=0.5)
    try:
        sender.send({endpoint.address: [[0, 256, 1]]})
        assert _until(lambda: sender.undelivered_by_peer == {endpoint.address: 1})
        (line,) = _errors(caplog)
        assert endpoint.address in line and "handshake failed" in line
    finally:
        sender.close()
        endpoint.close()
