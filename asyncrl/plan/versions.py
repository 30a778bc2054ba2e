"""Which policy version generated which tokens of a simulated sample, and how old they are at use.

Job: the simulator's per-token version accounting for partial rollouts. A sample that is still
generating when weights are published continues under the new version (`rollout.update_mode`
keep, or abort with `rollout.partial_rollouts`: resubmitted with its tokens so far), so its
response is a sequence of *version runs*, `[(version, tokens), ...]`, as the real trajectory's
`token_versions` are. From the runs of a group the queue and the trainer read what the real
pipeline reads (`asyncrl/trajectory_queue.py`, `asyncrl/trainer/batch.py`):

- `trainer.staleness_level=group`: the group is queued under its *oldest* token's version (the
  first token of its earliest sample) and dropped when that is older than eta at the trainer's step;
- `trainer.staleness_level=token`: it is queued under its *newest* token's version, dropped only
  when even that is older than eta; the tokens older than eta are masked out of the loss but stay
  in the input (so the trainer still pays for them: see `GroupVersions.ages`).

It knows clocks and counts, nothing of servers, admission or the trainer's speed.

Trace (token_cost_s 1, a sample starts at own time 10 under version 2, 30 tokens; publishes at
own times 15 (-> v3) and 32 (-> v4)):  runs [(2, 5), (3, 17), (4, 8)]: first 2, last 4, span 2.
"""

from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import dataclass, field


def version_runs(start: float, tokens: int, token_cost_s: float, first_version: int,
                 publishes: list[tuple[float, int]]) -> list[tuple[int, float]]:
    """The version runs of a sample that generated `tokens` tokens from `start` on its server's own
    clock, one token per `token_cost_s` of it, under `first_version` until the next publish;
    `publishes` is that server's [(own time, new version)] in time order. A publish at exactly
    `start` is already in `first_version` (the sample took its slot while the servers were paused)."""
    runs: list[tuple[int, float]] = []
    version, done = first_version, 0.0
    i = bisect.bisect_right(publishes, (start, float("inf")))
    for t, v in publishes[i:]:
        upto = min(float(tokens), (t - start) / token_cost_s)
        if upto >= tokens:
            break
        if upto > done:
            runs.append((version, upto - done))
            done = upto
        version = v
    runs.append((version, tokens - done))
    return runs


@dataclass
class GroupVersions:
    """The version runs of one group's finished samples, summed by version."""

    tokens: Counter = field(default_factory=Counter)
    """version -> tokens generated under it (all samples of the group)."""
    oldest: int | None = None
    """The oldest version any token came from (the group-level staleness reference)."""
    newest: int | None = None
    """The newest version any token came from (`staleness_level=token`'s queue version)."""
    partial: int = 0
    """Samples whose tokens came from more than one version."""
    max_span: int = 0
    """Largest (last - first version) of one sample."""

    def add(self, runs: list[tuple[int, float]]) -> None:
        for v, n in runs:
            self.tokens[v] += n
        first, last = runs[0][0], runs[-1][0]
        self.oldest = first if self.oldest is None else min(self.oldest, first)
        self.newest = last if self.newest is None else max(self.newest, last)
        if last != first:
            self.partial += 1
            self.max_span = max(self.max_span, last - first)

    def queue_version(self, level: str) -> int:
        """The version the queue files the group under (`trainer.staleness_level`)."""
        return self.oldest if level == "group" else self.newest

    def ages(self, step: int, eta: int) -> tuple[float, float, float]:
        """(tokens, tokens older than eta at `step`, sum of token ages), as `mask_stale_tokens` counts them."""
        total = sum(self.tokens.values())
        stale = sum(n for v, n in self.tokens.items() if step - v > eta)
        return total, stale, sum((step - v) * n for v, n in self.tokens.items())
