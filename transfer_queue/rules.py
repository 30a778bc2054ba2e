"""The rules of the in-memory controller, one owner each.

`BackPressure` bounds the records resident in the queue: producers wait, nothing is
dropped. `LeaseTable` owns redelivery: a batch handed to a consumer is leased; a lease
that expires (the consumer died) or is released by `nack` returns its records.
`may_act` is the ownership rule every backend applies: only a record's producer or its
lease holder may change it (`update`) or finish it (`ack`, `drop`, `nack`, `renew`); `MAY_ACT_LUA`
is the same rule for the `redis` backend's scripts.

Both are plain objects driven under the controller's lock; neither knows about
storage, groups or wires.

`staleness` is the one staleness formula (asyncrl's `StalenessManager` and `Trajectory` call it
too) and `select_groups` the one group-selection rule of `get` (oldest first, none newer than
`max_version`, stale ones dropped): pure functions over plain values, applied by every backend.
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Sequence


class BackPressure:
    """Bounded capacity: `put` waits while `resident + n > capacity`.

    Trace (capacity 4):
        reserve(3)  -> resident 3
        reserve(2)  -> waits (3 + 2 > 4)
        release(1)  -> resident 2, wakes the waiter -> resident 4
        reserve(5)  -> ValueError (can never fit)
    """

    def __init__(self, capacity: int, cond: threading.Condition) -> None:
        self.capacity = capacity
        self.resident = 0
        self._cond = cond

    def reserve(self, n: int, timeout: float | None) -> None:
        """Call with the lock held; raises TimeoutError if no space within `timeout`."""
        if n > self.capacity:
            raise ValueError(f"put of {n} records exceeds queue.capacity={self.capacity}")
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.resident + n > self.capacity:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise TimeoutError(f"queue full ({self.resident}/{self.capacity}) for {timeout}s")
            self._cond.wait(left)
        self.resident += n

    def release(self, n: int) -> None:
        """Call with the lock held; wakes waiting producers."""
        self.resident -= n
        assert self.resident >= 0, "released more records than reserved"
        self._cond.notify_all()


def may_act(client_id: str, producer: str, holder: str | None) -> bool:
    """Ownership: `client_id` may update or finish a record it produced, or one it holds (or held
    last, for a late ack after its lease expired and before anyone else took it).

    Trace: put by P; get by C (lease) -> ack by C ok, by P ok, by X refused (counted `not_owner`);
    lease expires, get by D -> ack by C refused, by D ok.
    """
    return client_id == producer or (holder is not None and client_id == holder)


MAY_ACT_LUA = """
local function may_act(client, producer, holder)
  return client == producer or (holder ~= nil and holder ~= false and client == holder)
end
"""
"""`may_act` for backends that decide inside their store (the `redis` backend's Lua scripts decide
atomically, in the same call that changes the record): the same rule, kept next to the Python one
so both change together; `tests/faults/test_queue_redis_trust.py` checks they agree on every case.
In Lua a missing producer or holder is `nil` or `false` (a missing hash field); `client` is never empty."""


@dataclass
class Lease:
    lease_id: str
    consumer: str
    """Consumer group."""
    consumer_id: str
    """Instance that holds the lease (host:pid by default)."""
    uids: set[str]
    deadline: float


class LeaseTable:
    """Redelivery: what was delivered and not acked comes back after `timeout_s`.

    Trace (timeout 30 s):
        t=0   grant(trainer, w0, {a, b}) -> L1, deadline 30
        t=10  renew(L1)                  -> deadline 40
        t=12  settle({a})                -> L1 holds {b}
        t=41  expired(41)                -> [L1 with {b}]  (controller makes b ready again)
        t=42  settle({b}) (late ack)     -> no lease holds b; the ack still counts once
    """

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._leases: dict[str, Lease] = {}
        self._holder: dict[tuple[str, str], str] = {}  # (consumer, uid) -> lease id
        self._last: dict[tuple[str, str], str] = {}  # (consumer, uid) -> consumer id of its latest lease
        self._ids = itertools.count()

    def grant(self, consumer: str, consumer_id: str, uids: list[str], now: float) -> Lease:
        lease = Lease(f"{consumer}-{next(self._ids)}", consumer, consumer_id, set(uids), now + self.timeout_s)
        self._leases[lease.lease_id] = lease
        for u in uids:
            self._holder[(consumer, u)] = lease.lease_id
            self._last[(consumer, u)] = consumer_id
        return lease

    def holder_id(self, consumer: str, uid: str) -> str | None:
        """Consumer id of the latest lease of `uid` for `consumer` (current or expired), if any."""
        return self._last.get((consumer, uid))

    def lease(self, lease_id: str) -> Lease | None:
        return self._leases.get(lease_id)

    def forget(self, consumer: str, uid: str) -> None:
        """The record is finished for `consumer`: drop its holder history."""
        self._last.pop((consumer, uid), None)

    def renew(self, lease_id: str, now: float) -> bool:
        lease = self._leases.get(lease_id)
        if lease is not None:
            lease.deadline = now + self.timeout_s
        return lease is not None

    def holds(self, consumer: str, uid: str) -> bool:
        return (consumer, uid) in self._holder

    def settle(self, consumer: str, uids: list[str]) -> list[str]:
        """Remove `uids` from whatever lease holds them; returns those that were leased."""
        out = []
        for u in uids:
            lid = self._holder.pop((consumer, u), None)
            if lid is None:
                continue
            out.append(u)
            lease = self._leases[lid]
            lease.uids.discard(u)
            if not lease.uids:
                del self._leases[lid]
        return out

    def release(self, lease_id: str) -> Lease | None:
        """End a lease early (`nack`); its records are returned to the caller."""
        lease = self._leases.pop(lease_id, None)
        if lease is not None:
            for u in lease.uids:
                self._holder.pop((lease.consumer, u), None)
        return lease

    def expired(self, now: float) -> list[Lease]:
        out = [lease for lease in self._leases.values() if lease.deadline <= now]
        for lease in out:
            self.release(lease.lease_id)
        return out

    def next_deadline(self) -> float | None:
        return min((lease.deadline for lease in self._leases.values()), default=None)

    def leased(self, consumer: str) -> int:
        return sum(len(lease.uids) for lease in self._leases.values() if lease.consumer == consumer)


Lineage = Sequence[Sequence[int]]
"""A run's resumes, oldest first: `(n, l)` says version `n` was published with the weights of
version `l` (a restart from the checkpoint of `l`, labelled above every version published before it,
so that no version names two sets of weights). Empty for a run that never resumed."""


def staleness(version: int, current_version: int, lineage: Lineage = ()) -> int:
    """Versions a record is behind: the version at use minus the oldest version that generated
    any of its tokens. `staleness(3, 5) == 2`; a record is too stale when this exceeds `max_staleness`.

    With a `lineage`, versions are points of a tree, and staleness is the number of trainer steps
    between the two weights: up to their common ancestor and down again. A version published
    after the checkpoint a run resumed from is on a branch the crash ended; its samples are as old
    as their distance to the checkpoint plus the steps trained since.

    >>> staleness(12, 15, [(14, 10)])   # v12 = the checkpoint v10 + 2 lost steps; v15 = v10 + 1 step
    3
    >>> staleness(9, 15, [(14, 10)])    # an ancestor of the checkpoint: 1 step to v10, 1 more to v15
    2
    """
    if not lineage or version >= lineage[-1][0]:  # the newest stretch of versions: a plain difference
        return current_version - version
    return _tree_distance(version, current_version, lineage)


def _tree_distance(a: int, b: int, lineage: Lineage) -> int:
    starts = [0] + [int(n) for n, _ in lineage]
    parents = [None] + [int(l) for _, l in lineage]

    def chain(x: int) -> dict[int, tuple[int, int]]:
        """stretch index -> (the version where x's ancestry enters it, steps from x up to there)."""
        out, cost = {}, 0
        while True:
            seg = max(i for i, s in enumerate(starts) if s <= x)
            out[seg] = (x, cost)
            if seg == 0:
                return out
            cost += x - starts[seg]
            x = parents[seg]  # type: ignore[assignment]

    up_a, up_b = chain(a), chain(b)
    seg = max(s for s in up_a if s in up_b)  # the stretch of their latest common ancestor
    (xa, ca), (xb, cb) = up_a[seg], up_b[seg]
    if ca == 0 and cb == 0:  # both in that stretch: signed, as without a lineage
        return xb - xa
    low = min(xa, xb)
    return ca + (xa - low) + cb + (xb - low)


def check_lineage(lineage: Lineage) -> list[list[int]]:
    """The lineage as plain pairs; ValueError unless every `(n, l)` has 0 <= l < n, n increasing."""
    out = []
    last = -1
    for pair in lineage:
        if len(pair) != 2:
            raise ValueError(f"lineage: pairs (n, l) expected, got {pair!r}")
        n, l = int(pair[0]), int(pair[1])
        if not 0 <= l < n or n <= last:
            raise ValueError(f"lineage: ({n}, {l}) must have 0 <= l < n and n above the previous resume's")
        out.append([n, l])
        last = n
    return out


class Candidate(NamedTuple):
    """A group a `get` may deliver: what `select_groups` needs to know of it, nothing more."""

    key: str
    """How the backend names it (group id in `memory`, stream entry id in `redis`)."""
    version: int
    """Its oldest deliverable record's version."""
    records: int
    """Records it would deliver."""
    group_size: int = 1
    ready: bool = True
    """Every record holds the asked fields (or is sealed); a group not ready is skipped, not dropped
    (see also `select_groups`' `is_ready`)."""


@dataclass
class Selection:
    """What `select_groups` decided: `take` to deliver, `stale` to drop (counted `stale`), in order."""

    take: list[str] = field(default_factory=list)
    stale: list[str] = field(default_factory=list)
    enough: bool = False
    """The batch is full (with what the caller held already)."""


def select_groups(candidates: Sequence[Candidate], *, num_groups: int | None = None, num_samples: int | None = None,
                  group_size: int | None = None, max_staleness: int | None = None,
                  current_version: int | None = None, max_version: int | None = None,
                  held_groups: int = 0, held_records: int = 0, is_ready: Callable[[str], bool] | None = None,
                  lineage: Lineage = ()) -> Selection:
    """The group selection of `get`, the same for every backend.

    `candidates` come in offer order (redeliveries first, then arrival); they are taken lowest
    version first, ties in that order, until `num_groups` groups (or at least `num_samples`
    records) are held, counting `held_groups` / `held_records` the caller already holds (one
    given, not both). Walking up the versions: a group newer than `max_version` stops the walk
    (every later one is newer too; they stay deliverable); one of another `group_size` or not
    `ready` (nor passing `is_ready(key)`, asked only for the groups the walk reaches: a backend's
    readiness check may cost) is passed over; one older than `max_staleness` at `current_version` is dropped as
    stale (`staleness`, along `lineage` after a resume). Oldest first keeps a group that finished late (a long sample) from being passed over by
    younger ones until it is too stale.

    Trace (max_staleness 1, current_version 5, num_groups 2, max_version 5):
        a v3, b v5, c v4 (not ready), d v4, e v6
        -> sorted a3 c4 d4 b5 e6: a stale (5-3 > 1), c skipped, d taken, b taken: enough
        -> Selection(take=[d, b], stale=[a], enough=True); c, e stay
    """
    if (num_groups is None) == (num_samples is None):
        raise ValueError("select_groups: give num_groups or num_samples, not both")
    if max_staleness is not None and current_version is None:
        raise ValueError("select_groups: max_staleness needs current_version")
    groups, records = held_groups, held_records

    def full() -> bool:
        return groups >= num_groups if num_groups is not None else records >= num_samples  # type: ignore[operator]

    out = Selection()
    if full():
        out.enough = True
        return out
    for c in sorted(candidates, key=lambda c: c.version):  # stable: offer order within a version
        if max_version is not None and c.version > max_version:
            break
        if group_size is not None and c.group_size != group_size:
            continue
        if max_staleness is not None and staleness(c.version, current_version, lineage) > max_staleness:  # type: ignore[arg-type]
            out.stale.append(c.key)
            continue
        if not c.ready or (is_ready is not None and not is_ready(c.key)):
            continue
        out.take.append(c.key)
        groups, records = groups + 1, records + c.records
        if full():
            break
    out.enough = full()
    return out
