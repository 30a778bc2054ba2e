"""Admission: what each mode admits (`mode_rule`, the one place a mode becomes numbers) and, in
`fully_async`, its pace: keep just enough work in flight to feed the trainer.

`mode_rule` turns `trainer.mode` and its keys into a `ModeRule` (eta, publish cadence, in-order
consumption, the pace's slack or none); `StalenessManager.for_rule` builds the machinery from it.
The controller, the config's checks (`TrainerConfig.rule`) and the simulator (`plan.sim`) all go
through these two, so a new admission option is added here and reaches all three.

The staleness bound eta (`StalenessManager.can_start`) caps how far rollouts may run ahead. When
the rollout side is faster than the trainer, admission runs up to that cap and every group then
waits in the queue until it is eta versions old: staleness that buys no throughput (measured on
the default job before this rule: 75,776 of 76,800 trained samples at staleness 4). `Pace` adds a
second, soft limit on groups in flight plus groups queued and not yet taken by the trainer:

    limit = B * max(1, latency * (1 + slack) / step) + extra,   clamped to [B, (eta + 1) * B]

- `step`: mean busy seconds of a trainer step (training, publishing, evaluating; not the time it
  waited for data);
- `latency`: seconds from a group's admission to its queueing, the `QUANTILE` of the last
  groups (a batch waits for its B-th group, so the slow ones count, not the mean);
- the trainer takes B groups at a time. The B groups admitted when it takes a batch must be
  ready when it takes the next one: with latency below a step, B groups in flight or queued
  suffice; a latency of k steps needs k batches under way;
- `extra`: feedback for what the estimate misses. A step that waited for data more than
  `WAIT_FRACTION` of its busy time adds the groups it could have trained meanwhile
  (wait / step x B); a step that did not wait lets `extra` decay by `DECAY`.

Staleness then rises only when the trainer would otherwise wait, and eta stays the hard bound.
With a fast rollout side the limit is B: the groups admitted after the trainer took the batch of
step s are generated with the weights of version s and trained at step s + 1, staleness 1 (0
for a group admitted after the publish). Until the first steps are measured the limit is 2 B
(what `one_step_off` admits). `trainer.admission=bound` turns the pace off (admission up to
eta alone).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

WAIT_FRACTION = 0.05
"""A step that waited for data longer than this share of its busy seconds counts as starved."""
DECAY = 0.95
"""Factor on `extra` after a step that was not starved."""
QUANTILE = 0.5
"""Which latency of the recent groups the limit plans for."""
STEP_EMA = 0.3
"""Weight of one step in the mean busy seconds per step."""


class Pace:
    def __init__(self, *, batch_groups: int, eta: int, slack: float = 0.25) -> None:
        if batch_groups < 1 or eta < 0 or slack < 0:
            raise ValueError(f"batch_groups >= 1, eta >= 0 and slack >= 0, got {batch_groups}, {eta}, {slack}")
        self.B, self.eta, self.slack = batch_groups, eta, slack
        self.latency_s: float | None = None
        """The `QUANTILE` of `_recent` (None until a group ended)."""
        self._recent: deque[float] = deque(maxlen=max(32, 4 * batch_groups))
        self.busy_s: float | None = None
        self.extra = 0.0
        self.starved_steps = 0

    @property
    def bound(self) -> int:
        """Groups the staleness bound alone would let be in flight or queued right after a publish."""
        return (self.eta + 1) * self.B

    def limit(self) -> int:
        """Groups in flight plus queued (not yet taken by the trainer) that admission allows now."""
        if self.latency_s is None or self.busy_s is None:
            return min(2 * self.B, self.bound)
        want = self.B * max(1.0, self.latency_s * (1 + self.slack) / max(self.busy_s, 1e-6)) + self.extra
        return max(self.B, min(self.bound, math.ceil(want - 0.05)))  # a twentieth of a group is not worth one

    def group_done(self, latency_s: float) -> None:
        """A group ended (queued or dropped) `latency_s` after it was admitted."""
        self._recent.append(max(0.0, latency_s))
        ordered = sorted(self._recent)
        self.latency_s = ordered[int(QUANTILE * (len(ordered) - 1))]

    def step_done(self, busy_s: float, wait_s: float) -> None:
        """A trainer step ended: it worked `busy_s` seconds and had waited `wait_s` for its batch."""
        busy_s = max(busy_s, 1e-6)
        if self.busy_s is None:  # the first batch waited for the run to start: no signal about the pace
            self.busy_s = busy_s
            return
        self.busy_s += STEP_EMA * (busy_s - self.busy_s)
        if wait_s > WAIT_FRACTION * busy_s:
            self.starved_steps += 1
            self.extra = min(float(self.bound), self.extra + wait_s * self.B / self.busy_s)
        else:
            self.extra *= DECAY


@dataclass(frozen=True)
class ModeRule:
    """The admission numbers of one mode (see `asyncrl.staleness` for what each does).

    Example:
        mode_rule("one_step_off", max_staleness=4, publish_every=2, admission="pace", slack=0.25)
        -> ModeRule(eta=1, publish_every=1, in_order=True, pace_slack=None)
    """

    eta: int
    """The staleness bound: `sync` 0, `one_step_off` 1, `fully_async` `trainer.max_staleness`."""
    publish_every: int
    """Trainer steps per published version (`trainer.publish_every` in `fully_async`, else 1)."""
    in_order: bool
    """The trainer takes no group newer than the oldest one still running (`sync`, `one_step_off`)."""
    pace_slack: float | None
    """`fully_async` with `trainer.admission=pace`: the `Pace`'s slack; None: admission up to eta alone."""


def mode_rule(mode: str, *, max_staleness: int, publish_every: int, admission: str, slack: float) -> ModeRule:
    """The `ModeRule` of `trainer.mode` = `mode` with the other `trainer.*` keys as given (the ones a
    mode does not use are ignored: `sync` and `one_step_off` publish every step and have no pace)."""
    if mode == "sync":
        return ModeRule(eta=0, publish_every=1, in_order=True, pace_slack=None)
    if mode == "one_step_off":
        return ModeRule(eta=1, publish_every=1, in_order=True, pace_slack=None)
    return ModeRule(eta=max_staleness, publish_every=publish_every, in_order=False,
                    pace_slack=slack if admission == "pace" else None)
