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

Before the handshake: ZeroMQ reads a peer's frames up to ZMQ_MAXMSGSIZE before the CURVE
handshake has decided anything, so every *listening* socket takes small frames only
(`LISTEN_FRAME_BYTES`; what the package sends to a listener is cut in parts that fit, see
`parts`/`joined`), has `HANDSHAKE_S` to finish its handshake, and keeps at most
`max_connections` peers at once (`Gate.bind`: the connection past the limit is shut at once,
counted in `Gate.connections_refused`). A stranger can therefore make a listener hold at most
about `max_connections * LISTEN_FRAME_BYTES` (plus the kernel's socket buffers), for
`HANDSHAKE_S` at a time.

This module knows sockets only: not ops, records or planes.
"""

from __future__ import annotations

import hashlib
import os
import socket
import threading

import zmq
from zmq.utils import z85
from zmq.utils.monitor import recv_monitor_message

LISTEN_FRAME_BYTES = 256 << 10
"""ZMQ_MAXMSGSIZE of every listening socket of the package (before and after the handshake)."""
PART_BYTES = LISTEN_FRAME_BYTES
"""Largest part of a message sent to a listener: requests and tensors travel as multipart messages
of parts this size (`parts`), joined again where they arrive (`joined`)."""
HANDSHAKE_S = 10
"""Seconds a connecting peer has to finish the ZeroMQ (CURVE) handshake with a listener."""
MAX_CONNECTIONS = 256
"""Peers a listener keeps at once (`queue.max_connections`)."""
_FAILED = zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH


def parts(data: bytes | memoryview, size: int = PART_BYTES) -> list[memoryview]:
    """`data` cut into consecutive views of at most `size` bytes (one empty part for empty data)."""
    view = memoryview(data).cast("B")
    return [view[i:i + size] for i in range(0, len(view), size)] or [view]


def joined(frames: list, limit: int) -> bytes | None:
    """The concatenation of `frames` (bytes or zmq.Frame), or None if it would exceed `limit` bytes."""
    bufs = [f.buffer if isinstance(f, zmq.Frame) else f for f in frames]
    if sum(len(b) for b in bufs) > limit:
        return None
    return bufs[0].tobytes() if len(bufs) == 1 and isinstance(bufs[0], memoryview) else b"".join(bufs)


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
        sock = gate.server(ctx.socket(zmq.ROUTER))        # before bind
        port = gate.bind(sock, "127.0.0.1")               # binds, then watches its connections
        ...; gate.refused; gate.close()
    """

    def __init__(self, ctx: zmq.Context, secret: str, max_connections: int = MAX_CONNECTIONS) -> None:
        self.secret = secret
        self.max_connections = max_connections
        self.connections_refused = 0
        """Connections shut at once because `max_connections` peers were already connected."""
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

    def server(self, sock: zmq.Socket, max_frame_bytes: int = LISTEN_FRAME_BYTES) -> zmq.Socket:
        """Limit frames (to `max_frame_bytes`, at most `LISTEN_FRAME_BYTES`), bound the handshake and,
        with a secret, make `sock` a CURVE server. Call before `bind`."""
        sock.setsockopt(zmq.MAXMSGSIZE, min(max_frame_bytes, LISTEN_FRAME_BYTES))
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_S * 1000)
        if self._provider is not None:
            sock.curve_secretkey = self._keys[1]
            sock.curve_publickey = self._keys[0]
            sock.curve_server = True
        return sock

    def bind(self, sock: zmq.Socket, host: str, port: int = 0) -> int:
        """Bind `sock` (made by `server`) to `host:port` (0: a free port) and watch its connections:
        failed handshakes are counted, a peer past `max_connections` is shut at once. Returns the port."""
        if port:
            sock.bind(f"tcp://{host}:{port}")
        else:
            port = sock.bind_to_random_port(f"tcp://{host}")
        mon = sock.get_monitor_socket(_FAILED | zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        t = threading.Thread(target=self._watch, args=(mon, port), name="tq-auth-monitor", daemon=True)
        t.start()
        self._monitors.append(t)
        return port

    def _watch(self, mon: zmq.Socket, port: int) -> None:
        peers: set[int] = set()  # descriptors of the connections this listener holds
        while not self._stop.is_set():
            if not mon.poll(100):
                continue
            ev = recv_monitor_message(mon)
            kind, fd = ev["event"], ev["value"]
            if kind == zmq.EVENT_ACCEPTED:
                if len(peers) >= self.max_connections:
                    self.connections_refused += _shut(fd, port)
                else:
                    peers.add(fd)
            elif kind == zmq.EVENT_DISCONNECTED:
                peers.discard(fd)
            elif kind & _FAILED:
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


def _shut(fd: int, port: int) -> int:
    """Shut down the accepted connection `fd` of the listener on `port` (ZeroMQ then sees its peer
    leave and drops it): 1, or 0 if `fd` is no longer such a connection."""
    try:
        s = socket.socket(fileno=os.dup(fd))
    except OSError:
        return 0
    try:
        if s.getsockname()[1] != port:  # the descriptor was closed and reused meanwhile
            return 0
        s.shutdown(socket.SHUT_RDWR)
        return 1
    except OSError:
        return 0
    finally:
        s.close()


def client(sock: zmq.Socket, secret: str, max_frame_bytes: int) -> zmq.Socket:
    """Limit inbound frames and, with a secret, make `sock` a CURVE client. Call before `connect`."""
    sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
    if secret:
        spub, _, cpub, csec = curve_keys(secret)
        sock.curve_serverkey = spub
        sock.curve_publickey = cpub
        sock.curve_secretkey = csec
    return sock
