"""`rollout.autoscale`: the rule that sizes the `main` fleet from what the run measures (closed loop).

Every `interval_s` the controller hands the `Autoscaler` one window: how long the trainer waited for
batches in it, and the servers' slot use (requests running, sampled about every second, over
`slots_per_server` per routed server). The rule, with hysteresis (`patience` windows in a row, then
`cooldown_s` before the next change):

- the trainer idle more than `trainer_idle_high` while the servers are busy (slot use at least
  1 - `rollout_idle_high`): the rollout side is the bottleneck. Servers that produce a share
  1 - idle of what the trainer consumes need size / (1 - idle) to keep up: grow to that (at least +1);
- the servers' slots idle more than `rollout_idle_high` while the trainer is fed (idle under half of
  `trainer_idle_high`): the trainer is the bottleneck and the extra servers wait. Shrink to the servers
  the running requests need at a slot use of 1 - `rollout_idle_high` / 2 (at least -1);
- otherwise balanced: no change.

A trainer that waits while the servers are not busy is held by admission (the staleness bound), not by
capacity: more servers would not help, so nothing changes. The verdict of the last window (`bottleneck`:
`rollout`, `trainer` or `balanced`, with the figures) is what `asyncrl status` shows.

Boundary: a pure rule on numbers; the controller measures and `FleetManager.resize` acts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass
class Window:
    """One measurement window."""

    seconds: float
    trainer_wait_s: float
    """Seconds of it the trainer waited for a batch."""
    slot_use: float
    """Mean requests running per routed server over it, over `slots_per_server` (0..1)."""
    servers: int
    """Routed servers at its end."""

    @property
    def trainer_idle(self) -> float:
        return min(1.0, self.trainer_wait_s / max(self.seconds, 1e-9))

    @property
    def rollout_idle(self) -> float:
        return max(0.0, 1.0 - self.slot_use)


class Autoscaler:
    def __init__(self, cfg: Any, configured_servers: int) -> None:
        self.cfg = cfg
        self.min = cfg.min_servers
        self.max = cfg.max_servers or 4 * configured_servers
        self._streak: tuple[str, int] = ("balanced", 0)
        self._last_change = float("-inf")
        self.last: dict[str, Any] = {"bottleneck": "unknown"}
        """The latest window's verdict and figures (`asyncrl status`)."""
        self.decisions = 0

    def decide(self, w: Window, now: float) -> int | None:
        """The new size after window `w` ending at `now`, or None (no change)."""
        c = self.cfg
        if w.trainer_idle > c.trainer_idle_high and w.rollout_idle <= c.rollout_idle_high:
            verdict = "rollout"
        elif w.rollout_idle > c.rollout_idle_high and w.trainer_idle < c.trainer_idle_high / 2:
            verdict = "trainer"
        else:
            verdict = "balanced"
        streak = self._streak[1] + 1 if self._streak[0] == verdict else 1
        self._streak = (verdict, streak)
        self.last = {"bottleneck": verdict, "trainer_idle": round(w.trainer_idle, 3), "rollout_idle": round(w.rollout_idle, 3),
                     "servers": w.servers, "min": self.min, "max": self.max}
        if verdict == "balanced" or streak < c.patience or now - self._last_change < c.cooldown_s:
            return None
        if verdict == "rollout":
            want = max(w.servers + 1, math.ceil(w.servers / max(1.0 - w.trainer_idle, 0.5)))
        else:
            busy = w.slot_use * w.servers  # servers' worth of running requests
            want = min(w.servers - 1, math.ceil(busy / (1.0 - c.rollout_idle_high / 2)))
        want = max(self.min, min(self.max, want))
        if want == w.servers:
            return None
        self._last_change, self._streak = now, ("balanced", 0)
        self.decisions += 1
        self.last["decided"] = want
        return want


def split_from_rates(w: Window, *, generated: int, trained: int) -> dict[str, Any]:
    """The split this run's own measured costs call for: how many servers keep this trainer fed. The
    trainer's capacity is what it trained over the time it worked (the window less its waits); a server's
    is what the fleet generated per server, over its slot use (a server at full slots generates 1 / use
    times as much: linear in running requests, the cost model's law and a real engine's below saturation).
    Empty until the window has both figures."""
    busy = w.seconds - w.trainer_wait_s
    if trained <= 0 or generated <= 0 or busy <= 0 or w.servers <= 0 or w.slot_use <= 0:
        return {}
    trainer = trained / busy
    server = generated / w.seconds / w.servers / w.slot_use
    return {"trainer_tokens_per_s": round(trainer, 1), "server_tokens_per_s_full": round(server, 1),
            "servers_for_trainer": math.ceil(trainer / server)}
