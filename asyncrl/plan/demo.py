"""Predictions against real demo runs: the `demo_run` cases of `asyncrl plan --validate`.

Job: run the embedded demo (`asyncrl train`: tiny model, torch engine, real trainer, on this
host's CPUs) twice or more as subprocesses: one *calibration* run in `sync` measures the
components per step (seconds per generated token of a request at the batch's concurrency, trainer
seconds per trained token, publish seconds, the controller's other per-step seconds) from its
`metrics.jsonl`; then *validation* runs (another seed, each mode asked for) are predicted by the
simulator from those costs alone and compared on trained tokens/s over their steady-state steps.
The validation runs' numbers never feed the costs. It knows the metric names the controller logs
(`time/train_s`, `time/wait_rollout_s`, `weights/publish_s`, `train/tokens`, `time`), nothing of
the trainer or the engine. What the costs leave out: on this host the rollout engine and the
trainer share the CPUs, so overlapping them (one_step_off, fully_async) slows both; a batched
engine's per-token cost depends on how many requests it runs.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncrl.plan.costs import Costs
from asyncrl.plan.sim import Schedule, simulate
from asyncrl.rollout.cost_model import LongTail

DEMO_TARGET = 0.15
WARMUP = 5
"""Steps left out of every measurement (the first trainer steps run up to 3x slower: allocator and thread warm-up)."""
STEPS = 16
OVERRIDES = (f"trainer.total_steps={STEPS}", "trainer.eval_every=1000", "trainer.save_every=0", "logging.mlflow=false",
             "logging.progress=false", "trainer.prompts_per_step=8", "rollout.group_size=8", "data.eval_size=8")
"""The demo's small batch (8 groups of 8 four-token responses) so a run takes seconds."""
ENGINE_BATCH = 512
"""`rollout.max_batch_size`'s default: the torch engine decodes up to this many requests at once
(and `rollout.max_running_samples` 0 puts no fleet cap on admission)."""


@dataclass
class DemoCosts:
    """Per-step components measured from a calibration run (means over its steps after `WARMUP`:
    throughput is a sum of step times, so a mean, not a median, is what predicts it)."""

    token_cost_s: float
    """Generation seconds per response token of one request, at the calibration batch's concurrency."""
    trainer_s_per_token: float
    publish_s: float
    step_overhead_s: float
    """Per step, the trainer loop's seconds outside waiting, training and publishing (ack, metrics, logging)."""
    response_tokens: int
    groups: int
    group_size: int

    def costs(self) -> Costs:
        """One server that runs every request of the batch at once (the demo's torch engine)."""
        return Costs(servers=1, max_concurrency=ENGINE_BATCH, token_cost_s=self.token_cost_s,
                     lengths=LongTail(short_tokens=self.response_tokens, long_fraction=0.0, jitter=0.0),
                     trainer_tokens_per_s=1.0 / self.trainer_s_per_token, groups=self.groups, group_size=self.group_size,
                     publish_s=self.publish_s, step_overhead_s=self.step_overhead_s)


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The trainer steps' rows of a run's `metrics.jsonl` (step >= 1), in step order."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return sorted((r for r in rows if r["step"] >= 1 and "time/train_s" in r), key=lambda r: r["step"])


def _window(rows: list[dict[str, Any]], warmup: int) -> list[dict[str, Any]]:
    """Steps after `warmup`, less the last one (it also runs the final evaluation and checkpoint)."""
    if len(rows) < warmup + 3:
        raise ValueError(f"trainer.total_steps: a demo measurement needs >= {warmup + 3} steps, the run logged {len(rows)}")
    return rows[warmup - 1:-1]  # the first row only anchors the window's start time


def calibrate(rows: list[dict[str, Any]], groups: int, group_size: int, warmup: int = WARMUP) -> DemoCosts:
    """Components of a `sync` run: there every step waits for a whole batch generated at once, so
    `time/wait_rollout_s` / response tokens is a request's per-token cost at that concurrency."""
    w = _window(rows, warmup)
    steps = w[1:]
    mean = lambda f: statistics.fmean(f(r) for r in steps)
    length = max(1, round(mean(lambda r: r["rollout/response_length"])))
    period = [b["time"] - a["time"] for a, b in zip(w, w[1:])]
    other = statistics.fmean(p - r["time/wait_rollout_s"] - r["time/train_s"] - r.get("weights/publish_s", 0.0) for p, r in zip(period, steps))
    return DemoCosts(token_cost_s=mean(lambda r: r["time/wait_rollout_s"]) / length,
                     trainer_s_per_token=sum(r["time/train_s"] for r in steps) / sum(r["train/tokens"] for r in steps),
                     publish_s=mean(lambda r: r.get("weights/publish_s", 0.0)), step_overhead_s=max(0.0, other),
                     response_tokens=length, groups=groups, group_size=group_size)


def measure(rows: list[dict[str, Any]], warmup: int = WARMUP) -> dict[str, float]:
    """Trained tokens/s and trainer idle over the window (`_window`), from the logged step times."""
    w = _window(rows, warmup)
    span = w[-1]["time"] - w[0]["time"]
    steps = w[1:]
    return {"trained_tokens_per_s": sum(r["train/tokens"] for r in steps) / span,
            "trainer_idle_ratio": sum(r["time/wait_rollout_s"] for r in steps) / span, "step_s": span / len(steps)}


def train(mode: str, seed: int, root: Path, timeout_s: float = 120.0) -> Path:
    """One demo run as its own process (`asyncrl train`); returns its run directory."""
    name = f"{mode}-seed{seed}"
    cmd = [sys.executable, "-m", "asyncrl.cli", "train", f"trainer.mode={mode}", f"seed={seed}", f"logging.run_root={root}",
           f"logging.run_name={name}", *OVERRIDES]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode:
        raise RuntimeError(f"demo run {name} failed ({done.returncode}): {done.stderr[-2000:]}")
    return root / name


def schedule_of(run_dir: Path) -> Schedule:
    """The run's schedule from its resolved `config.yaml` (mode, eta, publish_every, admission)."""
    import yaml

    t = yaml.safe_load((run_dir / "config.yaml").read_text())["trainer"]
    return Schedule(mode=t["mode"], eta=t["max_staleness"], publish_every=t["publish_every"], admission=t["admission"],
                    steps=t["total_steps"] - WARMUP - 1, warmup=WARMUP)


def demo_cases(modes: tuple[str, ...] = ("sync", "fully_async"), root: Path | None = None) -> list[dict[str, Any]]:
    """Per mode: calibrate on a `sync` run (seed 1), then predict that mode's run (seed 2) right
    after it, so both see the same load of a shared host (`load_avg` in the detail says how busy)."""
    import os

    from asyncrl.plan.validate import case

    with tempfile.TemporaryDirectory(prefix="asyncrl-plan-demo-") as tmp:
        base = root or Path(tmp)
        out = []
        for mode in modes:
            cal = calibrate(read_metrics(train("sync", 1, base / mode)), groups=8, group_size=8)
            run = train(mode, 2, base / mode)
            m = measure(read_metrics(run))
            p = simulate(cal.costs(), schedule_of(run), seeds=1)
            out.append(case(f"demo {mode} (calibrated on a sync run)", "demo_run", p["trained_tokens_per_s"],
                            round(m["trained_tokens_per_s"], 1), DEMO_TARGET,
                            detail={"costs": {k: round(v, 6) for k, v in vars(cal).items()}, "load_avg": round(os.getloadavg()[0], 2),
                                    "predicted": {k: p[k] for k in ("step_s", "trainer_idle_ratio")},
                                    "measured": {k: round(v, 4) for k, v in m.items()}}))
    return out
