"""The gate of a context's listening sockets: what a stranger can make a listener do, bounded.

Every listening socket of either plane goes through one `Gate`:
- frames: ZMQ_MAXMSGSIZE (`server(sock, max_frame_bytes)`), which ZeroMQ applies before the
  CURVE handshake has decided anything, so a frame over it closes the connection unbuffered;
- handshake: a connecting peer has `HANDSHAKE_S` to finish it;
- secret: with the run's secret the socket is a CURVE server (`curve.curve_keys`) and the
  context's ZAP handler admits exactly the secret's client key; a peer without the secret never
  completes the handshake (`handshake_failed`), a client key other than the derived one is
  refused (`refused`). An empty secret authenticates nothing (standalone use on a trusted host);
- connections: a monitor thread per bound socket shuts at once a connection past
  `max_connections` (`connections_refused`).
So a stranger makes a listener hold at most about `max_connections` frames of the limit (plus the
kernel's socket buffers), for `HANDSHAKE_S` at a time.

This module knows sockets only: not records, ops or planes (each plane sets its own frame limits).
"""

from __future__ import annotations

import os
import socket
import threading

import zmq
from zmq.utils.monitor import recv_monitor_message

from plane_common.curve import curve_keys

HANDSHAKE_S = 10
"""Seconds a connecting peer has to finish the ZeroMQ (CURVE) handshake with a listener."""
_FAILED = zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH


class _OnlyKey:
    """ZAP credentials callback: admits exactly one client public key, counts the others."""

    def __init__(self, allowed: bytes) -> None:
        self.allowed = allowed
        self.refused = 0
        self._lock = threading.Lock()

    def callback(self, domain: str, key: bytes) -> bool:
        if key == self.allowed:  # pyzmq passes the z85 form
            return True
        with self._lock:
            self.refused += 1
        return False


class Gate:
    """The authentication and limits of one context's listening sockets (one gate per context: a
    context has one ZAP handler).

    Example:
        gate = Gate(ctx, secret, max_connections=256)            # starts the ZAP handler (if secret)
        sock = gate.server(ctx.socket(zmq.ROUTER), 1 << 16)      # before bind
        port = gate.bind(sock, "127.0.0.1")                      # binds, then watches its connections
        ...; gate.refused, gate.handshake_failed, gate.connections_refused; gate.close()
    """

    def __init__(self, ctx: zmq.Context, secret: str, max_connections: int, name: str = "gate") -> None:
        self.secret = secret
        self.max_connections = max_connections
        self.name = name
        """Prefix of the monitor threads' names."""
        self.connections_refused = 0
        """Connections shut at once because `max_connections` peers were already connected."""
        self.handshake_failed = 0
        """Peers whose handshake failed (no CURVE at all, or a wrong key), from socket monitors."""
        self._auth = None
        self._zap: _OnlyKey | None = None
        if secret:
            from zmq.auth.thread import ThreadAuthenticator

            spub, ssec, cpub, _ = curve_keys(secret)
            self._keys = (spub, ssec)
            self._zap = _OnlyKey(cpub)
            self._auth = ThreadAuthenticator(ctx)
            self._auth.start()
            self._auth.configure_curve_callback(domain="*", credentials_provider=self._zap)
        self._monitors: list[threading.Thread] = []
        self._stop = threading.Event()

    def server(self, sock: zmq.Socket, max_frame_bytes: int) -> zmq.Socket:
        """Limit frames to `max_frame_bytes`, bound the handshake and, with a secret, make `sock` a
        CURVE server. Call before `bind`."""
        sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_S * 1000)
        if self._zap is not None:
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
        t = threading.Thread(target=self._watch, args=(mon, port), name=f"{self.name}-monitor", daemon=True)
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
        """Peers refused by the ZAP handler (a client key other than the secret's)."""
        return self._zap.refused if self._zap is not None else 0

    def close(self) -> None:
        """Stop the monitors and the ZAP handler; call before closing the sockets' context."""
        self._stop.set()
        for t in self._monitors:
            t.join()
        if self._auth is not None:
            self._auth.stop()
            self._auth = None


def _shut(fd: int, port: int) -> int:
    """Shut down the accepted connection `fd` of the listener on `port` (ZeroMQ then sees its peer
    leave and drops it): 1, or 0 if `fd` is no longer such a connection (closed and reused)."""
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
