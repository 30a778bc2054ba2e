"""Progress display of a training run: a rich progress bar on a terminal, one line per step otherwise.

A value not known yet (no training batch before the first step, no ETA before a step was timed)
reads `-`, never `nan`.
"""

from __future__ import annotations

import math
import sys
import time


def fmt(value: float | None, spec: str) -> str:
    """`value` formatted with `spec`, or `-` when it is unknown (None or not finite).

    >>> fmt(0.25, ".3f"), fmt(float("nan"), ".3f"), fmt(None, ".0f")
    ('0.250', '-', '-')
    """
    return "-" if value is None or not math.isfinite(value) else format(value, spec)


class Progress:
    def __init__(self, total: int, *, start: int = 0, enabled: bool = True) -> None:
        self.total, self.start, self.enabled = total, start, enabled
        self.t0 = time.time()
        self.reward: float | None = None
        """The latest held-out reward (`eval/reward`), carried over the steps that do not evaluate."""
        self._bar = None
        if enabled and sys.stdout.isatty():
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
            from rich.progress import Progress as RichProgress

            self._bar = RichProgress(
                TextColumn("[bold]step"),
                MofNCompleteColumn(),
                BarColumn(),
                TextColumn("{task.fields[info]}"),
                TimeElapsedColumn(),
                TextColumn("ETA"),
                TimeRemainingColumn(),
            )
            self._task = self._bar.add_task("train", total=total, completed=start, info="")
            self._bar.start()

    def update(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        self.reward = metrics.get("eval/reward", self.reward)
        info = (f"reward {fmt(metrics.get('rollout/reward'), '.3f')} eval {fmt(self.reward, '.3f')} "
                f"tok/s {fmt(metrics.get('throughput/generated_tokens_per_s'), '.0f')}")
        if self._bar is not None:
            self._bar.update(self._task, completed=step, info=info)
            return
        done = step - self.start
        eta = f"{(time.time() - self.t0) / done * (self.total - step):.0f}s" if done > 0 else "-"
        print(f"step {step}/{self.total}  {info}  elapsed {time.time() - self.t0:.0f}s  ETA {eta}", flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


REACHED = 0.8
"""The held-out reward whose first step `end_lines` names (the demo's figure: docs/benchmarks.md)."""


def first_step_at(curve: list, level: float = REACHED) -> int | None:
    """The first step of `curve` ([step, held-out reward] pairs) whose reward is >= `level`, or None.

    >>> first_step_at([[0, 0.02], [10, 0.5], [20, 0.81], [30, 0.79]])
    20
    """
    return next((int(s) for s, r in curve if r is not None and r >= level), None)


def _counts(d: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in d.items() if v)


def end_lines(summary: dict, run_dir: object) -> list[str]:
    """What `asyncrl train` prints when a run finishes: a few rounded lines, one per topic, for a person;
    every figure, unrounded, is in `run_dir/summary.json`.

    >>> print("\\n".join(end_lines({"mode": "sync", "steps": 3, "wall_s": 9.04, "trained_samples": 96,
    ...     "reward_step0": 0.021875000000000002, "final_eval_reward": 0.5, "best_eval_reward": 0.5,
    ...     "curve": [[0, 0.021875000000000002], [3, 0.5]], "staleness_mean": 0.0, "drops": {},
    ...     "trainer_idle_ratio": 0.5, "rollout_idle_ratio": 0.25}, "runs/r")))
    asyncrl: finished: sync, 3 steps in 9.0 s, 96 samples trained
      held-out reward: 0.02 at step 0 -> 0.50 at step 3 (best 0.50; not >= 0.8)
      staleness: mean 0.00 versions; 0 samples dropped
      idle: trainer 50%, rollout 25%
      every figure: runs/r/summary.json (curve: reward_curve.png, per step: metrics.jsonl)
    """
    s = summary
    lines = [f"asyncrl: finished: {s.get('mode')}, {s.get('steps')} steps in {fmt(s.get('wall_s'), '.1f')} s, "
             f"{s.get('trained_samples')} samples trained" + (" (resumed)" if s.get("resumed") else "")]
    curve = s.get("curve") or []
    if curve:
        reached = first_step_at(curve)
        at = f"first >= {REACHED} at step {reached}" if reached is not None else f"not >= {REACHED}"
        lines.append(f"  held-out reward: {fmt(curve[0][1], '.2f')} at step {curve[0][0]} -> {fmt(curve[-1][1], '.2f')} "
                     f"at step {curve[-1][0]} (best {fmt(s.get('best_eval_reward'), '.2f')}; {at})")
    drops = s.get("drops") or {}
    dropped = f"{sum(drops.values())} samples dropped" + (f" ({_counts(drops)})" if _counts(drops) else "")
    lines.append(f"  staleness: mean {fmt(s.get('staleness_mean'), '.2f')} versions; {dropped}")
    idle = [f"{who} {fmt(100 * s[k], '.0f')}%" for who, k in (("trainer", "trainer_idle_ratio"), ("rollout", "rollout_idle_ratio"))
            if isinstance(s.get(k), (int, float))]
    if idle:
        lines.append(f"  idle: {', '.join(idle)}")
    faults = {"trainer restarts": s.get("trainer_restarts", 0), "non-finite steps skipped": s.get("bad_steps", 0),
              "reward failures": s.get("reward_failures", 0),
              **{f"samples {k}": v for k, v in (s.get("failover") or {}).items() if k != "tokens_kept"},
              **{f"server {k}": v for k, v in ((s.get("fleet") or {}).get("changes") or {}).items()},
              **{f"{split} rows skipped": sum(v.values()) for split, v in (s.get("skipped_rows") or {}).items()}}
    if _counts(faults):
        lines.append(f"  events: {_counts(faults)}")
    lines.append(f"  every figure: {run_dir}/summary.json (curve: reward_curve.png, per step: metrics.jsonl)")
    return lines
