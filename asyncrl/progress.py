"""Progress display of a training run: a rich progress bar on a terminal, one line per step otherwise."""

from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, total: int, *, start: int = 0, enabled: bool = True) -> None:
        self.total, self.start, self.enabled = total, start, enabled
        self.t0 = time.time()
        self.reward = float("nan")
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
        info = f"reward {metrics.get('rollout/reward', float('nan')):.3f} eval {self.reward:.3f} tok/s {metrics.get('throughput/generated_tokens_per_s', 0):.0f}"
        if self._bar is not None:
            self._bar.update(self._task, completed=step, info=info)
            return
        done = step - self.start
        eta = (time.time() - self.t0) / done * (self.total - step) if done else float("nan")
        print(f"step {step}/{self.total}  {info}  elapsed {time.time() - self.t0:.0f}s  ETA {eta:.0f}s", flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
