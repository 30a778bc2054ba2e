"""Predictions against real demo runs: the `demo_run` cases of `asyncrl plan --validate`.

Job: run the embedded demo (`asyncrl train`: tiny model, torch engine, real trainer, on this
host's CPUs) as subprocesses. *Calibration* runs (seeds 1 and 3, averaged): `sync` ones measure the
components per step alone (seconds per generated token of a request at the batch's concurrency,
trainer seconds per trained token, publish seconds, the controller's other per-step seconds) from
their `metrics.jsonl`; those in `one_step_off`, where generation overlaps training on the same two
cores (and the same GIL: the engine is a thread of the trainer's process), fits the contention
factor (`Costs.contention`) that makes the simulator reproduce their trained tokens/s. Then
*validation* runs (seed 2, each mode asked for) are predicted from those costs alone and compared
on trained tokens/s over their steady-state steps; their numbers never feed the costs. It knows
the metric names the controller logs (`time/train_s`, `time/wait_rollout_s`, `weights/publish_s`,
`train/tokens`, `time`), nothing of the trainer or the engine. A batched engine's per-token cost
grows with the requests it runs (`Costs.token_cost_slope_s`): an engine sweep (`engine_sweep.py`,
the engine alone) gives the line's shape, scaled so that at the sync run's concurrency it prices
the sync run's own per-token cost (`with_concurrency`). What the costs leave out: the load other
processes put on a shared host between the calibration and the validated runs.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from asyncrl.plan.costs import Costs
from asyncrl.plan.sim import Schedule, simulate
from asyncrl.plan.validate import DEMO_TARGET, case
from asyncrl.engines.cost_model import LongTail

WARMUP = 5
"""Steps left out of every measurement (the first trainer steps run up to 3x slower: allocator and thread warm-up)."""
STEPS = 32
"""Startup (~15 s) dominates a run; 32 steps (~8 s more than 16) halve the window's noise."""
OVERRIDES = ("trainer.eval_every=1000", "trainer.save_every=0", "logging.mlflow=false",
             "logging.progress=false", "trainer.prompts_per_step=8", "rollout.group_size=8", "data.eval_size=8", "trainer.threads=1")
"""The demo's small batch (8 groups of 8 four-token responses) so a run takes seconds."""
CAL_RUNS = 2
"""Calibration runs per mode (seeds 1, 3, ...), averaged: one run's mean moved by up to 25% from one
run to the next here (a few steps 3x slower), and the validated runs never see it."""
CAL_SEEDS = tuple(1 + 2 * i for i in range(CAL_RUNS))
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
    contention: float = 1.0
    """Slow-down of both sides while they overlap (`fit_contention`)."""
    token_cost_slope_s: float = 0.0
    """Seconds per token each request in flight adds (`with_concurrency`); `token_cost_s` is then the base."""

    def costs(self) -> Costs:
        """One server that runs every request of the batch at once (the demo's torch engine)."""
        return Costs(servers=1, max_concurrency=ENGINE_BATCH, token_cost_s=self.token_cost_s,
                     lengths=LongTail(short_tokens=self.response_tokens, long_fraction=0.0, jitter=0.0),
                     trainer_tokens_per_s=1.0 / self.trainer_s_per_token, groups=self.groups, group_size=self.group_size,
                     publish_s=self.publish_s, step_overhead_s=self.step_overhead_s, contention=self.contention,
                     token_cost_slope_s=self.token_cost_slope_s)


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


def mean_costs(runs: list[DemoCosts]) -> DemoCosts:
    """The mean of several calibration runs' components (each a mean over as many steps)."""
    fields = ("token_cost_s", "trainer_s_per_token", "publish_s", "step_overhead_s")
    return replace(runs[0], **{f: statistics.fmean(getattr(r, f) for r in runs) for f in fields},
                   response_tokens=max(1, round(statistics.fmean(r.response_tokens for r in runs))))


def with_concurrency(cal: DemoCosts, points: dict[int, float]) -> DemoCosts:
    """`cal` with a per-token cost that grows with the requests in flight: the engine sweep's line
    `base + slope x c` (`engine_sweep.fit_line`) scaled by one factor so that at the sync batch's
    concurrency (groups x group_size, all at once) it equals the sync run's measured `token_cost_s`
    (which also carries the pipeline's per-request work the engine alone does not)."""
    from asyncrl.plan.engine_sweep import fit_line

    base, slope = fit_line(points)
    at = cal.groups * cal.group_size
    k = cal.token_cost_s / (base + slope * at)
    return replace(cal, token_cost_s=k * base, token_cost_slope_s=k * slope)


def fit_contention(cal: DemoCosts, schedule: Schedule, measured_tokens_per_s: float, hi: float = 16.0) -> float:
    """The contention factor with which the simulator predicts `measured_tokens_per_s` for a run
    that overlaps generation and training (bisection: throughput falls as contention grows);
    1.0 when the run is at least as fast as no contention predicts, `hi` at most."""
    predict = lambda k: simulate(replace(cal, contention=k).costs(), schedule, seeds=1)["trained_tokens_per_s"]
    lo = 1.0
    if predict(lo) <= measured_tokens_per_s:
        return lo
    if predict(hi) >= measured_tokens_per_s:
        return hi
    for _ in range(30):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if predict(mid) > measured_tokens_per_s else (lo, mid)
    return round((lo + hi) / 2, 4)


def measure(rows: list[dict[str, Any]], warmup: int = WARMUP) -> dict[str, float]:
    """Trained tokens/s and trainer idle over the window (`_window`), from the logged step times."""
    w = _window(rows, warmup)
    span = w[-1]["time"] - w[0]["time"]
    steps = w[1:]
    return {"trained_tokens_per_s": sum(r["train/tokens"] for r in steps) / span,
            "trainer_idle_ratio": sum(r["time/wait_rollout_s"] for r in steps) / span, "step_s": span / len(steps)}


def train(mode: str, seed: int, root: Path, steps: int = STEPS, timeout_s: float = 180.0) -> Path:
    """One demo run as its own process (`asyncrl train`); returns its run directory."""
    name = f"{mode}-seed{seed}"
    cmd = [sys.executable, "-m", "asyncrl.cli", "train", f"trainer.mode={mode}", f"seed={seed}", f"logging.run_root={root}",
           f"logging.run_name={name}", *OVERRIDES, f"trainer.total_steps={steps}"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode:
        raise RuntimeError(f"demo run {name} failed ({done.returncode}): {done.stderr[-2000:]}")
    return root / name


def schedule_of(run_dir: Path) -> Schedule:
    """The run's schedule from its resolved `config.yaml` (`Schedule.of_run`)."""
    import yaml

    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    return Schedule.of_run(cfg["trainer"], cfg["rollout"], steps=cfg["trainer"]["total_steps"] - WARMUP - 1, warmup=WARMUP)


def calibration(root: Path, steps: int = STEPS, seeds: tuple[int, ...] = CAL_SEEDS, overlap_run: bool = True,
                concurrency: bool = True) -> tuple[DemoCosts, dict[str, Any]]:
    """The costs of the calibration runs (one per seed and mode, averaged): `sync` (components alone),
    the engine sweep (the slope with concurrency; `concurrency=False`: none), then `one_step_off` (the
    contention, fitted with the slope in place to their mean throughput); `overlap_run=False`: no
    one_step_off run, contention 1."""
    from asyncrl.plan.engine_sweep import run_sweep

    cal = mean_costs([calibrate(read_metrics(train("sync", s, root, steps)), groups=8, group_size=8) for s in seeds])
    seen: dict[str, Any] = {}
    if concurrency:
        points = run_sweep()
        cal = with_concurrency(cal, points)
        seen["engine_sweep_s_per_token"] = {c: round(v, 6) for c, v in points.items()}
    if not overlap_run:
        return cal, seen
    runs = [train("one_step_off", s, root, steps) for s in seeds]
    over = statistics.fmean(measure(read_metrics(run))["trained_tokens_per_s"] for run in runs)
    k = fit_contention(cal, schedule_of(runs[0]), over)
    return replace(cal, contention=k), {**seen, "one_step_off_tokens_per_s": round(over, 1)}


def demo_cases(modes: tuple[str, ...] = ("sync", "one_step_off", "fully_async"), root: Path | None = None,
               steps: int = STEPS, overlap_run: bool = True, concurrency: bool = True,
               seeds: tuple[int, ...] = CAL_SEEDS) -> list[dict[str, Any]]:
    """Calibrate once (`calibration`, `seeds`: 1 and 3), then predict each mode's run (seed 2) from it, the
    runs back to back so they see about the same load of a shared host (`load_avg` in the detail)."""
    import os


    with tempfile.TemporaryDirectory(prefix="asyncrl-plan-demo-") as tmp:
        base = root or Path(tmp)
        cal, seen = calibration(base / "calibration", steps, seeds, overlap_run=overlap_run, concurrency=concurrency)
        label = f"{'sync + one_step_off' if overlap_run else 'sync'} runs of seeds {', '.join(map(str, seeds))}" \
            + (" + an engine sweep" if concurrency else "")
        out = []
        for mode in modes:
            run = train(mode, 2, base / "validation", steps)
            m = measure(read_metrics(run))
            p = simulate(cal.costs(), schedule_of(run), seeds=1)
            out.append(case(f"demo {mode} (calibrated on {label})", "demo_run", p["trained_tokens_per_s"],
                            round(m["trained_tokens_per_s"], 1), DEMO_TARGET,
                            detail={"costs": {k: round(v, 9) for k, v in vars(cal).items()}, "calibration": seen,
                                    "load_avg": round(os.getloadavg()[0], 2),
                                    "predicted": {k: p[k] for k in ("step_s", "trainer_idle_ratio")},
                                    "measured": {k: round(v, 4) for k, v in m.items()}}))
    return out
