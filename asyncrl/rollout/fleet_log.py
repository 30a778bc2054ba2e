"""What the fleets did: the `FleetManager`'s record of joins, drains, preemptions and restarts.

Job: keep the fleet's changes for the run's log and `asyncrl status`, apart from the manager that
makes them: each change as an event (time, kind, server, fleet, sizes after it, detail), a window of
the latest for the status view with every one handed once to `metrics.jsonl` (`take`), each fleet's
size over time, and the joins by where their first weights came from. No behaviour of the fleet.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

HISTORY = 200
"""Changes of a fleet's size kept for `asyncrl status` (metrics.jsonl has every one)."""
WINDOW = 1000
"""Events kept in memory (`events`); the oldest half goes when it is full (the run's log has them all)."""


class FleetLog:
    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        """Joins, drains, preemptions and restarts, oldest first (`take` hands them to the run's log)."""
        self._taken = 0
        self.counts: Counter[str] = Counter()
        """Events so far by kind (the `events` window drops the oldest)."""
        self.history: dict[str, list[tuple[float, int]]] = {}
        """Per fleet: (time, routed servers) at each change of that number (the last `HISTORY` changes)."""
        self.joins: dict[str, int] = {"peer": 0, "publish": 0, "trainer": 0, "failed": 0}
        """Servers routed after a grow, by where their first weights came from."""

    def record(self, kind: str, server: str, fleet: str, size: dict[str, int], **detail: Any) -> None:
        self.counts[kind] += 1
        self.events.append({"time": round(time.time(), 3), "kind": kind, "server": server, "fleet": fleet, "size": size, **detail})
        self.note_sizes(size)
        if len(self.events) > WINDOW:
            del self.events[:WINDOW // 2]
            self._taken = max(0, self._taken - WINDOW // 2)

    def note_sizes(self, size: dict[str, int]) -> None:
        for name, n in size.items():
            h = self.history.setdefault(name, [])
            if not h or h[-1][1] != n:
                h.append((round(time.time(), 3), n))
                del h[:-HISTORY]

    def metrics(self, size: dict[str, int]) -> dict[str, float]:
        """`fleet/*` for the run's step log: routed servers per fleet (`size`) and the changes so far, by kind."""
        return {**{f"fleet/size_{name}": float(n) for name, n in size.items()},
                **{f"fleet/{kind}s": float(self.counts[kind]) for kind in ("join", "drain", "preempt", "restart")},
                **{f"fleet/joins_{via}": float(n) for via, n in self.joins.items()}}

    def take(self) -> list[dict[str, Any]]:
        """Events since the last call (the controller logs them to metrics.jsonl)."""
        out = self.events[self._taken:]
        self._taken = len(self.events)
        return out
