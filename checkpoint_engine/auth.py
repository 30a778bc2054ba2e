"""ZeroMQ CURVE for the weight plane: keys derived from the run's secret, a ZAP gate that counts.

With `WeightsConfig.secret` set, the sender's ROUTER is a CURVE server and every receiver a
CURVE client. Both key pairs are derived from the secret (`curve_keys`, identical in every
package of asyncrl that derives them), so a process that knows the secret can join and one
that does not cannot: without the server's public key its handshake fails to decrypt
(`handshake_failed`), and a client key other than the derived one is refused by the ZAP
callback (`refused`). Both counts are in `Sender.stats()["auth"]`.

What it does not do: rotate keys, or tell receivers apart (they share the client pair; identity
is the ZeroMQ routing id, checked against `Join.receiver_id`).
"""

from __future__ import annotations

import hashlib
import os
import socket
import threading

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85
from zmq.utils.monitor import recv_monitor_message


def curve_keys(secret: str) -> tuple[bytes, bytes, bytes, bytes]:
    """(server public, server secret, client public, client secret), z85-encoded."""
    def pair(role: bytes):
        sk = z85.encode(hashlib.sha256(b"asyncrl/curve/" + role + b"\0" + secret.encode()).digest())
        return zmq.curve_public(sk), sk
    (spub, ssec), (cpub, csec) = pair(b"server"), pair(b"client")
    return spub, ssec, cpub, csec


class _OnlyKey:
    """ZAP credentials provider: admits one client public key, counts the others."""

    def __init__(self, allowed: bytes) -> None:
        self.allowed = allowed
        self.refused = 0
        self._lock = threading.Lock()

    def callback(self, domain: str, key: bytes) -> bool:
        if key == self.allowed:
            return True
        with self._lock:
            self.refused += 1
        return False


_FAILED = zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH


class CurveServer:
    """Makes `sock` (not yet bound) a CURVE server admitting only the secret's client key.

    Starts a ZAP handler on the socket's context (one per context: give each sender its own);
    failed handshakes are counted by the listener's `Peers`."""

    def __init__(self, ctx: zmq.Context, sock: zmq.Socket, secret: str) -> None:
        spub, ssec, cpub, _ = curve_keys(secret)
        self.provider = _OnlyKey(cpub)
        self.authenticator = ThreadAuthenticator(ctx)
        self.authenticator.start()
        self.authenticator.configure_curve_callback(domain="*", credentials_provider=self.provider)
        sock.curve_secretkey = ssec
        sock.curve_publickey = spub
        sock.curve_server = True
        self.peers: Peers | None = None

    def counts(self) -> dict[str, int]:
        failed = self.peers.handshake_failed if self.peers is not None else 0
        return {"refused": self.provider.refused, "handshake_failed": failed}

    def close(self) -> None:
        self.authenticator.stop()


class Peers:
    """The connections of one bound listener, watched on a thread: failed handshakes are counted
    (`handshake_failed`), and a connection past `limit` is shut at once (`refused`), so strangers
    cannot hold more than `limit` connections' buffers."""

    def __init__(self, sock: zmq.Socket, port: int, limit: int) -> None:
        self.limit, self.port = limit, port
        self.handshake_failed = 0
        self.refused = 0
        self._mon = sock.get_monitor_socket(_FAILED | zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="weights-peers", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        open_fds: set[int] = set()
        while not self._stop.is_set():
            if not self._mon.poll(100):
                continue
            ev = recv_monitor_message(self._mon)
            kind, fd = ev["event"], ev["value"]
            if kind == zmq.EVENT_ACCEPTED:
                if len(open_fds) >= self.limit:
                    self.refused += _shut(fd, self.port)
                else:
                    open_fds.add(fd)
            elif kind == zmq.EVENT_DISCONNECTED:
                open_fds.discard(fd)
            elif kind & _FAILED:
                self.handshake_failed += 1
        self._mon.close(0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def _shut(fd: int, port: int) -> int:
    """Shut down the accepted connection `fd` of the listener on `port` (ZeroMQ then sees its peer
    leave and drops it): 1, or 0 if `fd` is no longer such a connection (closed and reused)."""
    try:
        s = socket.socket(fileno=os.dup(fd))
    except OSError:
        return 0
    try:
        if s.getsockname()[1] != port:
            return 0
        s.shutdown(socket.SHUT_RDWR)
        return 1
    except OSError:
        return 0
    finally:
        s.close()


def curve_client(sock: zmq.Socket, secret: str) -> None:
    """Makes `sock` (not yet connected) a CURVE client of the secret's server."""
    spub, _, cpub, csec = curve_keys(secret)
    sock.curve_serverkey = spub
    sock.curve_publickey = cpub
    sock.curve_secretkey = csec
