"""The queue trusts no stranger: secrets, frame limits, numbers, busy pools, handles, ownership, shm cleanup.

Real ControllerService / ZmqStorageUnit on 127.0.0.1, raw zmq DEALERs as the strangers.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time

import numpy as np
import pytest
import zmq

from plane_common.curve import client as curve_client
from plane_common.curve import curve_keys
from transfer_queue import Record, TransferQueueConfig, connect
from transfer_queue.codec import pack, unpack
from transfer_queue.service import BusyError, ControllerService
from transfer_queue.storage.arena import Arena
from transfer_queue.storage.shm import ShmStorage
from transfer_queue.storage.zmq import ZmqStorage, ZmqStorageUnit


def _svc(tmp_path, **kw):
    cfg = TransferQueueConfig(storage="shm", capacity=64, shm_dir=str(tmp_path), run_id="trust", **kw)
    svc = ControllerService(cfg)
    return svc, TransferQueueConfig(**{**cfg.__dict__, "controller_address": svc.address})


def _raw(address: str, secret: str | None = None) -> zmq.Socket:
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    if secret is not None:
        curve_client(s, secret, 64 << 20)
    s.connect(address)
    return s


def _ask(s: zmq.Socket, op: str, args: dict, wait_ms: int = 2000) -> dict | None:
    """The service's answer, or None: none came in `wait_ms`, or the request could not even be sent (a socket
    whose handshake the service refused has no peer left, and a DEALER's send then blocks for ever)."""
    s.setsockopt(zmq.SNDTIMEO, wait_ms)
    try:
        s.send(pack({"id": 7, "op": op, "args": args}))
    except zmq.Again:
        return None
    return unpack(s.recv(), 1 << 26) if s.poll(wait_ms) else None


@pytest.mark.timeout(30)
def test_secret_admits_only_its_holders_and_counts_refusals(tmp_path):
    svc, cfg = _svc(tmp_path, secret="run-secret-1")
    try:
        for secret in (None, "wrong"):  # no CURVE at all; CURVE with a wrong secret
            s = _raw(svc.address, secret)
            assert _ask(s, "stats", {}, 700) is None  # no answer at all
            s.close(0)
        s = _raw(svc.address)  # knows the server's public key (not secret) but not the client key
        pub, sec = zmq.curve_keypair()
        s.close(0)
        s = zmq.Context.instance().socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.curve_serverkey, s.curve_publickey, s.curve_secretkey = curve_keys("run-secret-1")[0], pub, sec
        s.connect(svc.address)
        assert _ask(s, "stats", {}, 700) is None
        s.close(0)
        q = connect(cfg)
        q.put([Record("a", "g", tensors={"x": np.arange(4096)})])
        b = q.get("trainer", timeout=5)
        assert q.fetch(b, as_torch=False)[0]["x"][-1] == 4095 and q.ack(b) == 1
        st = q.stats()
        assert st.auth_refused >= 1 and st.handshake_failed >= 2, st
        q.close()
    finally:
        svc.close()


@pytest.mark.timeout(30)
def test_zmq_unit_with_secret_refuses_strangers_and_serves_holders():
    unit = ZmqStorageUnit(secret="s3")
    try:
        s = _raw(unit.address, "not-s3")
        s.send_multipart([pack({"op": "stats"})])
        assert not s.poll(700)
        s.close(0)
        plane = ZmqStorage(address=unit.address, secret="s3", inline_max_bytes=0)
        h = plane.write("u", {"x": np.arange(1000)})
        assert plane.read([h["x"]])[0][-1] == 999
        assert unit.gate.handshake_failed >= 1  # a wrong secret fails the handshake itself (before ZAP)
        plane.close()
    finally:
        unit.close()


@pytest.mark.timeout(30)
def test_frame_over_the_limit_is_cut_before_it_is_buffered(tmp_path):
    svc, cfg = _svc(tmp_path, max_frame_bytes=1 << 20, max_message_bytes=1 << 16)
    try:
        s = _raw(svc.address)
        s.send(b"\x00" * (2 << 20))
        assert not s.poll(500)  # the connection was closed by ZeroMQ; the service never saw it
        s.close(0)
        q = connect(cfg)
        assert q.stats().rejected == 0
        q.close()
    finally:
        svc.close()


@pytest.mark.timeout(30)
def test_bad_numbers_are_rejected_and_counted_and_never_stall_the_service(tmp_path):
    svc, cfg = _svc(tmp_path)
    try:
        s = _raw(svc.address)
        bad = [{"timeout": math.nan}, {"timeout": math.inf}, {"timeout": -1}, {"timeout": 1e12},
               {"num_groups": 10**12}, {"num_groups": -3}, {"group_size": 0}, {"current_version": -1},
               {"num_groups": True}]
        n = 0
        for i in range(64):
            args = {"consumer": "trainer", "consumer_id": "x", **bad[i % len(bad)]}
            rep = _ask(s, "get", args)
            assert rep is not None and rep["ok"] is False, args
            n += 1
        q = connect(cfg)
        t = time.monotonic()
        assert q.stats().rejected == n and time.monotonic() - t < 1.0
        q.close()
        s.close(0)
    finally:
        svc.close()


@pytest.mark.timeout(30)
def test_full_blocking_pool_refuses_at_once_and_never_starves_stats_or_put(tmp_path):
    svc, cfg = _svc(tmp_path, max_blocking_ops=4)
    try:
        waiters = [_raw(svc.address) for _ in range(4)]
        for w in waiters:
            w.send(pack({"id": 1, "op": "get", "args": {"consumer": "trainer", "consumer_id": "w", "timeout": 3.0,
                                                        "num_groups": 50}}))
        time.sleep(0.3)
        q = connect(cfg)
        t = time.monotonic()
        with pytest.raises(BusyError):
            q.get("trainer", num_groups=50, timeout=3.0)
        q.put([Record("p", "g", tensors={"x": np.ones(10)})], timeout=0)  # fits: no wait, not refused
        st = q.stats()
        assert time.monotonic() - t < 1.0 and st.busy == 1 and st.put == 1
        for w in waiters:
            w.close(0)
        q.close()
    finally:
        svc.close()


@pytest.mark.timeout(30)
def test_forged_handles_are_refused_at_put_and_never_free_anything(tmp_path):
    svc, cfg = _svc(tmp_path)
    try:
        q = connect(cfg, consumer_id="prod")
        q.put([Record("real", "g", tensors={"x": np.arange(1000)})])
        real = q.get("trainer", timeout=5)
        h = real.samples[0].handles["x"]
        outside = tmp_path / "victim"
        outside.write_bytes(b"v" * 8000)
        forged = [
            dict(h),                                                    # replay: same slot as a live record
            {**h, "slot": h["slot"] ^ 1, "offset": h["offset"] + 256},  # a slot it never allocated: identity differs,
            {"plane": "shm", "dtype": "int64", "shape": [1000], "nbytes": 8000, "path": str(outside)},  # not of the run
            {"plane": "shm", "dtype": "int64", "shape": [1000], "nbytes": 8000, "path": "/etc/passwd"},
            {**h, "plane": "zmq"}, {**h, "extra": 1}, {**h, "offset": -1}, {**h, "nbytes": 7},
        ]
        s = _raw(svc.address)
        refused = 0
        for i, fh in enumerate(forged):
            sample = {"uid": f"f{i}", "group_id": f"fg{i}", "group_size": 1, "version": 0, "meta": {},
                      "handles": {"x": fh}, "sealed": True}
            rep = _ask(s, "put", {"samples": [sample], "timeout": 0, "client_id": "evil"})
            refused += rep["ok"] is False
        # the shifted slot passes the controller (it names a new slot) but is freed by nobody: its ack
        # reaches the producer's arena, which refuses it (not an allocation it made)
        assert refused == len(forged) - 1
        assert outside.exists() and q.fetch(real, as_torch=False)[0]["x"][-1] == 999
        assert q.ack(real) == 1
        assert q.stats().rejected == refused
        s.close(0)
        q.close()
    finally:
        svc.close()


@pytest.mark.timeout(30)
def test_only_producer_or_lease_holder_may_update_or_ack(tmp_path):
    svc, cfg = _svc(tmp_path)
    try:
        prod, cons, evil = (connect(cfg, consumer_id=n) for n in ("prod", "cons", "evil"))
        prod.put([Record("a", "g", tensors={"x": np.arange(3000)}, sealed=False)])
        with pytest.raises(PermissionError):
            evil.update("a", meta={"reward": 1.0})
        prod.update("a", meta={"reward": 1.0})
        b = cons.get("trainer", timeout=5)
        with pytest.raises(PermissionError):
            evil.ack(b)
        with pytest.raises(PermissionError):
            evil.renew(b)
        assert cons.ack(b) == 1
        st = cons.stats()
        assert st.not_owner == 3 and st.acked["trainer"] == 1 and st.resident == 0
        for c in (prod, cons, evil):
            c.close()
    finally:
        svc.close()


def test_arena_releases_only_its_own_allocations():
    a = Arena(np.zeros(4096, np.uint8), "test")
    off, slot = a.alloc(300, 1.0)
    assert not a.release(off, 300, slot ^ 1) and not a.release(off + 256, 300, slot) and not a.release(off, 1000, slot)
    assert a.used == 512 and a.rejected == 3
    assert a.release(off, 300, slot) and a.used == 0
    assert not a.release(off, 300, slot) and a.rejected == 4  # a second free of the same slot frees nothing


def test_zmq_unit_refuses_overwrites_and_counts_foreign_frees():
    unit = ZmqStorageUnit()
    try:
        s = _raw(unit.address)
        s.send_multipart([pack({"op": "put", "keys": ["k"]}), b"first"])
        assert s.poll(2000) and unpack(s.recv_multipart()[0], 1 << 20)["ok"]
        s.send_multipart([pack({"op": "put", "keys": ["k"]}), b"other"])
        assert s.poll(2000) and not unpack(s.recv_multipart()[0], 1 << 20)["ok"]
        s.send_multipart([pack({"op": "free", "keys": ["nobody"]})])
        s.send_multipart([pack({"op": "get", "keys": ["k"]})])
        assert s.poll(2000) and s.recv_multipart()[1] == b"first"
        assert unit.rejected == 2
        s.close(0)
    finally:
        unit.close()


@pytest.mark.timeout(30)
def test_shm_arena_removed_at_exit_and_dead_owners_swept(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f"tq-sw-{dead.pid}-abcdef-arena"
    stale.write_bytes(b"x")
    code = ("import numpy as np; from transfer_queue.storage.shm import ShmStorage;"
            f"p = ShmStorage(shm_dir={str(tmp_path)!r}, run_id='sw', arena_bytes=1 << 20, inline_max_bytes=0);"
            "p.write('u', {'x': np.ones(1000)}); import os; print(os.listdir(p.dir))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=20, cwd=os.getcwd())
    assert out.returncode == 0, out.stderr
    assert "-arena" in out.stdout and stale.name not in out.stdout  # it had an arena; the stale one was swept
    assert not any(p.name.endswith("-arena") for p in tmp_path.iterdir())  # removed when its owner exited
    ShmStorage(shm_dir=str(tmp_path), run_id="sw").close()


@pytest.mark.timeout(30)
def test_a_consumer_reads_no_planted_link_nor_another_runs_file_whatever_handle_it_is_given(tmp_path):
    """Issue 44, item 5's last step: whoever can write the queue's metadata (a Redis client) points a handle
    at a link planted in the shm directory to a file only root may read, or at another run's file; the
    consumer's read refuses both (no bytes of them reach it), and a real record still reads."""
    secret = tmp_path / "root_only"
    secret.write_bytes(b"S" * 8000)
    secret.chmod(0o600)
    link = tmp_path / "tq-trust-1-abcdef-0"  # a name of this run, planted as a link
    link.symlink_to(secret)
    other = tmp_path / "tq-other-1-abcdef-0"  # another run's file of this user
    other.write_bytes(b"O" * 8000)
    theirs = tmp_path / "tq-trust-2-abcdef-0"  # a file of this run's name that another user made
    theirs.write_bytes(b"T" * 8000)
    os.chown(theirs, 54321, 54321)
    plane = ShmStorage(shm_dir=str(tmp_path), run_id="trust", arena_bytes=0, inline_max_bytes=0)
    real = plane.write("u", {"x": np.arange(1000)})["x"]
    for path, why in ((link, "symbolic link"), (other, "not a file of run prefix"), (theirs, "not a regular file of this user")):
        forged = {"plane": "shm", "dtype": "int64", "shape": [1000], "nbytes": 8000, "path": str(path)}
        with pytest.raises(Exception, match=why):
            plane.read([forged])
    assert plane.read([real])[0][-1] == 999
    plane.close()
