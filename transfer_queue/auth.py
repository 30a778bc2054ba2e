"""The data plane's listeners: small frames only, and requests cut into parts that fit.

Every listening socket of the package (controller ROUTER, zmq storage unit, arena free endpoints)
goes through a `Gate` (`plane_common.listener`, shared with the weight plane): with `queue.secret`
set it is a CURVE server whose ZAP handler admits only the client key derived from the secret,
every connecting socket is a CURVE client (`plane_common.curve.client`), a peer without the secret
gets no answer at all and the refusal is counted (`Gate.refused`). With an empty secret nothing is
authenticated (standalone use on a trusted host).

What differs here: ZeroMQ reads a peer's frames up to ZMQ_MAXMSGSIZE before the CURVE handshake has
decided anything, so every listener of this package takes frames of at most `LISTEN_FRAME_BYTES`
whatever the configured limit (`Gate.server`); what the package sends to a listener is cut in parts
that fit (`parts`) and joined where it arrives (`joined`). A stranger can therefore make a listener
hold at most about `max_connections * LISTEN_FRAME_BYTES` (plus the kernel's socket buffers), for
`plane_common.listener.HANDSHAKE_S` at a time.

This module knows sockets only: not ops, records or planes.
"""

from __future__ import annotations

import zmq

from plane_common import listener

LISTEN_FRAME_BYTES = 256 << 10
"""ZMQ_MAXMSGSIZE of every listening socket of the package (before and after the handshake)."""
CURVE_OVERHEAD_BYTES = 1024
"""Room left in each part for what CURVE adds to a frame on the wire (its MESSAGE command, nonce and
MAC: tens of bytes) and what the framing adds: ZeroMQ checks ZMQ_MAXMSGSIZE against the frame as it
arrives, so a part of exactly `LISTEN_FRAME_BYTES` was dropped with its connection once a secret was set."""
PART_BYTES = LISTEN_FRAME_BYTES - CURVE_OVERHEAD_BYTES
"""Largest part of a message sent to a listener: requests and tensors travel as multipart messages
of parts this size (`parts`), joined again where they arrive (`joined`)."""
MAX_CONNECTIONS = 256
"""Peers a listener keeps at once (`queue.max_connections`)."""


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


class Gate(listener.Gate):
    """The shared gate, whose listeners take frames of at most `LISTEN_FRAME_BYTES`.

    Example:
        gate = Gate(ctx, secret)                          # starts the ZAP handler (if secret)
        sock = gate.server(ctx.socket(zmq.ROUTER))        # before bind
        port = gate.bind(sock, "127.0.0.1")               # binds, then watches its connections
        ...; gate.refused; gate.close()
    """

    def __init__(self, ctx: zmq.Context, secret: str, max_connections: int = MAX_CONNECTIONS) -> None:
        super().__init__(ctx, secret, max_connections, name="tq-auth")

    def server(self, sock: zmq.Socket, max_frame_bytes: int = LISTEN_FRAME_BYTES) -> zmq.Socket:
        return super().server(sock, min(max_frame_bytes, LISTEN_FRAME_BYTES))
