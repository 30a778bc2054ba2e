"""The run's secret -> ZeroMQ CURVE keys, and the client side of a CURVE socket.

Both key pairs (server and client) are derived from the secret, so every process that knows it
can serve or connect to any other of the run, and nothing else is exchanged. The derivation is a
wire format: a changed byte splits the processes of one run (tests pin it). The listening side is
`listener.Gate`.

What it does not do: rotate keys, or tell clients apart (they share the client pair; a plane
tells peers apart by what it checks in their messages).
"""

from __future__ import annotations

import hashlib

import zmq
from zmq.utils import z85


def curve_keys(secret: str) -> tuple[bytes, bytes, bytes, bytes]:
    """(server public, server secret, client public, client secret), z85-encoded, from `secret`."""
    def pair(role: bytes) -> tuple[bytes, bytes]:
        sk = z85.encode(hashlib.sha256(b"asyncrl/curve/" + role + b"\0" + secret.encode()).digest())
        return zmq.curve_public(sk), sk
    (spub, ssec), (cpub, csec) = pair(b"server"), pair(b"client")
    return spub, ssec, cpub, csec


def client(sock: zmq.Socket, secret: str, max_frame_bytes: int) -> zmq.Socket:
    """Limit inbound frames to `max_frame_bytes` (a bigger one closes the connection before it is
    buffered) and, with a secret, make `sock` a CURVE client of the secret's servers. Call before
    `connect`; an empty secret authenticates nothing (standalone use on a trusted host)."""
    sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
    if secret:
        spub, _, cpub, csec = curve_keys(secret)
        sock.curve_serverkey = spub
        sock.curve_publickey = cpub
        sock.curve_secretkey = csec
    return sock
