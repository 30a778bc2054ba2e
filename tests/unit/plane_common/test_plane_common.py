"""What both planes share: one CURVE key derivation (byte for byte), one listener gate, one msgpack
decoding rule, one liveness check."""

from __future__ import annotations

import fcntl
import hashlib
import os
import subprocess
import sys

import msgspec
import pytest
import zmq
from zmq.utils import z85

from checkpoint_engine import Receiver, WeightsConfig
from checkpoint_engine.control import SenderSocket
from plane_common.curve import curve_keys
from plane_common.liveness import pid_alive, unlink_orphan
from plane_common.strict_msgpack import decoder
from transfer_queue import auth
from transfer_queue.service import RemoteController

SECRET = "run-7-secret"


def test_curve_keys_are_derived_exactly():
    """The derivation is a wire format: these bytes are what every process of a run computes."""
    spub, ssec, cpub, csec = curve_keys("abc")
    assert ssec == z85.encode(hashlib.sha256(b"asyncrl/curve/server\0abc").digest())
    assert csec == z85.encode(hashlib.sha256(b"asyncrl/curve/client\0abc").digest())
    assert spub == zmq.curve_public(ssec) and cpub == zmq.curve_public(csec)
    assert (spub, cpub) == (b"PYF^UX4%Y?Y8Ykb(CKKD2k>=^gX$Y+7%?wc{l^o%", b"JFk3h*Rc#tt{+PhOvv0MFD%rMEJWLv.>ZlDGDArX")
    assert curve_keys("abd")[0] != spub


@pytest.mark.timeout(30)
def test_a_client_of_one_plane_passes_the_gate_of_the_other():
    """Byte-identical keys end to end: the weight plane's receiver completes its CURVE handshake with
    the queue's listener, and the queue's client with the weight plane's sender (neither refused)."""
    ctx = zmq.Context()
    gate = auth.Gate(ctx, SECRET)
    router = gate.server(ctx.socket(zmq.ROUTER))
    port = gate.bind(router, "127.0.0.1")
    rx = Receiver(WeightsConfig(backend="local", secret=SECRET), "rx-0", endpoint=f"tcp://127.0.0.1:{port}")
    sender = SenderSocket(WeightsConfig(backend="local", secret=SECRET))
    try:
        assert router.poll(10_000), "the receiver's Join never passed the queue's gate"
        assert router.recv_multipart()[0] == b"rx-0"
        assert (gate.refused, gate.handshake_failed) == (0, 0)

        with pytest.raises(TimeoutError):  # the sender does not speak the queue's protocol: no reply
            RemoteController(f"tcp://127.0.0.1:{sender.port}", rpc_grace_s=1.0, secret=SECRET)
        assert sender.recv(2.0, lambda rid, msg: None) is None  # its request arrived and was dropped as malformed
        stats = sender.stats()
        assert stats["malformed_total"] >= 1 and stats["auth"] == {"refused": 0, "handshake_failed": 0}, stats
    finally:
        rx.close()
        sender.close()
        gate.close()
        router.close(0)
        ctx.term()


def test_pid_alive():
    assert pid_alive(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert not pid_alive(child.pid)  # exited and reaped
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    os.waitid(os.P_PID, zombie.pid, os.WEXITED | os.WNOWAIT)  # exited, not reaped: a zombie
    try:
        assert not pid_alive(zombie.pid)
    finally:
        zombie.wait()


def test_decoders_refuse_ext_types():
    assert decoder(list[int]).decode(msgspec.msgpack.encode([1, 2])) == [1, 2]
    with pytest.raises(ValueError, match="ext type 7"):
        decoder().decode(msgspec.msgpack.encode({"a": msgspec.msgpack.Ext(7, b"x")}))


def test_unlink_orphan_removes_a_file_only_once_its_owner_let_go_of_its_lock(tmp_path):
    path = str(tmp_path / "segment")
    owner = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(owner, fcntl.LOCK_SH)  # what a live owner holds
    assert unlink_orphan(path) == 0 and os.path.exists(path)
    os.close(owner)  # the owner is gone: the kernel dropped its lock
    assert unlink_orphan(path) == 1 and not os.path.exists(path)
    assert unlink_orphan(path) == 0  # gone already
    os.symlink("/etc/hostname", path)
    assert unlink_orphan(path) == 0 and os.path.islink(path)  # never follows a link
