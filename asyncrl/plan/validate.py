"""Predictions against measurements: `asyncrl plan --validate`.

Job: run the real `asyncrl bench pipeline` (the real Pipeline on cost-model servers and trainer)
on two loads (trainer_ratio 1.0 and 0.5, every mode), simulate the same loads from their
component costs, and report each case's relative error on trained tokens/s. Component costs
are the load's parameters plus what the bench measured for components, not for the pipeline:
publish seconds and the per-request loop lag. The simulated runs draw the same lengths as the
bench's servers (`Costs.length_seed`), so the long tail's luck is shared and the error is the
model's. Rows carry `kind`: `cost_model_bench` (target `BENCH_TARGET`); real demo runs
(`kind: demo_run`, target `DEMO_TARGET`) are `demo.py`'s, which imports this module (not the reverse).
"""

from __future__ import annotations

from typing import Any

from asyncrl.plan.costs import Costs
from asyncrl.plan.sim import MODES, Schedule, simulate

BENCH_TARGET = 0.10
DEMO_TARGET = 0.15
"""Target relative error against real CPU demo runs (`demo.py`'s cases)."""
EVAL_SAMPLES = 1
"""The bench's `eval_samples` (one): the step-0 evaluation runs it on server 0 before any rollout."""
RATIOS = (1.0, 0.5)


def bench_cases(ratios: tuple[float, ...] = RATIOS, quick: bool = True, seed: int = 0,
                modes: tuple[str, ...] = MODES) -> list[dict[str, Any]]:
    from asyncrl.bench.pipeline import QUICK, Load, run

    rows = []
    for ratio in ratios:
        load = Load(**QUICK) if quick else Load()
        load.trainer_ratio = ratio
        measured = run(load, modes, seed)["modes"]
        for mode in modes:
            m = measured[mode]
            costs = Costs.from_load(load, publish_s=m["publish_s"], request_overhead_s=m["loop_lag_ms"] / 1e3, length_seed=seed,
                                    requests_before=EVAL_SAMPLES)
            sched = Schedule(mode=mode, eta=load.eta, publish_every=load.publish_every, admission=load.admission,
                             steps=load.steps[mode], warmup=load.warmup[mode])
            p = simulate(costs, sched, seeds=1, seed=seed)
            rows.append(case(f"bench {'quick' if quick else 'default'} trainer_ratio={ratio} {mode}", "cost_model_bench",
                             p["trained_tokens_per_s"], m["trained_tokens_per_s"], BENCH_TARGET,
                             detail={"predicted": _brief(p), "measured": _brief(m)}))
    return rows


def _brief(r: dict[str, Any]) -> dict[str, Any]:
    return {k: r[k] for k in ("step_s", "staleness_mean", "trainer_idle_ratio", "rollout_idle_ratio", "drops")}


def case(name: str, kind: str, predicted: float, measured: float, target: float, detail: dict[str, Any] | None = None) -> dict[str, Any]:
    err = abs(predicted - measured) / measured
    return {"case": name, "kind": kind, "predicted": predicted, "measured": measured, "rel_error": round(err, 4),
            "target": target, "met": err <= target, **({"detail": detail} if detail else {})}


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    by_kind: dict[str, float] = {}
    for r in rows:
        by_kind[r["kind"]] = max(by_kind.get(r["kind"], 0.0), r["rel_error"])
    return {"validation": rows, "max_rel_error": max(r["rel_error"] for r in rows), "max_rel_error_by_kind": by_kind,
            "targets": {"cost_model_bench": BENCH_TARGET, "demo_run": DEMO_TARGET}}
