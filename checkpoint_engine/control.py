"""The sender's control socket: a ZeroMQ ROUTER that only ever hands on well-formed records.

Every frame a peer sends is checked before the sender sees it: exactly two parts (routing id,
payload), a routing id that is a receiver id (UTF-8, not ZeroMQ's generated `\\0...` one), at most
`MAX_INBOUND` bytes, a strict `wire.decode`, and the sender's own checks (`admit`: is this peer a
member, does this update / bucket exist). A frame that fails is counted by reason in `malformed`
and dropped: nothing a stranger sends raises out of `recv`. Frames over `SOCKET_INBOUND` (or
`WeightsConfig.max_message_bytes` if smaller) never reach it: ZeroMQ drops that peer before it
buffers the frame (ZMQ_MAXMSGSIZE), and that limit holds during the CURVE handshake too, so a peer
without the secret makes the sender hold at most that much; a handshake not done within
`HANDSHAKE_S` closes the connection, and a connection past `WeightsConfig.max_connections` is shut
at once (`auth.Peers`, counted in `stats()["connections_refused"]`).

A receiver whose connection closes (its process died, or it closed) reaches the sender as a
`DISCONNECTED` record from that receiver: the listener's watcher (`auth.Peers`) reports the closed
descriptor and the socket knows which receiver last sent on it (ZMQ_SRCFD of its frames), so a
publish drops a dead member at once instead of waiting `timeout_s` for its acks. (ZMQ_ROUTER_NOTIFY
would say it directly, but it is a draft option that pyzmq's libzmq does not have.)

The socket binds `config.host` only, on a context of its own (one ZAP handler per context), and
is a CURVE server when `config.secret` is set (`auth.py`).
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Callable

import zmq

from checkpoint_engine.auth import CurveServer, Peers
from checkpoint_engine.config import WeightsConfig
from checkpoint_engine.wire import MAX_ID, Malformed, Message, decode, encode

MAX_INBOUND = 64 << 10
"""Largest frame a receiver sends (Join, Ack, Nack are < 2 KiB); bigger ones are `oversized`."""
SOCKET_INBOUND = 2 * MAX_INBOUND
"""ZMQ_MAXMSGSIZE of the sender's socket: a receiver's frames are small (the sender sends the big
ones), so a peer, before or after its handshake, is cut at this size."""
HANDSHAKE_S = 10
"""Seconds a connecting peer has to finish the ZeroMQ (CURVE) handshake."""
LATE_BURST = 1000
"""Frames still read after a deadline passed, so a flood cannot hold the sender past it."""

CLOSED_CHECK_S = 0.1
"""While waiting, how often closed connections are looked at (the longest a DISCONNECTED waits)."""

Admit = Callable[[str, Message], "str | None"]


class Disconnected:
    """The record `recv` returns for a receiver whose connection closed (not a wire message)."""

    def __repr__(self) -> str:
        return "DISCONNECTED"


DISCONNECTED = Disconnected()


def receiver_id(ident: bytes) -> str | None:
    """The receiver id in a routing id, or None (ZeroMQ's generated ids start with a zero byte)."""
    if not ident or ident[0] == 0 or len(ident) > MAX_ID:
        return None
    try:
        return ident.decode()
    except UnicodeDecodeError:
        return None


class SenderSocket:
    def __init__(self, config: WeightsConfig) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.linger = 0
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted receiver takes over its identity
        self.sock.maxmsgsize = min(config.max_message_bytes, SOCKET_INBOUND)
        self.sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_S * 1000)
        self.auth = CurveServer(self.ctx, self.sock, config.secret) if config.secret else None
        if config.port:
            self.sock.bind(f"tcp://{config.host}:{config.port}")
            self.port = config.port
        else:
            self.port = self.sock.bind_to_random_port(f"tcp://{config.host}")
        self.peers = Peers(self.sock, self.port, config.max_connections)
        if self.auth is not None:
            self.auth.peers = self.peers
        self.malformed: Counter[str] = Counter()
        self._fd_of: dict[int, str] = {}
        """Connection descriptor -> the receiver whose admitted frames last came on it."""
        self._fd_for: dict[str, int] = {}
        """Receiver -> the descriptor it last sent on (`_fd_of` inverted)."""
        self._gone: list[str] = []
        """Receivers whose connection closed, not yet returned by `recv`."""

    def send(self, rid: str, msg: Message) -> None:
        self.sock.send_multipart([rid.encode(), encode(msg)])

    def recv(self, timeout_s: float, admit: Admit) -> tuple[str, Message | Disconnected] | None:
        """The next admitted (receiver id, record), or (receiver id, `DISCONNECTED`) when the connection
        that receiver last sent on closed, or None once `timeout_s` passed without either."""
        deadline = time.monotonic() + timeout_s
        late = 0
        while True:
            self._gone += self.closed_receivers()
            if self._gone:
                return self._gone.pop(0), DISCONNECTED
            left = deadline - time.monotonic()
            if left <= 0:
                late += 1
                if late > LATE_BURST:
                    return None
            if not self.sock.poll(max(0, int(min(left, CLOSED_CHECK_S) * 1000))):
                if left <= CLOSED_CHECK_S:
                    return None
                continue
            frames = self.sock.recv_multipart(copy=False)
            got = self._check([f.bytes for f in frames], admit)
            if isinstance(got, str):
                self.malformed[got] += 1
            else:
                self._saw(got[0], frames[-1].get(zmq.SRCFD))  # after `admit`: see closed_receivers
                return got

    def _saw(self, rid: str, fd: int) -> None:
        """`rid` sent on `fd`: from now on that connection's close is its; an older one's is nobody's."""
        old = self._fd_for.get(rid)
        if old != fd:
            if old is not None and self._fd_of.get(old) == rid:
                del self._fd_of[old]
            self._fd_for[rid] = fd
        self._fd_of[fd] = rid

    def closed_receivers(self, settle: bool = False) -> list[str]:
        """The receivers whose connection (the one each last sent on) closed since the last call.
        `settle=True` first waits for the watcher to catch up (`Peers.settle`): the sender asks so
        when a receiver joins, so that the close of a restarted receiver's old connection (perhaps
        under the same descriptor number) is taken before its new connection's Join, never after."""
        fds = self.peers.settle() if settle else self.peers.take_closed()
        gone = [rid for rid in (self._fd_of.pop(fd, None) for fd in fds) if rid is not None]
        for rid in gone:
            self._fd_for.pop(rid, None)
        return gone

    @staticmethod
    def _check(frames: list[bytes], admit: Admit) -> tuple[str, Message] | str:
        if len(frames) != 2:
            return "parts"
        ident, data = frames
        rid = receiver_id(ident)
        if rid is None:
            return "identity"
        if len(data) > MAX_INBOUND:
            return "oversized"
        try:
            msg = decode(data)
        except Malformed as e:
            return e.reason
        reason = admit(rid, msg)
        return (rid, msg) if reason is None else reason

    def stats(self) -> dict[str, object]:
        out: dict[str, object] = {"malformed": dict(self.malformed), "malformed_total": sum(self.malformed.values()),
                                  "connections_refused": self.peers.refused}
        if self.auth is not None:
            out["auth"] = self.auth.counts()
        return out

    def close(self) -> None:
        self.peers.close()
        if self.auth is not None:
            self.auth.close()
        self.sock.close(0)
        self.ctx.term()
