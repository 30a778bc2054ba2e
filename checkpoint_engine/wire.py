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
"""

from __future__ import annotations

from dataclasses import astuple, dataclass, field
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
class End:
    update_id: int
    version: int


@dataclass
class Abort:
    update_id: int
    reason: str


_KINDS: dict[str, type] = {
    c.__name__: c for c in (Join, Begin, Group, Bucket, Ack, Nack, End, Abort)
}
Message = Join | Begin | Group | Bucket | Ack | Nack | End | Abort


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


def decode(data: bytes) -> Message:
    kind, *body = msgpack.unpackb(data, raw=False, strict_map_key=False)
    cls = _KINDS.get(kind)
    if cls is None:
        raise ValueError(f"unknown weight-plane message kind {kind!r}")
    if cls is Bucket:
        update_id, meta = body
        return Bucket(update_id, _meta_of(meta))
    return cls(*body)


def encode_meta(meta: BucketMeta) -> bytes:
    """One bucket's metadata alone (what a consuming transport hands to an engine's workers)."""
    return msgpack.packb(_meta_body(meta), use_bin_type=True)


def decode_meta(data: bytes) -> BucketMeta:
    return _meta_of(msgpack.unpackb(data, raw=False, strict_map_key=False))
