"""The metadata store: the controller's table of records, groups, deliveries and acks.

Every backend (`memory`, the `memory` service's remote proxy, `redis`) implements this
base with the same semantics, defined by `MemoryController`:

- `put` waits for space (back-pressure) and never drops;
- `get` returns whole groups whose records hold the asked fields (or are sealed), drops
  groups older than `max_staleness` with a counted `stale` drop (and says how many in
  `Batch.stale_groups`), leaves groups newer than `max_version` ready for a later `get`, and
  leases the batch: the selection is `rules.select_groups`, the same function in every backend;
- `ack` / `drop` finish records for one consumer group (idempotent); `nack` or lease expiry
  makes them deliverable again; a record is freed (its storage handles passed to `on_free`)
  once every consumer group finished it.

It never touches tensor bytes: handles only.
"""

from __future__ import annotations

import os
import socket
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable

from transfer_queue.codec import MAX_COUNT, MAX_INT, WireError, check_int, check_seconds, expect_map
from transfer_queue.records import Batch, QueueStats, SampleMeta
from transfer_queue.rules import check_lineage

DROP_CAUSES = ("stale", "failed", "filtered", "unreadable")
FreeHook = Callable[[list[dict[str, Any]]], None]


def default_consumer_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


@dataclass
class GetRequest:
    """What a consumer asks `get` for. Exactly one of `num_groups` / `num_samples`."""

    consumer: str
    """Consumer group (each group sees every record)."""
    consumer_id: str = ""
    """Instance asking, for lease bookkeeping; empty -> host:pid."""
    num_groups: int | None = None
    num_samples: int | None = None
    """Whole groups are added until at least this many samples are in the batch."""
    group_size: int | None = None
    """Only groups of this size (None: any)."""
    fields: list[str] | None = None
    """Tensor fields that must be written; None: the record must be sealed."""
    max_staleness: int | None = None
    current_version: int | None = None
    max_version: int | None = None
    """Only groups whose version (their oldest record's) is at most this; newer ones stay
    ready. A consumer that must take groups in version order passes the oldest version still
    being produced (None: any)."""
    timeout: float | None = 0.0
    """Seconds to wait for a full batch; None forever."""
    allow_partial: bool = False
    """On timeout return what is ready instead of an empty batch."""
    lineage: list[list[int]] | None = None
    """The consumer's resumes (`rules.Lineage`): staleness is measured along them (None: none)."""

    def __post_init__(self) -> None:
        if not self.consumer_id:
            self.consumer_id = default_consumer_id()
        if (self.num_groups is None) == (self.num_samples is None):
            if self.num_groups is None and self.num_samples is None:
                self.num_groups = 1
            else:
                raise ValueError("get: give num_groups or num_samples, not both")
        n = self.num_groups if self.num_groups is not None else self.num_samples
        check_int(n, "get: batch size", 1, MAX_COUNT)
        if not isinstance(self.consumer, str) or not isinstance(self.consumer_id, str) or len(self.consumer_id) > 1024:
            raise ValueError("get: consumer and consumer_id must be strings")
        if self.fields is not None and (not isinstance(self.fields, list) or len(self.fields) > MAX_COUNT
                                        or not all(isinstance(f, str) for f in self.fields)):
            raise ValueError(f"get: fields must be a list of names, got {self.fields!r}")
        check_int(self.group_size, "get: group_size", 1, MAX_COUNT, none_ok=True)
        for k in ("max_staleness", "current_version", "max_version"):
            check_int(getattr(self, k), f"get: {k}", 0, MAX_INT, none_ok=True)
        check_seconds(self.timeout, "get: timeout")
        if not isinstance(self.allow_partial, bool):
            raise ValueError("get: allow_partial must be a bool")
        if self.max_staleness is not None and self.current_version is None:
            raise ValueError("get: max_staleness needs current_version")
        if self.lineage is not None:
            if not isinstance(self.lineage, (list, tuple)) or len(self.lineage) > 1024:
                raise ValueError("get: lineage must be a list of at most 1024 (n, l) pairs")
            self.lineage = check_lineage(self.lineage)

    def to_wire(self) -> dict[str, Any]:
        return dict(self.__dict__)

    @classmethod
    def from_wire(cls, d: Any) -> "GetRequest":
        expect_map(d, {"consumer": str, "consumer_id": str}, "get request")
        try:
            return cls(**d)
        except (TypeError, ValueError) as e:
            raise WireError(f"get request: {e}") from e

    def enough(self, groups: int, samples: int) -> bool:
        if self.num_groups is not None:
            return groups >= self.num_groups
        return samples >= self.num_samples  # type: ignore[operator]


class MetadataStore(ABC):
    """Records, groups, leases and acks for every consumer group of one run."""

    consumer_groups: list[str]

    @abstractmethod
    def put(self, samples: list[SampleMeta], timeout: float | None = None, client_id: str = "") -> None:
        """Add records produced by `client_id` (empty: host:pid); waits while the queue is full;
        TimeoutError after `timeout`."""

    @abstractmethod
    def update(self, uid: str, handles: dict[str, dict[str, Any]], meta: dict[str, Any] | None = None,
               seal: bool = True, client_id: str = "") -> None:
        """Add fields (their handles) and metadata to a record already put (by its producer or
        lease holder only: `rules.may_act`; else PermissionError)."""

    @abstractmethod
    def get(self, req: GetRequest) -> Batch:
        """A leased batch of whole groups; empty when nothing fitted before the timeout."""

    @abstractmethod
    def ack(self, consumer: str, uids: list[str], client_id: str = "") -> int:
        """Finish records for a consumer group; returns how many were newly acked. Only by the
        producer or lease holder (`client_id`, empty: host:pid); else PermissionError."""

    @abstractmethod
    def nack(self, consumer: str, lease_id: str, uids: list[str], client_id: str = "") -> int:
        """Give records back for redelivery now; returns how many were returned."""

    @abstractmethod
    def drop(self, consumer: str, uids: list[str], cause: str, client_id: str = "", records_only: bool = False) -> int:
        """Finish records without training on them, counted under `cause`. A store that finishes whole groups
        (`redis`) finishes the groups of `uids` and counts all their records under `cause`; with
        `records_only` it counts `uids` alone under `cause` and the rest of their groups as consumed (acked):
        a group trained but for some of its records (their producer gone)."""

    @abstractmethod
    def renew(self, consumer: str, lease_id: str, uids: list[str], client_id: str = "") -> bool:
        """Extend a lease (a consumer still working on a batch)."""

    @abstractmethod
    def stats(self) -> QueueStats: ...

    def close(self) -> None:
        """Release connections; the store's contents are untouched."""
