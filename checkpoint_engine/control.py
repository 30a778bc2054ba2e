"""The sender's control socket: a ZeroMQ ROUTER that only ever hands on well-formed records.

Every frame a peer sends is checked before the sender sees it: exactly two parts (routing id,
payload), a routing id that is a receiver id (UTF-8, not ZeroMQ's generated `\\0...` one), at most
`MAX_INBOUND` bytes, a strict `wire.decode`, and the sender's own checks (`admit`: is this peer a
member, does this update / bucket exist). A frame that fails is counted by reason in `malformed`
and dropped: nothing a stranger sends raises out of `recv`. Frames over `SOCKET_INBOUND` (or
`WeightsConfig.max_message_bytes` if smaller) never reach it: ZeroMQ drops that peer before it
buffers the frame (ZMQ_MAXMSGSIZE), and that limit holds during the CURVE handshake too, so a peer
without the secret makes the sender hold at most that much; a handshake not done within
`plane_common.listener.HANDSHAKE_S` closes the connection, and a connection past
`WeightsConfig.max_connections` is shut at once (counted in `stats()["connections_refused"]`).

The socket binds `config.host` only, on a context of its own (one ZAP handler per context), and
is a CURVE server when `config.secret` is set: all of that is the `Gate` both planes share
(`plane_common.listener`).

Sends never block and never raise: the socket is ZMQ_ROUTER_MANDATORY, so `send` says whether the
receiver is connected at all (False: no connection holds its id, e.g. its process died); a frame
for a receiver whose queue is full is dropped, as a plain ROUTER would.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Callable

import zmq

from checkpoint_engine.config import WeightsConfig
from checkpoint_engine.wire import MAX_ID, Malformed, Message, decode, encode
from plane_common.listener import Gate

MAX_INBOUND = 64 << 10
"""Largest frame a receiver sends (Join, Ack, Nack are < 2 KiB); bigger ones are `oversized`."""
SOCKET_INBOUND = 2 * MAX_INBOUND
"""ZMQ_MAXMSGSIZE of the sender's socket: a receiver's frames are small (the sender sends the big
ones), so a peer, before or after its handshake, is cut at this size."""
LATE_BURST = 1000
"""Frames still read after a deadline passed, so a flood cannot hold the sender past it."""

Admit = Callable[[str, Message], "str | None"]


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
        self.gate = Gate(self.ctx, config.secret, config.max_connections, name="weights-peers")
        self.sock = self.gate.server(self.ctx.socket(zmq.ROUTER), min(config.max_message_bytes, SOCKET_INBOUND))
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted receiver takes over its identity
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an id no connection holds fails the send: `send` says so
        self.port = self.gate.bind(self.sock, config.host, config.port)
        self.malformed: Counter[str] = Counter()

    def send(self, rid: str, msg: Message) -> bool:
        """Queue `msg` for `rid`; False when no connection holds that id (nothing was sent)."""
        try:
            self.sock.send_multipart([rid.encode(), encode(msg)], zmq.NOBLOCK)
        except zmq.Again:  # connected, its queue full (it does not read): dropped
            return True
        except zmq.ZMQError as e:
            if e.errno == zmq.EHOSTUNREACH:
                return False
            raise
        return True

    def recv(self, timeout_s: float, admit: Admit) -> tuple[str, Message] | None:
        """The next admitted (receiver id, record), or None once `timeout_s` passed without one."""
        deadline = time.monotonic() + timeout_s
        late = 0
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                late += 1
                if late > LATE_BURST:
                    return None
            if not self.sock.poll(max(0, int(left * 1000))):
                return None
            got = self._check(self.sock.recv_multipart(), admit)
            if isinstance(got, str):
                self.malformed[got] += 1
            else:
                return got

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
                                  "connections_refused": self.gate.connections_refused}
        if self.gate.secret:
            out["auth"] = {"refused": self.gate.refused, "handshake_failed": self.gate.handshake_failed}
        return out

    def close(self) -> None:
        self.gate.close()
        self.sock.close(0)
        self.ctx.term()
