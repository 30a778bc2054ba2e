"""Per-run secret -> ZeroMQ CURVE on every socket of the package, and socket limits.

With `queue.secret` set, every listening socket (controller ROUTER, zmq storage unit,
arena free endpoints) is a CURVE server whose ZAP handler admits only the client key
derived from the secret; every connecting socket is a CURVE client. A peer without the
secret never completes the handshake: it gets no answer at all, and the refusal is
counted (`Gate.refused`). With an empty secret nothing is authenticated (standalone use
on a trusted host).

The key derivation is shared with another package of the project and must stay
byte-identical to `curve_keys` below. Every socket also gets `ZMQ_MAXMSGSIZE`, so a
frame over the limit closes the connection before it is buffered.

This module knows sockets only: not ops, records or planes.
"""

from __future__ import annotations

import hashlib
import threading

import zmq
from zmq.utils import z85


def curve_keys(secret: str) -> tuple[bytes, bytes, bytes, bytes]:
    """(server public, server secret, client public, client secret), z85-encoded, from `secret`."""
    def pair(role: bytes) -> tuple[bytes, bytes]:
        sk = z85.encode(hashlib.sha256(b"asyncrl/curve/" + role + b"\0" + secret.encode()).digest())
        return zmq.curve_public(sk), sk
    (spub, ssec), (cpub, csec) = pair(b"server"), pair(b"client")
    return spub, ssec, cpub, csec


class _Provider:
    """ZAP credentials callback: admits exactly one client public key, counts the rest."""

    def __init__(self, client_public: bytes) -> None:
        self.client_public = client_public
        self.refused = 0
        self._lock = threading.Lock()

    def callback(self, domain: str, key: bytes) -> bool:
        ok = key == self.client_public  # pyzmq passes the z85 form
        if not ok:
            with self._lock:
                self.refused += 1
        return ok


class Gate:
    """The authentication of one context's listening sockets (one per service or endpoint).

    Example:
        gate = Gate(ctx, secret)                  # starts the ZAP handler (if secret)
        sock = gate.server(ctx.socket(zmq.ROUTER), max_frame_bytes)   # before bind
        ...; gate.refused; gate.close()
    """

    def __init__(self, ctx: zmq.Context, secret: str) -> None:
        self.secret = secret
        self._auth = None
        self._provider: _Provider | None = None
        if secret:
            from zmq.auth.thread import ThreadAuthenticator

            spub, ssec, cpub, _ = curve_keys(secret)
            self._keys = (spub, ssec)
            self._provider = _Provider(cpub)
            self._auth = ThreadAuthenticator(ctx)
            self._auth.start()
            self._auth.configure_curve_callback(domain="*", credentials_provider=self._provider)
        self.handshake_failed = 0
        """Peers whose handshake failed (no CURVE at all, or a wrong key), from socket monitors."""
        self._monitors: list[threading.Thread] = []
        self._stop = threading.Event()

    def server(self, sock: zmq.Socket, max_frame_bytes: int) -> zmq.Socket:
        """Limit frames and, with a secret, make `sock` a CURVE server. Call before `bind`."""
        sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
        sock.setsockopt(zmq.LINGER, 0)
        if self._provider is not None:
            sock.curve_secretkey = self._keys[1]
            sock.curve_publickey = self._keys[0]
            sock.curve_server = True
            mon = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                                          | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
            t = threading.Thread(target=self._watch, args=(mon,), name="tq-auth-monitor", daemon=True)
            t.start()
            self._monitors.append(t)
        return sock

    def _watch(self, mon: zmq.Socket) -> None:
        while not self._stop.is_set():
            if mon.poll(100):
                mon.recv_multipart()
                self.handshake_failed += 1
        mon.close(0)

    @property
    def refused(self) -> int:
        """Peers refused by the ZAP handler (wrong or missing secret)."""
        return self._provider.refused if self._provider is not None else 0

    def close(self) -> None:
        """Stop the ZAP handler and monitors; call before closing the sockets' context."""
        self._stop.set()
        for t in self._monitors:
            t.join()
        if self._auth is not None:
            self._auth.stop()
            self._auth = None


def client(sock: zmq.Socket, secret: str, max_frame_bytes: int) -> zmq.Socket:
    """Limit inbound frames and, with a secret, make `sock` a CURVE client. Call before `connect`."""
    sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
    if secret:
        spub, _, cpub, csec = curve_keys(secret)
        sock.curve_serverkey = spub
        sock.curve_publickey = cpub
        sock.curve_secretkey = csec
    return sock
