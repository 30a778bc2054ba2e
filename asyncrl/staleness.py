"""Version accounting and the admission rule: the one owner of "how stale may a sample be".

Version = the trainer's optimizer-step count at publication; `version` here is the last
*published* version (the newest weights a rollout can use). A new group may start only
while `(eta + version + 1) * batch_groups > accepted + running`, where `accepted` counts
groups that finished and were queued for training (dropped ones do not count) and
`running` counts groups in generation. The modes are this one rule with different
`eta`: `sync` is eta = 0 (a batch is generated with the current weights, then trained,
then published), `one_step_off` is eta = 1 (batch t+1 is generated while batch t
trains), `fully_async` is the configured eta (`asyncrl.admission.mode_rule`; `for_rule` builds
the manager of a mode, for the controller and the simulator alike).

What the rule guarantees, and what it does not: if groups are trained in the order they
started, group g is trained at step about g / batch_groups <= eta + version-at-its-start,
so staleness (trainer step at use - oldest token version) <= eta, also when weights are
published only every k steps. Groups *finish* out of start order: a group waits for its
longest sample. The queue hands out the oldest ready groups first (lowest version), so a
late group is not passed over by younger ones once it is ready; while it still runs, two
consumption orders exist (`in_order`):

- in order (`sync`, `one_step_off`): the trainer takes no group newer than the oldest
  group still running (`takeable_version()`); it waits for that group instead. Then
  groups are trained in version order, so every group started at version v is trained
  before any of version v + 1: with eta = 1 and one publish per step, step s trains the
  groups of version s - 1, all exactly one version old. A newer group is taken only when
  no older one remains running or queued, e.g. the replacement of a group dropped for a
  failed reward started after the publish; it is trained less stale than eta (counted in
  the trainer's staleness histogram) and the order heals at the next version.
- ready first (`fully_async`): the trainer takes the oldest *ready* groups and does not
  wait for running ones. A group whose generation alone spans more than about eta trainer
  steps (a long sample started late in a step) cannot be trained within eta; the queue
  drops it and counts it (`dropped["stale"]`), and the admission slot it held is given
  back. `asyncrl bench pipeline` reports that share. Waiting for such groups instead
  removes the drops but not the limit (the trainer then idles at the staleness bound).

Either way nothing is trained with staleness > eta. In `fully_async` a second, soft limit
(`asyncrl.admission.Pace`, `trainer.admission=pace`) keeps groups in flight plus groups queued
and not yet taken (`accepted - taken + running`) to what the trainer consumes while a group
generates, so samples do not sit in the queue until they reach eta when the rollout side is
the faster one. This rule caps how far rollouts run
ahead; the rollouter also waits for a free fleet slot (`rollout.max_running_samples`), so
admitted groups run instead of queueing in the servers. In order needs the queue to hold
what admission lets run ahead (queue.capacity >= (eta + 2) * batch_groups * group_size
records): a finished old group whose `put` waits for space would otherwise wait on a
trainer that waits for it.

Trace (batch_groups=2, eta=0, i.e. sync):
    version 0: start g0, g1 (2 > 0, 2 > 1); g2 waits (2 > 2 is false)
    g0, g1 finish -> accepted 2; trainer takes both, steps, publishes version 1
    version 1: (0+1+1)*2 = 4 > 2 -> start g2, g3; both are trained at version 1: staleness 0

Trace (batch_groups=2, eta=1, in order, i.e. one_step_off):
    version 0: start g0..g3 (4 > 3); g0, g2 finish first; step 0 takes them (staleness 0)
    publish 1: start g4, g5 (6 > 5); g4 finishes while g1 still runs (version 0)
    step 1: takeable_version() = 0, so the trainer waits for g1 instead of taking g4;
            g1, g3 finish -> step 1 takes them (staleness 1); step 2 takes g4, g5 (staleness 1)

A sample that still exceeds eta when the trainer takes it (e.g. after a resume) is
dropped and counted under `dropped["stale"]`.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter, deque
from typing import Any, Callable

from asyncrl.admission import ModeRule, Pace
from transfer_queue.rules import staleness


class StalenessManager:
    def __init__(self, *, batch_groups: int, eta: int, in_order: bool = False, pace: Pace | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if batch_groups < 1 or eta < 0:
            raise ValueError(f"batch_groups must be >= 1 and eta >= 0, got {batch_groups}, {eta}")
        self.batch_groups, self.eta, self.in_order = batch_groups, eta, in_order
        self.pace = pace
        """Soft limit on groups in flight + queued (None: the bound alone)."""
        self._clock = clock
        """Seconds for the pace's group latencies and the idle seconds (the simulator passes its own clock)."""
        self.version = 0
        self.lineage: list[list[int]] = []
        """The run's resumes, `(n, l)`: version n was published with version l's weights (see
        `transfer_queue.rules.staleness`); staleness is measured along them."""
        self.accepted = 0
        self.taken = 0
        """Accepted groups the trainer has taken; `accepted - taken` are queued (or leased, in training)."""
        self._started: dict[int, deque[float]] = {}
        """Admission times of running groups, by version (matched first in, first out: the mean
        latency is exact whichever group of a version finishes first)."""
        self.running_by_version: Counter[int] = Counter()
        """Groups in generation, by the version published when each started (a lower bound of
        its oldest token version: a publish may land before its first token)."""
        self.dropped: Counter[str] = Counter()
        self.changes = 0
        """Bumped by every event that can unblock a waiter (see `wait_changed`)."""
        self._changed = asyncio.Condition()
        self._idle_s = 0.0
        self._idle_since: float | None = None
        """Set while no group runs (admission holds new ones back, or none started yet)."""

    @classmethod
    def for_rule(cls, rule: ModeRule, *, batch_groups: int, clock: Callable[[], float] = time.monotonic) -> StalenessManager:
        """The admission machinery of a mode (`asyncrl.admission.mode_rule`): the bound, the consumption
        order and the pace. The one constructor the controller and the simulator share."""
        pace = None if rule.pace_slack is None else Pace(batch_groups=batch_groups, eta=rule.eta, slack=rule.pace_slack)
        return cls(batch_groups=batch_groups, eta=rule.eta, in_order=rule.in_order, pace=pace, clock=clock)

    @property
    def running(self) -> int:
        return sum(self.running_by_version.values())

    @property
    def queued(self) -> int:
        return max(0, self.accepted - self.taken)

    def can_start(self) -> bool:
        if (self.eta + self.version + 1) * self.batch_groups <= self.accepted + self.running:
            return False
        return self.pace is None or self.running + self.queued < self.pace.limit()

    def admission_limit(self) -> int:
        """Groups in flight + queued that admission allows right now (the bound's share, or the pace's if lower)."""
        bound = (self.eta + self.version + 1) * self.batch_groups - self.taken
        return bound if self.pace is None else min(bound, self.pace.limit())

    async def acquire(self) -> int:
        """Wait until a new group may start, count it as running; returns its version
        (pass it back to `finish`)."""
        async with self._changed:
            await self._changed.wait_for(self.can_start)
            self.running_by_version[self.version] += 1
            self._started.setdefault(self.version, deque()).append(self._clock())
            if self._idle_since is not None:
                self._idle_s += self._clock() - self._idle_since
                self._idle_since = None
            return self.version

    def readmit(self, version: int) -> None:
        """A group that was in flight at a checkpoint, taken back by a resume: running again under the
        version it was admitted at (what `finish` is then told), outside the admission rule (it was
        admitted before the checkpoint; `load_state_dict` counts no group as running)."""
        self.running_by_version[version] += 1
        self._started.setdefault(version, deque()).append(self._clock())
        if self._idle_since is not None:
            self._idle_s += self._clock() - self._idle_since
            self._idle_since = None

    def takeable_version(self) -> int | None:
        """The newest group version the trainer may take now; None: any. In order, that is the
        oldest version still running: a newer group waits until the older ones are queued."""
        if not self.in_order or not self.running_by_version:
            return None
        return min(self.running_by_version)

    async def wait_changed(self, seen: int, timeout: float) -> None:
        """Wait until `changes` moves past `seen` (a group ended, a version was published, a
        group was dropped), or `timeout` seconds."""
        async with self._changed:
            try:
                async with asyncio.timeout(timeout):  # not wait_for: on 3.11 it can swallow a cancel
                    await self._changed.wait_for(lambda: self.changes != seen)
            except asyncio.TimeoutError:
                pass

    async def _notify(self) -> None:
        async with self._changed:
            self.changes += 1
            self._changed.notify_all()

    async def finish(self, accepted: bool, cause: str = "", *, version: int) -> None:
        """The group started at `version` (what `acquire` returned) ended: queued for training
        (`accepted`; call after it is in the queue) or dropped for `cause`."""
        if self.running_by_version[version] < 1:
            raise ValueError(f"finish: no group of version {version} is running")
        self.running_by_version[version] -= 1
        if not self.running_by_version[version]:
            del self.running_by_version[version]
        started = self._started.get(version)
        if started:
            t0 = started.popleft()
            if not started:
                del self._started[version]
            if self.pace is not None:
                self.pace.group_done(self._clock() - t0)
        if self.running == 0:
            self._idle_since = self._clock()
        if accepted:
            self.accepted += 1
        else:
            self.dropped[cause or "failed"] += 1
        await self._notify()

    async def took(self, groups: int) -> None:
        """The trainer took `groups` queued groups for a step (frees their place under the pace)."""
        self.taken += groups
        await self._notify()

    async def step_done(self, busy_s: float, wait_s: float) -> None:
        """A trainer step ended: `busy_s` seconds of work after waiting `wait_s` for its batch (the pace's measure)."""
        if self.pace is not None:
            self.pace.step_done(busy_s, wait_s)
            await self._notify()

    async def drop_accepted(self, cause: str, n: int = 1) -> None:
        """Groups that were accepted but are not trained on (too stale, filtered)."""
        self.accepted -= n
        self.dropped[cause] += n
        await self._notify()

    async def set_version(self, version: int) -> None:
        if version < self.version:
            raise ValueError(f"versions only grow: {version} < {self.version}")
        self.version = version
        await self._notify()

    def idle_seconds(self) -> float:
        """Seconds during which no group was generating (the rollout side stood idle)."""
        open_s = self._clock() - self._idle_since if self._idle_since is not None else 0.0
        return self._idle_s + open_s

    def staleness(self, min_version: int, version: int) -> int:
        """Versions between the oldest weights that generated any token and `version` at use, along the
        run's lineage (`transfer_queue.rules.staleness`)."""
        return staleness(min_version, version, self.lineage)

    def resumed(self, version: int, weights_of: int) -> None:
        """A resume publishes the checkpoint's weights (those of version `weights_of`) as `version`, above
        every version published before. Call before that publish; the admission counters move with the
        version, so the headroom admission had at the checkpoint is what it has now."""
        if version <= weights_of or (self.lineage and version <= self.lineage[-1][0]):
            raise ValueError(f"resumed: version {version} must exceed {weights_of} and every earlier resume's")
        self.lineage.append([version, weights_of])
        shift = (version - self.version) * self.batch_groups
        self.taken += shift
        self.accepted += shift

    def too_stale(self, min_version: int, step: int) -> bool:
        return self.staleness(min_version, step) > self.eta

    def state_dict(self) -> dict[str, Any]:
        return {"version": self.version, "accepted": self.accepted, "taken": self.taken, "dropped": dict(self.dropped),
                "lineage": [list(p) for p in self.lineage]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore after resume: in-flight groups were lost with the process, so `running` is 0."""
        self.version, self.accepted = int(state["version"]), int(state["accepted"])
        self.taken = min(self.accepted, int(state.get("taken", self.accepted)))  # absent before the pace existed
        self.dropped = Counter(state["dropped"])
        self.lineage = [list(map(int, p)) for p in state.get("lineage", [])]  # absent before resumes kept one
        self.running_by_version.clear()
        self._started.clear()
