"""The records of the queue: what producers put, what the controller keeps, what consumers get.

A record is generic: identity and scheduling fields (`uid`, `group_id`, `group_size`,
`version`), a msgpack-able `meta` dict, and named tensor fields. Tensor bytes never pass
through the controller: it holds one *handle* per field (a small map that tells the data
plane where the bytes are). A trajectory of asyncrl is put as scalar fields in `meta` and
per-token arrays as tensors; this module does not know that type.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from transfer_queue.codec import MAX_COUNT, MAX_INT, WireError, check_int, expect_map


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


@dataclass
class SampleMeta:
    """What the controller holds per record and `get` returns: everything but tensor bytes."""

    uid: str
    group_id: str
    group_size: int
    version: int
    meta: dict[str, Any]
    handles: dict[str, dict[str, Any]]
    """Field name -> data-plane handle (see `transfer_queue.storage.base`)."""
    sealed: bool = True

    def to_wire(self) -> dict[str, Any]:
        return {"uid": self.uid, "group_id": self.group_id, "group_size": self.group_size,
                "version": self.version, "meta": self.meta, "handles": self.handles, "sealed": self.sealed}

    @classmethod
    def from_wire(cls, d: Any) -> "SampleMeta":
        expect_map(d, {"uid": str, "group_id": str, "group_size": int, "version": int,
                       "meta": dict, "handles": dict, "sealed": bool}, "sample")
        if not 0 < len(d["uid"]) <= 1024 or not 0 < len(d["group_id"]) <= 1024:
            raise WireError("sample: uid and group_id must be 1..1024 characters")
        check_int(d["group_size"], f"sample {d['uid']!r}: group_size", 1, MAX_COUNT)
        check_int(d["version"], f"sample {d['uid']!r}: version", 0, MAX_INT)
        if set(d) != {"uid", "group_id", "group_size", "version", "meta", "handles", "sealed"}:
            raise WireError(f"sample {d['uid']!r}: unknown fields {sorted(set(d))}")
        if not all(isinstance(k, str) for k in d["meta"]):
            raise WireError(f"sample {d['uid']!r}: meta keys must be strings")
        for name, h in d["handles"].items():
            if not isinstance(name, str) or not isinstance(h, dict) or not isinstance(h.get("plane"), str):
                raise WireError(f"sample {d['uid']!r}: bad handle for field {name!r}")
        return cls(**{k: d[k] for k in ("uid", "group_id", "group_size", "version", "meta", "handles", "sealed")})


@dataclass
class Batch:
    """Whole groups delivered to one consumer under one lease; `ack` or `nack` it."""

    consumer: str
    """Consumer group the batch was delivered to."""
    lease_id: str
    samples: list[SampleMeta]
    current_version: int | None = None

    def __len__(self) -> int:
        return len(self.samples)

    @property
    def uids(self) -> list[str]:
        return [s.uid for s in self.samples]

    @property
    def group_ids(self) -> list[str]:
        return list(dict.fromkeys(s.group_id for s in self.samples))

    def to_wire(self) -> dict[str, Any]:
        return {"consumer": self.consumer, "lease_id": self.lease_id,
                "samples": [s.to_wire() for s in self.samples], "current_version": self.current_version}

    @classmethod
    def from_wire(cls, d: Any) -> "Batch":
        expect_map(d, {"consumer": str, "lease_id": str, "samples": list}, "batch")
        cv = d.get("current_version")
        if cv is not None and not isinstance(cv, int):
            raise WireError("batch: current_version must be an int or nil")
        return cls(d["consumer"], d["lease_id"], [SampleMeta.from_wire(s) for s in d["samples"]], cv)


@dataclass
class QueueStats:
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
    auth_refused: int = 0
    """Peers refused by the service's CURVE handler (no or wrong `queue.secret`)."""
    handshake_failed: int = 0
    """Connections whose handshake failed (peers without CURVE, or with a wrong key)."""
    rates: dict[str, float] = field(default_factory=dict)
    """`put_per_s`, `ack_per_s` since the controller started."""

    def in_flight(self, consumer: str) -> int:
        return sum(self.depth[consumer].values())

    def to_wire(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["staleness"] = {c: {str(k): v for k, v in h.items()} for c, h in self.staleness.items()}
        return d

    @classmethod
    def from_wire(cls, d: Any) -> "QueueStats":
        if not isinstance(d, dict):
            raise WireError("stats: expected a map")
        d = dict(d)
        d["staleness"] = {c: {int(k): v for k, v in h.items()} for c, h in d["staleness"].items()}
        return cls(**d)
