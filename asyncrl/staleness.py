"""Version accounting and the admission rule: the one owner of "how stale may a sample be".

Version = the trainer's optimizer-step count at publication; `version` here is the last
*published* version (the newest weights a rollout can use). A new group may start only
while `(eta + version + 1) * batch_groups > accepted + running`, where `accepted` counts
groups that finished and were queued for training (dropped ones do not count) and
`running` counts groups in generation. The modes are this one rule with different
`eta`: `sync` is eta = 0 (a batch is generated with the current weights, then trained,
then published), `one_step_off` is eta = 1 (batch t+1 is generated while batch t
trains), `fully_async` is the configured eta.

What the rule guarantees, and what it does not: if groups are trained in the order they
started, group g is trained at step about g / batch_groups <= eta + version-at-its-start,
so staleness (trainer step at use - oldest token version) <= eta, also when weights are
published only every k steps. Groups *finish* out of start order: a group waits for its
longest sample. The queue hands out the oldest ready groups first (lowest version), so a
late group is not passed over by younger ones; but a group whose generation alone spans
more than about eta trainer steps (a long sample started late in a step) cannot be trained
within eta. The bound on what is trained is then kept by the queue, which drops such a
group and counts it (`dropped["stale"]`), and the admission slot it held is given back.
`asyncrl bench pipeline` reports that share. This rule caps how far rollouts run ahead;
the rollouter also waits for a free fleet slot (`rollout.max_running_samples`), so admitted
groups run instead of queueing in the servers.

Trace (batch_groups=2, eta=0, i.e. sync):
    version 0: start g0, g1 (2 > 0, 2 > 1); g2 waits (2 > 2 is false)
    g0, g1 finish -> accepted 2; trainer takes both, steps, publishes version 1
    version 1: (0+1+1)*2 = 4 > 2 -> start g2, g3; both are trained at version 1: staleness 0

A sample that still exceeds eta when the trainer takes it (e.g. after a resume) is
dropped and counted under `dropped["stale"]`.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from typing import Any


class StalenessManager:
    def __init__(self, *, batch_groups: int, eta: int) -> None:
        if batch_groups < 1 or eta < 0:
            raise ValueError(f"batch_groups must be >= 1 and eta >= 0, got {batch_groups}, {eta}")
        self.batch_groups, self.eta = batch_groups, eta
        self.version = 0
        self.accepted = 0
        self.running = 0
        self.dropped: Counter[str] = Counter()
        self._changed = asyncio.Condition()
        self._idle_s = 0.0
        self._idle_since: float | None = None
        """Set while no group runs (admission holds new ones back, or none started yet)."""

    def can_start(self) -> bool:
        return (self.eta + self.version + 1) * self.batch_groups > self.accepted + self.running

    async def acquire(self) -> None:
        """Wait until a new group may start, and count it as running."""
        async with self._changed:
            await self._changed.wait_for(self.can_start)
            self.running += 1
            if self._idle_since is not None:
                self._idle_s += time.monotonic() - self._idle_since
                self._idle_since = None

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def finish(self, accepted: bool, cause: str = "") -> None:
        """A started group ended: queued for training (`accepted`) or dropped for `cause`."""
        self.running -= 1
        if self.running == 0:
            self._idle_since = time.monotonic()
        if accepted:
            self.accepted += 1
        else:
            self.dropped[cause or "failed"] += 1
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
        open_s = time.monotonic() - self._idle_since if self._idle_since is not None else 0.0
        return self._idle_s + open_s

    @staticmethod
    def staleness(min_version: int, step: int) -> int:
        """Trainer step at use minus the oldest version that generated any token."""
        return step - min_version

    def too_stale(self, min_version: int, step: int) -> bool:
        return self.staleness(min_version, step) > self.eta

    def state_dict(self) -> dict[str, Any]:
        return {"version": self.version, "accepted": self.accepted, "dropped": dict(self.dropped)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore after resume: in-flight groups were lost with the process, so `running` is 0."""
        self.version, self.accepted = int(state["version"]), int(state["accepted"])
        self.dropped = Counter(state["dropped"])
        self.running = 0
