"""The in-memory controller: the reference semantics of every metadata backend.

One object, one lock, thread-safe; it lives in one process. Other processes reach it
through `transfer_queue.service` (ZeroMQ). It holds handles, never tensor bytes, and it
frees a record's storage (through `on_free`) once every consumer group acked or dropped
it. Back-pressure is owned by `BackPressure`, redelivery by `LeaseTable`.

Per consumer group a record is in exactly one state:
    waiting (group incomplete or fields missing) -> ready -> leased -> acked | dropped
                                                     ^----------'  (nack, lease expiry)
so `put == acked + dropped + in flight` holds for every consumer group at any time.
Ready groups are delivered oldest version first (ties: redeliveries, then arrival order), as
`rules.select_groups` decides; the drops it decides are counted and returned in `Batch.stale_groups`.

Ownership (`rules.may_act`): a record is updated or finished only by its producer (the
`client_id` of its `put`) or its lease holder; anything else raises `PermissionError`,
counted in `stats().not_owner`. Two live records never refer to the same memory
(`storage.handles.identity`): a `put` or `update` whose handle points at memory a live
record already holds is refused, so a forged or replayed handle cannot free another
record's slot.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, OrderedDict, defaultdict
from dataclasses import dataclass, field
from typing import Any

from transfer_queue.metadata.base import DROP_CAUSES, FreeHook, GetRequest, MetadataStore, default_consumer_id
from transfer_queue.records import Batch, QueueStats, SampleMeta
from transfer_queue.rules import BackPressure, Candidate, LeaseTable, may_act, select_groups, staleness
from transfer_queue.storage.handles import identity


def _copy(s: SampleMeta) -> SampleMeta:
    return SampleMeta(s.uid, s.group_id, s.group_size, s.version, dict(s.meta), dict(s.handles), s.sealed)


@dataclass
class _Entry:
    sample: SampleMeta
    producer: str = ""
    """Client id of the `put` (see `rules.may_act`)."""
    done: set[str] = field(default_factory=set)
    """Consumer groups that acked or dropped this record."""


class MemoryController(MetadataStore):
    """Example:
        ctl = MemoryController(capacity=8, consumer_groups=["trainer"], lease_timeout_s=30)
        ctl.put([SampleMeta("a", "g", 1, 0, {}, {}, True)])
        batch = ctl.get(GetRequest("trainer", num_groups=1))
        ctl.ack("trainer", batch.uids)     # record freed: on_free(handles)
    """

    def __init__(self, capacity: int, consumer_groups: list[str], lease_timeout_s: float,
                 on_free: FreeHook | None = None) -> None:
        self.consumer_groups = list(consumer_groups)
        self._cond = threading.Condition()
        self._space = BackPressure(capacity, self._cond)
        self._leases = LeaseTable(lease_timeout_s)
        self._on_free = on_free or (lambda handles: None)
        self._records: dict[str, _Entry] = {}
        self._groups: dict[str, list[str]] = {}
        self._complete: set[str] = set()
        self._avail: dict[str, OrderedDict[str, None]] = {c: OrderedDict() for c in self.consumer_groups}
        self._put = 0
        self._acked = Counter({c: 0 for c in self.consumer_groups})
        self._dropped = {c: Counter({k: 0 for k in DROP_CAUSES}) for c in self.consumer_groups}
        self._redelivered = Counter({c: 0 for c in self.consumer_groups})
        self._staleness: dict[str, Counter] = {c: Counter() for c in self.consumer_groups}
        self._memory: dict[tuple, str] = {}  # handle identity -> uid of the live record holding it
        self._not_owner = 0
        self._t0 = time.monotonic()

    # ---- producers -------------------------------------------------------
    def put(self, samples: list[SampleMeta], timeout: float | None = None, client_id: str = "") -> None:
        producer = client_id or default_consumer_id()
        with self._cond:
            self._check_new(samples)
            self._space.reserve(len(samples), timeout)
            try:
                self._check_new(samples)  # the lock was released while waiting
            except ValueError:
                self._space.release(len(samples))
                raise
            for s in samples:
                self._hold(s.uid, s.handles.values())
                self._records[s.uid] = _Entry(s, producer)
                members = self._groups.setdefault(s.group_id, [])
                members.append(s.uid)
                if len(members) == s.group_size:
                    self._complete.add(s.group_id)
                    for avail in self._avail.values():
                        avail[s.group_id] = None
            self._put += len(samples)
            self._cond.notify_all()

    def _check_new(self, samples: list[SampleMeta]) -> None:
        sizes: dict[str, int] = {}
        counts: Counter = Counter()
        for s in samples:
            if s.uid in self._records:
                raise ValueError(f"put: uid {s.uid!r} is already in the queue")
            first = self._groups.get(s.group_id)
            size = self._records[first[0]].sample.group_size if first else sizes.setdefault(s.group_id, s.group_size)
            if s.group_size != size:
                raise ValueError(f"put: group {s.group_id!r} has group_size {size}, record {s.uid!r} says {s.group_size}")
            counts[s.group_id] += 1
            if len(first or ()) + counts[s.group_id] > size:
                raise ValueError(f"put: group {s.group_id!r} already has {size} records")
        if len({s.uid for s in samples}) != len(samples):
            raise ValueError("put: duplicate uids in one call")
        self._check_memory([h for s in samples for h in s.handles.values()])

    def _check_memory(self, handles: list[dict[str, Any]]) -> None:
        ids = [i for i in map(identity, handles) if i is not None]
        if len(set(ids)) != len(ids) or any(i in self._memory for i in ids):
            raise ValueError("put: a handle refers to memory that another live record (or field) already holds")

    def _hold(self, uid: str, handles: Any) -> None:
        for h in handles:
            i = identity(h)
            if i is not None:
                self._memory[i] = uid

    def _release_memory(self, handles: Any) -> None:
        for h in handles:
            i = identity(h)
            if i is not None:
                self._memory.pop(i, None)

    def _refuse(self, what: str, client_id: str) -> None:
        self._not_owner += 1
        raise PermissionError(f"{what}: client {client_id!r} is neither the producer nor the lease holder")
    def update(self, uid: str, handles: dict[str, dict[str, Any]], meta: dict[str, Any] | None = None,
               seal: bool = True, client_id: str = "") -> None:
        client_id = client_id or default_consumer_id()
        with self._cond:
            entry = self._records.get(uid)
            if entry is None:
                raise KeyError(f"update: no record {uid!r} in the queue")
            if not any(may_act(client_id, entry.producer, self._leases.holder_id(c, uid)) for c in self.consumer_groups):
                self._refuse(f"update of {uid!r}", client_id)
            self._check_memory(list(handles.values()))
            old = [entry.sample.handles[k] for k in handles if k in entry.sample.handles]
            self._release_memory(old)
            self._hold(uid, handles.values())
            entry.sample.handles.update(handles)
            entry.sample.meta.update(meta or {})
            entry.sample.sealed = entry.sample.sealed or seal
            self._cond.notify_all()
        if old:
            self._on_free(old)

    # ---- consumers -------------------------------------------------------
    def get(self, req: GetRequest) -> Batch:
        self._check_consumer(req.consumer)
        deadline = None if req.timeout is None else time.monotonic() + req.timeout
        freed: list[dict[str, Any]] = []
        stale: list[SampleMeta] = []
        with self._cond:
            while True:
                now = time.monotonic()
                self._expire(now)
                picked, full, dropped = self._take(req, freed)
                stale += dropped
                if full or (deadline is not None and now >= deadline):
                    if not full and not req.allow_partial:
                        picked = []
                    batch = self._lease(req, picked, now, stale)
                    break
                waits = [t - now for t in (deadline, self._leases.next_deadline()) if t is not None]
                self._cond.wait(max(min(waits), 0.001) if waits else None)
        if freed:
            self._on_free(freed)
        return batch

    def _take(self, req: GetRequest, freed: list[dict[str, Any]]) -> tuple[list[str], bool, list[SampleMeta]]:
        """Apply `rules.select_groups` to the ready groups (offer order: redeliveries first, then
        arrival); finish the stale ones (counted `stale`). Returns the records picked, whether the
        batch is full, and (copies of) the records dropped as stale."""
        c, avail = req.consumer, self._avail[req.consumer]
        gone = []
        candidates: dict[str, list[str]] = {}
        offer: list[Candidate] = []
        for gid in avail:
            if gid not in self._complete:  # freed, or a reused id not yet complete
                gone.append(gid)
                continue
            members = [u for u in self._groups[gid]
                       if c not in self._records[u].done and not self._leases.holds(c, u)]
            if not members:
                gone.append(gid)
                continue
            records = self._records
            candidates[gid] = members
            offer.append(Candidate(gid, min(records[u].sample.version for u in members), len(members),
                                   records[members[0]].sample.group_size))
        sel = select_groups(offer, num_groups=req.num_groups, num_samples=req.num_samples, group_size=req.group_size,
                            max_staleness=req.max_staleness, current_version=req.current_version,
                            max_version=req.max_version, is_ready=lambda gid: self._group_ready(candidates[gid], req.fields),
                            lineage=req.lineage or ())
        dropped = [_copy(self._records[u].sample) for gid in sel.stale for u in candidates[gid]]
        for gid in sel.stale:
            self._dropped[c]["stale"] += len(candidates[gid])
            freed.extend(self._finish(c, candidates[gid]))
        for gid in gone + sel.stale:
            avail.pop(gid, None)
        return [u for gid in sel.take for u in candidates[gid]], sel.enough, dropped

    @staticmethod
    def _ready(s: SampleMeta, fields: list[str] | None) -> bool:
        return s.sealed if fields is None else all(f in s.handles for f in fields)

    def _group_ready(self, members: list[str], fields: list[str] | None) -> bool:
        return all(self._ready(self._records[u].sample, fields) for u in members)

    def _lease(self, req: GetRequest, picked: list[str], now: float, stale: list[SampleMeta]) -> Batch:
        groups = len({s.group_id for s in stale})
        if not picked:
            return Batch(req.consumer, "", [], req.current_version, stale_groups=groups, stale=stale)
        lease = self._leases.grant(req.consumer, req.consumer_id, picked, now)
        for u in picked:
            self._avail[req.consumer].pop(self._records[u].sample.group_id, None)
        samples = [self._records[u].sample for u in picked]
        if req.current_version is not None:
            self._staleness[req.consumer].update(staleness(s.version, req.current_version, req.lineage or ()) for s in samples)
        # copies: the caller may be in this process and must not alias the table
        return Batch(req.consumer, lease.lease_id, [_copy(s) for s in samples], req.current_version,
                     stale_groups=groups, stale=stale)

    def _expire(self, now: float) -> None:
        for lease in self._leases.expired(now):
            self._redelivered[lease.consumer] += len(lease.uids)
            self._make_available(lease.consumer, lease.uids)

    def _make_available(self, consumer: str, uids: set[str] | list[str]) -> None:
        avail = self._avail[consumer]
        for gid in dict.fromkeys(self._records[u].sample.group_id for u in uids if u in self._records):
            avail[gid] = None
            avail.move_to_end(gid, last=False)  # redeliveries go first
        self._cond.notify_all()

    def ack(self, consumer: str, uids: list[str], client_id: str = "") -> int:
        return self._settle(consumer, uids, None, client_id)

    def drop(self, consumer: str, uids: list[str], cause: str, client_id: str = "", records_only: bool = False) -> int:
        """Record by record (so `records_only` changes nothing): the rest of a group is acked on its own."""
        if cause not in DROP_CAUSES:
            raise ValueError(f"drop: cause {cause!r} is not one of {DROP_CAUSES}")
        return self._settle(consumer, uids, cause, client_id)

    def _owned(self, consumer: str, uids: Any, client_id: str, what: str) -> None:
        """Raise (counted) unless `client_id` may act on every one of `uids` (call with the lock held)."""
        for u in uids:
            if not may_act(client_id, self._records[u].producer, self._leases.holder_id(consumer, u)):
                self._refuse(f"{what} of {u!r} for {consumer!r}", client_id)

    def _settle(self, consumer: str, uids: list[str], cause: str | None, client_id: str = "") -> int:
        self._check_consumer(consumer)
        client_id = client_id or default_consumer_id()
        with self._cond:
            todo = [u for u in dict.fromkeys(uids) if u in self._records and consumer not in self._records[u].done]
            self._owned(consumer, todo, client_id, "ack" if cause is None else "drop")
            if cause is None:
                self._acked[consumer] += len(todo)
            else:
                self._dropped[consumer][cause] += len(todo)
            self._leases.settle(consumer, todo)
            freed = self._finish(consumer, todo)
        if freed:
            self._on_free(freed)
        return len(todo)

    def _finish(self, consumer: str, uids: list[str]) -> list[dict[str, Any]]:
        """Mark done for one consumer group; free records every group is done with."""
        freed: list[dict[str, Any]] = []
        n = 0
        for u in uids:
            entry = self._records[u]
            entry.done.add(consumer)
            self._leases.forget(consumer, u)
            if len(entry.done) == len(self.consumer_groups):
                del self._records[u]
                self._release_memory(entry.sample.handles.values())
                gid = entry.sample.group_id
                members = self._groups[gid]
                members.remove(u)
                if not members:  # stale entries in `_avail` are skipped and removed by `_take`
                    del self._groups[gid]
                    self._complete.discard(gid)
                freed.extend(entry.sample.handles.values())
                n += 1
        if n:
            self._space.release(n)
        return freed

    def nack(self, consumer: str, lease_id: str, uids: list[str], client_id: str = "") -> int:
        self._check_consumer(consumer)
        client_id = client_id or default_consumer_id()
        with self._cond:
            self._owned(consumer, [u for u in dict.fromkeys(uids) if u in self._records and self._leases.holds(consumer, u)],
                        client_id, "nack")
            back = self._leases.settle(consumer, uids)
            self._make_available(consumer, back)
            return len(back)

    def renew(self, consumer: str, lease_id: str, uids: list[str], client_id: str = "") -> bool:
        client_id = client_id or default_consumer_id()
        with self._cond:
            lease = self._leases.lease(lease_id)
            if lease is not None and (lease.consumer != consumer or lease.consumer_id != client_id):
                self._refuse(f"renew of lease {lease_id!r}", client_id)
            return self._leases.renew(lease_id, time.monotonic())

    def _check_consumer(self, consumer: str) -> None:
        if consumer not in self._avail:
            raise ValueError(f"unknown consumer group {consumer!r}; queue.consumer_groups={self.consumer_groups}")

    # ---- observability ---------------------------------------------------
    def stats(self) -> QueueStats:
        with self._cond:
            self._expire(time.monotonic())
            depth: dict[str, dict[str, int]] = defaultdict(lambda: {"ready": 0, "waiting": 0, "leased": 0})
            complete = 0
            for gid, members in self._groups.items():
                full = gid in self._complete
                complete += full
                for c in self.consumer_groups:
                    for u in members:
                        s = self._records[u]
                        if c in s.done:
                            continue
                        state = ("leased" if self._leases.holds(c, u) else
                                 "ready" if full and s.sample.sealed else "waiting")
                        depth[c][state] += 1
            up = max(time.monotonic() - self._t0, 1e-9)
            return QueueStats(
                capacity=self._space.capacity, resident=self._space.resident, put=self._put,
                complete_groups=complete, depth={c: dict(depth[c]) for c in self.consumer_groups},
                acked=dict(self._acked), dropped={c: dict(v) for c, v in self._dropped.items()},
                redelivered=dict(self._redelivered), not_owner=self._not_owner,
                staleness={c: dict(h) for c, h in self._staleness.items()},
                rates={"put_per_s": self._put / up, "ack_per_s": sum(self._acked.values()) / up})
