"""The records of the queue: what producers put, what the controller keeps, what consumers get.

A record is generic: identity and scheduling fields (`uid`, `group_id`, `group_size`,
`version`), a msgpack-able `meta` dict, and named tensor fields. Tensor bytes never pass
through the controller: it holds one *handle* per field (a small map that tells the data
plane where the bytes are: a typed `storage.handles.Handle`). `SampleMeta`, `Batch` and
`QueueStats` are msgspec Structs: they travel as msgpack maps and are decoded, typed and
validated by msgspec (`sample_decoder`, `batch_decoder`, `stats_decoder`). A trajectory of asyncrl is put as scalar fields in `meta` and
per-token arrays as tensors; this module does not know that type.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any

import msgspec

from plane_common.strict_msgpack import decoder
from transfer_queue.codec import MAX_COUNT, MAX_INT, convert
from transfer_queue.storage.handles import Handle

Text = Annotated[str, msgspec.Meta(min_length=1, max_length=1024)]


@dataclass
class Record:
    """What a producer puts.

    Invariants: `uid` is unique in the run; the `group_size` records that share a
    `group_id` form one group and are delivered together; `version` is the oldest policy
    version that produced the record (staleness = current version - version).
    """

    uid: str
    group_id: str
    """Records with the same group id (the samples of one prompt) are delivered whole."""
    group_size: int = 1
    version: int = 0
    """Oldest policy version that generated any token of this record."""
    meta: dict[str, Any] = field(default_factory=dict)
    """msgpack-encodable metadata (reward, finish reason, ...); travels with `get`."""
    tensors: dict[str, Any] = field(default_factory=dict)
    """Field name -> numpy array or CPU torch tensor; written to the data plane by `put`."""
    sealed: bool = True
    """False when more fields will follow with `update` (prompt, then response, then reward);
    a consumer that asks for no particular fields waits until the record is sealed."""

    def validate(self) -> "Record":
        if not isinstance(self.uid, str) or not self.uid:
            raise ValueError(f"record uid must be a non-empty string, got {self.uid!r}")
        if not isinstance(self.group_id, str) or not self.group_id:
            raise ValueError(f"record {self.uid}: group_id must be a non-empty string")
        if not isinstance(self.group_size, int) or self.group_size < 1:
            raise ValueError(f"record {self.uid}: group_size={self.group_size} must be >= 1")
        if not isinstance(self.version, int):
            raise ValueError(f"record {self.uid}: version must be an int")
        return self


class SampleMeta(msgspec.Struct, forbid_unknown_fields=True):
    """What the controller holds per record and `get` returns: everything but tensor bytes.

    On the wire a msgpack map decoded by `samples_decoder` / `convert`: the field set is exact,
    `uid` and `group_id` are 1..1024 characters, `group_size` is in [1, MAX_COUNT], `version`
    in [0, MAX_INT], `meta` has string keys and every handle is one of the typed plane handles
    (`storage.handles.Handle`); the run's plane and the header are checked by the service."""

    uid: Text
    group_id: Text
    group_size: Annotated[int, msgspec.Meta(ge=1, le=MAX_COUNT)]
    version: Annotated[int, msgspec.Meta(ge=0, le=MAX_INT)]
    meta: dict[str, Any]
    handles: dict[str, Handle]
    """Field name -> data-plane handle (see `transfer_queue.storage.handles`)."""
    sealed: bool = True

    @classmethod
    def from_wire(cls, d: Any) -> "SampleMeta":
        """A record from builtins (a decoded map); WireError naming what is wrong."""
        return convert(d, cls, "sample")


class Batch(msgspec.Struct, forbid_unknown_fields=True):
    """Whole groups delivered to one consumer under one lease; `ack` or `nack` it."""

    consumer: str
    """Consumer group the batch was delivered to."""
    lease_id: str
    samples: list[SampleMeta]
    current_version: Annotated[int, msgspec.Meta(ge=0, le=MAX_INT)] | None = None
    stale_groups: Annotated[int, msgspec.Meta(ge=0, le=MAX_COUNT)] = 0
    """Groups this `get` dropped as too stale on the way (`rules.select_groups`), so a consumer
    frees their admission slots without diffing `stats()`; counted there as records."""
    stale: Annotated[list[SampleMeta], msgspec.Meta(max_length=MAX_COUNT)] = []
    """The records of those groups, metadata only (their tensors are freed): what a consumer needs
    to see what the drops were (their versions, lengths, rewards)."""
    forged_groups: Annotated[list[str], msgspec.Meta(max_length=MAX_COUNT)] = []
    """Group ids this `get` dropped because a record of theirs failed its MAC (`redis` with a secret; counted
    in `stats().forged` and `dropped[consumer]["forged"]`), so that a consumer frees the admission slots of
    those it admitted itself (a group a stranger made up was never admitted)."""

    def __len__(self) -> int:
        return len(self.samples)

    @property
    def uids(self) -> list[str]:
        return [s.uid for s in self.samples]

    @property
    def group_ids(self) -> list[str]:
        return list(dict.fromkeys(s.group_id for s in self.samples))

    @classmethod
    def from_wire(cls, d: Any) -> "Batch":
        return convert(d, cls, "batch")


class QueueStats(msgspec.Struct, forbid_unknown_fields=True):
    """A snapshot of the queue, the same for every backend (`stats()`)."""

    capacity: int
    resident: int
    """Records put and not yet freed (held for at least one consumer group)."""
    put: int
    complete_groups: int
    """Groups with all members present and not yet finished by every consumer group."""
    depth: dict[str, dict[str, int]]
    """Per consumer group: records `ready`, `waiting` (group or fields incomplete), `leased`."""
    acked: dict[str, int]
    dropped: dict[str, dict[str, int]]
    """Per consumer group, per cause (`stale`, `failed`, `filtered`)."""
    redelivered: dict[str, int]
    staleness: dict[str, dict[int, int]]
    """Per consumer group: histogram of staleness at delivery."""
    rejected: int = 0
    """Malformed, truncated or oversized messages refused by the service (bad fields, numbers,
    handles; unknown ops): every request answered with an error because of what it said."""
    busy: int = 0
    """Waiting calls refused at once because `queue.max_blocking_ops` were already in flight."""
    not_owner: int = 0
    """Updates and acks refused: the caller is neither the record's producer nor its lease holder."""
    forged: int = 0
    """Records refused as not the run's (`redis` backend, with `queue.secret`: their MAC fails; written, changed
    or copied by a client without the secret), counted by each reader that met one; the groups `get` dropped
    for them are counted in `dropped[consumer]["forged"]`. Always 0 in memory."""
    auth_refused: int = 0
    """Peers refused by the service's CURVE handler (no or wrong `queue.secret`)."""
    handshake_failed: int = 0
    """Connections whose handshake failed (peers without CURVE, or with a wrong key)."""
    rates: dict[str, float] = msgspec.field(default_factory=dict)
    """`put_per_s`, `ack_per_s` since the controller started."""

    def in_flight(self, consumer: str) -> int:
        return sum(self.depth[consumer].values())


sample_decoder = decoder(SampleMeta)
batch_decoder = decoder(Batch)
stats_decoder = decoder(QueueStats)
