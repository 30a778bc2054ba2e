"""Control-plane messages of the weight plane, encoded with msgpack (never pickle).

Bucket *bytes* travel on the data plane of the chosen backend; these records say what
the bytes are (names, dtypes, shapes, offsets), which update and version they belong to,
and who acknowledged what. A message is `[kind, *fields]` so that a peer can only ever
build one of the records below from what it receives.

Flow of one update (S = sender, R = receiver):

    R -> S  Join(receiver_id, version, width)     once, when the receiver starts (width: its ranks in a group)
    S -> R  Begin(update_id, version, info)        info: backend attachment (shm names, store ...)
    R -> S  Ack(update_id, -1)                     ready, once the server paused (gloo/nccl:
    S -> R  Group(update_id, epoch, rank, world)    then a Group, unless the last one still holds)
    S -> R  Bucket(update_id, meta)  ...           for each bucket; R pulls / joins the broadcast
    R -> S  Ack(update_id, index) | Nack(...)      after the bucket landed and its checksum matched
    S -> R  End(update_id, version) | Abort(update_id, reason)
    R -> S  Ack(update_id, -3) | Nack(update_id, -3, reason)   loaded: the engine serves the new weights
                                                   (or could not load them); the publish returns after these

Liveness (a receiver evicted for a timeout re-joins; `Sender` docstring has the trace):

    R -> S  Join(...)          S -> R  Probe(nonce)          R -> S  Pong(nonce)   -> a member again

`decode` is strict: a frame that is not one of these records, field by field with its exact
types and bounds, raises `Malformed(reason)` (a `ValueError`), never anything else, so an
endpoint can count and drop what a stranger or a broken peer sends.
"""

from __future__ import annotations

from dataclasses import astuple, dataclass, field, fields
from typing import Any

import msgpack


@dataclass
class Entry:
    """One tensor, or one chunk of a tensor larger than a bucket, inside a bucket.

    Invariant: `tensor_offset + nbytes <= numel(shape) * itemsize(dtype)`; the tensor is
    complete once chunks covering all its bytes have landed."""

    name: str
    dtype: str
    """torch dtype name without the `torch.` prefix, e.g. `bfloat16`."""
    shape: list[int]
    bucket_offset: int
    """Byte offset of this chunk in the bucket (a multiple of 64)."""
    tensor_offset: int
    """Byte offset of this chunk inside the tensor."""
    nbytes: int


@dataclass
class BucketMeta:
    """What one bucket holds. `nbytes` bytes from the start of the slot are meaningful."""

    index: int
    """Position of the bucket in the update, from 0."""
    slot: int
    """Which of the sender's two buffers holds it (shm / nixl read from it)."""
    nbytes: int
    checksum: int | None
    """CRC32 of the first `nbytes` bytes, or None when checksums are off."""
    entries: list[Entry] = field(default_factory=list)


@dataclass
class Join:
    receiver_id: str
    version: int
    """Version the receiver holds now (-1: no weights yet)."""
    width: int = 1
    """Ranks it takes in a gloo/nccl group: one per engine worker that receives the bytes itself
    (e.g. the tensor-parallel workers of one vLLM server)."""


@dataclass
class Begin:
    update_id: int
    version: int
    info: dict[str, Any]
    """Backend attachment data (plain msgpack values)."""


@dataclass
class Group:
    """gloo/nccl: build process group `epoch` with this rank and world size."""

    update_id: int
    epoch: int
    rank: int
    world_size: int


@dataclass
class Bucket:
    update_id: int
    meta: BucketMeta


@dataclass
class Ack:
    update_id: int
    index: int
    """Bucket index acknowledged; -1 acknowledges `Begin` (ready), -2 a group, -3 the load of the
    whole update (the engine serves it)."""


@dataclass
class Nack:
    update_id: int
    index: int
    reason: str
    """`checksum` (refused, evicted) or `transport` (alive, needs a new group)."""


@dataclass
class Probe:
    """S -> R: prove you read your socket (sent to a timed-out receiver that joins again)."""

    nonce: int


@dataclass
class Pong:
    """R -> S: answer to `Probe` with its nonce."""

    nonce: int


@dataclass
class End:
    update_id: int
    version: int


@dataclass
class Abort:
    update_id: int
    reason: str


_KINDS: dict[str, type] = {
    c.__name__: c for c in (Join, Begin, Group, Bucket, Ack, Nack, End, Abort, Probe, Pong)
}
Message = Join | Begin | Group | Bucket | Ack | Nack | End | Abort | Probe | Pong

MAX_ID = 255
"""Longest receiver id (a ZeroMQ routing identity is at most 255 bytes)."""
MAX_REASON = 1024
MAX_WIDTH = 4096
_I64 = (-(1 << 63), (1 << 63) - 1)


class Malformed(ValueError):
    """A frame that is not a valid weight-plane record; `reason` names what was wrong
    (`msgpack`, `kind`, `fields`)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


def _int(v: Any, lo: int = _I64[0], hi: int = _I64[1]) -> bool:
    return type(v) is int and lo <= v <= hi


def _str(v: Any, limit: int) -> bool:
    return type(v) is str and len(v) <= limit


_CHECKS: dict[type, Any] = {
    Join: lambda b: _str(b[0], MAX_ID) and bool(b[0]) and _int(b[1], -1) and _int(b[2], 1, MAX_WIDTH),
    Begin: lambda b: _int(b[0], 1) and _int(b[1], 0) and type(b[2]) is dict and all(type(k) is str for k in b[2]),
    Group: lambda b: _int(b[0], 1) and _int(b[1], 1) and _int(b[3], 2) and _int(b[2], 1, b[3] - 1),
    Ack: lambda b: _int(b[0], 1) and _int(b[1], -3),
    Nack: lambda b: _int(b[0], 1) and _int(b[1], -3) and _str(b[2], MAX_REASON),
    End: lambda b: _int(b[0], 1) and _int(b[1], 0),
    Abort: lambda b: _int(b[0], 0) and _str(b[1], MAX_REASON),
    Probe: lambda b: _int(b[0]),
    Pong: lambda b: _int(b[0]),
}
_ARITY = {Join: (2, 3), Bucket: (2,)}


def _entry_ok(e: Any) -> bool:
    return (type(e) is list and len(e) == 6 and _str(e[0], 4096) and _str(e[1], 64)
            and type(e[2]) is list and all(_int(d, 0) for d in e[2]) and all(_int(v, 0) for v in e[3:]))


def _meta_ok(body: Any) -> bool:
    return (type(body) is list and len(body) == 5 and _int(body[0], 0) and _int(body[1], 0, 1)
            and _int(body[2], 0) and (body[3] is None or _int(body[3], 0, 0xFFFFFFFF))
            and type(body[4]) is list and all(_entry_ok(e) for e in body[4]))


def _meta_body(m: BucketMeta) -> list[Any]:
    return [m.index, m.slot, m.nbytes, m.checksum, [astuple(e) for e in m.entries]]


def _meta_of(body: list[Any]) -> BucketMeta:
    index, slot, nbytes, checksum, entries = body
    return BucketMeta(index, slot, nbytes, checksum, [Entry(*e) for e in entries])


def encode(msg: Message) -> bytes:
    if isinstance(msg, Bucket):
        body = [msg.update_id, _meta_body(msg.meta)]
    else:
        body = list(astuple(msg))
    return msgpack.packb([type(msg).__name__, *body], use_bin_type=True)


def _unpack(data: bytes) -> Any:
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as e:  # translated: msgpack raises many types (ExtraData, FormatError, TypeError ...)
        raise Malformed("msgpack", f"not msgpack: {type(e).__name__}") from None


def decode(data: bytes) -> Message:
    """The record in `data`; `Malformed` when it is not exactly one of the records above."""
    obj = _unpack(data)
    if type(obj) is not list or not obj or type(obj[0]) is not str:
        raise Malformed("kind", "not a [kind, *fields] list")
    kind, *body = obj
    cls = _KINDS.get(kind)
    if cls is None:
        raise Malformed("kind", f"unknown weight-plane message kind {kind[:64]!r}")
    arity = _ARITY.get(cls, (len(fields(cls)),))
    if len(body) not in arity:
        raise Malformed("fields", f"{kind}: {len(body)} fields")
    if cls is Bucket:
        if not (_int(body[0], 1) and _meta_ok(body[1])):
            raise Malformed("fields", "Bucket: bad field")
        return Bucket(body[0], _meta_of(body[1]))
    if cls is Join and len(body) == 2:
        body.append(1)
    if not _CHECKS[cls](body):
        raise Malformed("fields", f"{kind}: bad field")
    return cls(*body)


def encode_meta(meta: BucketMeta) -> bytes:
    """One bucket's metadata alone (what a consuming transport hands to an engine's workers)."""
    return msgpack.packb(_meta_body(meta), use_bin_type=True)


def decode_meta(data: bytes) -> BucketMeta:
    body = _unpack(data)
    if not _meta_ok(body):
        raise Malformed("fields", "bucket metadata: bad field")
    return _meta_of(body)
