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
