"""Control-plane messages of the weight plane: msgspec Structs encoded with msgpack (never pickle).

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

Each record is an array-like msgspec Struct tagged by its class name (`["Ack", 1, 3]`), and
`decode` is one typed msgspec decoder over their union: strict, a frame that is not one of
these records, field by field with its exact types and bounds (the `Meta` constraints
below), raises `Malformed(reason)` (a `ValueError`), never anything else, so an endpoint can
count and drop what a stranger or a broken peer sends.
"""

from __future__ import annotations

from typing import Annotated, Any, Union

import msgspec

from plane_common.strict_msgpack import decoder

MAX_ID = 255
"""Longest receiver id (a ZeroMQ routing identity is at most 255 bytes)."""
MAX_REASON = 1024
MAX_WIDTH = 4096
_I64 = (-(1 << 63), (1 << 63) - 1)


def _int(lo: int = _I64[0], hi: int = _I64[1]) -> Any:
    return Annotated[int, msgspec.Meta(ge=lo, le=hi)]


Reason = Annotated[str, msgspec.Meta(max_length=MAX_REASON)]
UpdateId = _int(1)


class Entry(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """One tensor, or one chunk of a tensor larger than a bucket, inside a bucket.

    Invariant: `tensor_offset + nbytes <= numel(shape) * itemsize(dtype)`; the tensor is
    complete once chunks covering all its bytes have landed."""

    name: Annotated[str, msgspec.Meta(max_length=4096)]
    dtype: Annotated[str, msgspec.Meta(max_length=64)]
    """torch dtype name without the `torch.` prefix, e.g. `bfloat16`."""
    shape: list[_int(0)]  # type: ignore[valid-type]
    bucket_offset: _int(0)  # type: ignore[valid-type]
    """Byte offset of this chunk in the bucket (a multiple of 64)."""
    tensor_offset: _int(0)  # type: ignore[valid-type]
    """Byte offset of this chunk inside the tensor."""
    nbytes: _int(0)  # type: ignore[valid-type]


class BucketMeta(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """What one bucket holds. `nbytes` bytes from the start of the slot are meaningful."""

    index: _int(0)  # type: ignore[valid-type]
    """Position of the bucket in the update, from 0."""
    slot: _int(0, 1)  # type: ignore[valid-type]
    """Which of the sender's two buffers holds it (shm / nixl read from it)."""
    nbytes: _int(0)  # type: ignore[valid-type]
    checksum: _int(0, 0xFFFFFFFF) | None  # type: ignore[valid-type]
    """CRC32 of the first `nbytes` bytes, or None when checksums are off."""
    entries: list[Entry] = msgspec.field(default_factory=list)


class _Msg(msgspec.Struct, array_like=True, tag=True, forbid_unknown_fields=True):
    """A control record: on the wire `[class name, *fields]`."""


class Join(_Msg):
    receiver_id: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_ID)]
    version: _int(-1)  # type: ignore[valid-type]
    """Version the receiver holds now (-1: no weights yet)."""
    width: _int(1, MAX_WIDTH) = 1  # type: ignore[valid-type]
    """Ranks it takes in a gloo/nccl group: one per engine worker that receives the bytes itself
    (e.g. the tensor-parallel workers of one vLLM server)."""


class Begin(_Msg):
    update_id: UpdateId
    version: _int(0)  # type: ignore[valid-type]
    info: dict[str, Any]
    """Backend attachment data (plain msgpack values)."""


class Group(_Msg):
    """gloo/nccl: build process group `epoch` with this rank and world size (1 <= rank < world_size)."""

    update_id: UpdateId
    epoch: _int(1)  # type: ignore[valid-type]
    rank: _int(1)  # type: ignore[valid-type]
    world_size: _int(2)  # type: ignore[valid-type]

    def __post_init__(self) -> None:
        if self.rank >= self.world_size:
            raise ValueError(f"Group: rank {self.rank} outside world {self.world_size}")


class Bucket(_Msg):
    update_id: UpdateId
    meta: BucketMeta


class Ack(_Msg):
    update_id: UpdateId
    index: _int(-3)  # type: ignore[valid-type]
    """Bucket index acknowledged; -1 acknowledges `Begin` (ready), -2 a group, -3 the load of the
    whole update (the engine serves it)."""


class Nack(_Msg):
    update_id: UpdateId
    index: _int(-3)  # type: ignore[valid-type]
    reason: Reason
    """`checksum` (refused, evicted) or `transport` (alive, needs a new group)."""


class Probe(_Msg):
    """S -> R: prove you read your socket (sent to a timed-out receiver that joins again)."""

    nonce: _int()  # type: ignore[valid-type]


class Pong(_Msg):
    """R -> S: answer to `Probe` with its nonce."""

    nonce: _int()  # type: ignore[valid-type]


class End(_Msg):
    update_id: UpdateId
    version: _int(0)  # type: ignore[valid-type]


class Abort(_Msg):
    update_id: _int(0)  # type: ignore[valid-type]
    reason: Reason


Message = Union[Join, Begin, Group, Bucket, Ack, Nack, End, Abort, Probe, Pong]


class Malformed(ValueError):
    """A frame that is not a valid weight-plane record; `reason` names what was wrong
    (`msgpack`, `kind`, `fields`)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


_encoder = msgspec.msgpack.Encoder()
_messages = decoder(Message)
_metas = decoder(BucketMeta)


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


_untyped = decoder()


def _reason(e: msgspec.ValidationError, data: bytes) -> str:
    """`msgpack` when the frame is not msgpack at all (the typed decoder may refuse a field before
    it sees the truncation), `kind` when it is no `[kind, ...]` array of a known kind, else `fields`."""
    try:
        _untyped.decode(data)
    except (msgspec.DecodeError, ValueError, RecursionError):
        return "msgpack"
    text = str(e)
    if text.endswith("at `$[0]`") or text.startswith("Expected `array`, got") or text.endswith("length 1, got 0"):
        return "kind"
    return "fields"


def decode(data: bytes) -> Message:
    """The record in `data`; `Malformed` when it is not exactly one of the records above."""
    try:
        return _messages.decode(data)
    except msgspec.ValidationError as e:
        reason = _reason(e, data)
        what = {"kind": "unknown weight-plane message kind", "fields": "bad field"}.get(reason, "not msgpack")
        raise Malformed(reason, f"{what}: {e}") from None
    except (msgspec.DecodeError, ValueError, RecursionError) as e:  # ext types refused, bytes not msgpack
        raise Malformed("msgpack", f"not msgpack: {type(e).__name__}") from None


def encode_meta(meta: BucketMeta) -> bytes:
    """One bucket's metadata alone (what a consuming transport hands to an engine's workers)."""
    return _encoder.encode(meta)


def decode_meta(data: bytes) -> BucketMeta:
    try:
        return _metas.decode(data)
    except msgspec.ValidationError as e:
        raise Malformed("fields", f"bucket metadata: bad field ({e})") from None
    except (msgspec.DecodeError, ValueError, RecursionError) as e:
        raise Malformed("msgpack", f"not msgpack: {type(e).__name__}") from None
