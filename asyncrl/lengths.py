"""Response lengths by fate: does what the run throws away skew what it trains on?

Dropping stale samples removes the long ones first (a long sample takes longer to finish, so it is
older when it arrives), and a filter or a failing reward can remove another kind; a run whose drops
are long trains on data biased toward short responses. `LengthBias` counts the response length of
every sample by its fate, so `summary.json` and `asyncrl status` can show the distributions side by
side. Boundary: counts only; the controller and the rollouter report to it.

    bias = LengthBias()
    bias.add("trained", [4, 4, 6])
    bias.add("dropped_stale", [40])
    bias.summary()["dropped_stale"]   # {'count': 1, 'mean': 40.0, 'p50': 40, 'p90': 40, 'max': 40}
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Iterable

FATES = ("trained", "dropped_stale", "dropped_filtered", "dropped_reward_failed", "redone")
"""`redone`: samples in flight at a checkpoint that a resume generated again from their prompt (none of their
saved tokens used; `asyncrl/rollout/resume.py`), by the length they came out; after a resume from a checkpoint
written before in-flight work was kept, counted only."""


class LengthBias:
    """Histograms of response lengths (length -> samples) per fate; see the module docstring."""

    def __init__(self) -> None:
        self.hist: dict[str, Counter[int]] = {f: Counter() for f in FATES}
        self.unmeasured: Counter[str] = Counter()
        """Samples of a fate whose length is not known (counted in `count`, not in the figures)."""

    def add(self, fate: str, lengths: Iterable[int]) -> None:
        if fate not in self.hist:
            raise ValueError(f"length bias: unknown fate {fate!r}, known {FATES}")
        self.hist[fate].update(int(n) for n in lengths)

    def add_unmeasured(self, fate: str, n: int) -> None:
        if fate not in self.hist:
            raise ValueError(f"length bias: unknown fate {fate!r}, known {FATES}")
        self.unmeasured[fate] += int(n)

    def summary(self) -> dict[str, dict[str, Any]]:
        """Per fate with any sample: count, and over the measured ones mean, p50, p90, max.

        >>> b = LengthBias(); b.add("trained", [1, 2, 3, 4, 10]); b.summary()["trained"]
        {'count': 5, 'mean': 4.0, 'p50': 3, 'p90': 10, 'max': 10}
        """
        out: dict[str, dict[str, Any]] = {}
        for fate, h in self.hist.items():
            n = sum(h.values())
            if not n and not self.unmeasured[fate]:
                continue
            row: dict[str, Any] = {"count": n + self.unmeasured[fate]}
            if n:
                row.update(mean=round(sum(k * v for k, v in h.items()) / n, 2), p50=_quantile(h, n, 0.5),
                           p90=_quantile(h, n, 0.9), max=max(h))
            out[fate] = row
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"hist": {f: {str(k): v for k, v in h.items()} for f, h in self.hist.items() if h},
                "unmeasured": dict(self.unmeasured)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for f, h in state.get("hist", {}).items():
            self.hist[f] = Counter({int(k): int(v) for k, v in h.items()})
        self.unmeasured = Counter({f: int(v) for f, v in state.get("unmeasured", {}).items()})


def _quantile(h: Counter[int], n: int, q: float) -> int:
    """The smallest length with at least q of the samples at or below it."""
    need, seen = q * n, 0
    for k in sorted(h):
        seen += h[k]
        if seen >= need:
            return k
    return max(h)
