"""`asyncrl bench learn`: held-out accuracy of a real pretrained model learning arithmetic, per pipeline mode.

Job: run the recipe `configs/smollm2_arith.yaml` (SmolLM2-135M-Instruct on arithmetic word problems, the torch
rollout engine on CPU) with the real `asyncrl train`, one subprocess per run, one run after another (the runs
own the machine's cores), and compare held-out accuracy against trained samples and wall seconds.
Boundary: it sets config keys and reads what a run writes (`summary.json`, `metrics.jsonl`, `generations.jsonl`);
it knows nothing of the pipeline's internals.

Runs, by label: `sync`, `one_step_off`, `fully_async` (`--modes`); `--ablation` adds fully_async at the staleness
bound eta 4 and 8 (`trainer.max_staleness`, `trainer.admission=bound`, as `asyncrl bench corrections`), each with
the recipe's off-policy correction (`algorithm.correction`) and with `none`: `eta4_decoupled_ppo`, `eta4_none`, ...
Each run lives in `OUT/<label>/`; one whose `summary.json` already has the requested steps is read, not rerun, so
modes run in separate invocations with the same `--out` aggregate into one `learn.json`.

Figures per run: `untrained_accuracy` (the step-0 evaluation), `final_accuracy` (mean of the last three
evaluations after step 0), `gain` (final - untrained), `staleness_mean`, `wall_s`, `trained_samples` (from
`summary.json`) and `points`: at every evaluation the step, `trained_samples` (cumulative, the controller's
`trained_samples` metric; steps x prompts_per_step x group_size where a row lacks it), `wall_s` (the row's time
minus the run's first row's: start-up excluded) and `accuracy` (`eval/exact` where the reward logs it, else
`eval/reward`: 1.0 for a correct `#### N`, exact match). Overall: `fully_async_minus_sync`, fully_async's last three
evaluations minus sync's accuracy at the same trained samples (sync's curve interpolated where the grids differ),
and `targets`, `target_gain_met` (per run), `target_parity_met`.

    asyncrl bench learn [--json] [--quick] [--model DIR] [--modes sync,one_step_off,fully_async] [--steps N]
                        [--ablation] [--etas 4,8] [--out DIR] [--seed S] [--set key=value ...]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from asyncrl.bench.corrections import COMMON, _fmt
from asyncrl.bench.report import pyplot

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "configs" / "smollm2_arith.yaml"
MODES = ("sync", "one_step_off", "fully_async")
ETAS = (4, 8)
QUICK_STEPS = 2
TARGETS = {"gain_min": 0.25, "fully_async_within": 0.03}
"""Every run gains 0.25 accuracy over the untrained model; fully_async ends within 0.03 of sync (or above it)."""
LAST = 3
"""`final_accuracy` averages the last this many evaluations after step 0 (one is noisy)."""
SAMPLES = 3
"""Generations kept per run from the first and the last evaluated step."""
POLL_S = 30.0


def plan_runs(modes: list[str], ablation: bool, correction: str, etas: tuple[int, ...] = ETAS) -> list[tuple[str, list[str]]]:
    """(label, the run's own overrides) for each run, in order.

    >>> [label for label, _ in plan_runs(["sync"], True, "tis")]
    ['sync', 'eta4_tis', 'eta4_none', 'eta8_tis', 'eta8_none']
    >>> [label for label, _ in plan_runs([], True, "tis", (8,))]
    ['eta8_tis', 'eta8_none']
    """
    runs = [(m, [f"trainer.mode={m}"]) for m in modes]
    for eta in etas if ablation else ():
        for corr in dict.fromkeys((correction, "none")):
            runs.append((f"eta{eta}_{corr}", ["trainer.mode=fully_async", f"trainer.max_staleness={eta}",
                                              "trainer.admission=bound", f"algorithm.correction={corr}"]))
    return runs


def accuracy_key(rows: list[dict[str, Any]]) -> str:
    """`eval/exact` where any row has it, else `eval/reward`."""
    return "eval/exact" if any("eval/exact" in r for r in rows) else "eval/reward"


def curve_points(rows: list[dict[str, Any]], per_step: int | None = None) -> list[dict[str, Any]]:
    """One point per evaluation row of `metrics.jsonl`: step, cumulative trained samples, wall s, accuracy.

    >>> rows = [{"step": 0, "time": 100.0, "eval/reward": 0.1}, {"step": 1, "time": 103.0, "trained_samples": 64},
    ...         {"step": 2, "time": 106.5, "trained_samples": 128, "eval/reward": 0.3}]
    >>> [(p["step"], p["trained_samples"], p["wall_s"], p["accuracy"]) for p in curve_points(rows)]
    [(0, 0, 0.0, 0.1), (2, 128, 6.5, 0.3)]
    """
    if not rows:
        return []
    key, t0 = accuracy_key(rows), rows[0]["time"]
    points = []
    for r in rows:
        if key not in r:
            continue
        samples = r.get("trained_samples", r["step"] * per_step if per_step else None)
        points.append({"step": int(r["step"]), "trained_samples": 0 if r["step"] == 0 else samples and int(samples),
                       "wall_s": round(r["time"] - t0, 1), "accuracy": float(r[key])})
    return points


def final_accuracy(points: list[dict[str, Any]]) -> float | None:
    """Mean accuracy of the last `LAST` evaluations after step 0, or None when there is none."""
    after = [p["accuracy"] for p in points if p["step"] > 0][-LAST:]
    return sum(after) / len(after) if after else None


def pick_samples(gens: list[dict[str, Any]], k: int = SAMPLES) -> dict[str, list[dict[str, Any]]]:
    """The first `k` generations (prompt, response, reward) of the first and of the last evaluated step."""
    if not gens:
        return {"first": [], "last": []}

    def keep(step: int) -> list[dict[str, Any]]:
        return [{f: g[f] for f in ("step", "prompt", "response", "reward")} for g in gens if g["step"] == step][:k]

    return {"first": keep(gens[0]["step"]), "last": keep(gens[-1]["step"])}


def run_figures(summary: dict[str, Any], rows: list[dict[str, Any]], gens: list[dict[str, Any]],
                per_step: int | None = None) -> dict[str, Any]:
    """One run's figures from its `summary.json`, `metrics.jsonl` rows and `generations.jsonl` rows (module doc)."""
    points = curve_points(rows, per_step)
    untrained = next((p["accuracy"] for p in points if p["step"] == 0), None)
    final = final_accuracy(points)
    gain = final - untrained if final is not None and untrained is not None else None
    return {"steps": summary["steps"], "accuracy_key": accuracy_key(rows), "untrained_accuracy": untrained,
            "final_accuracy": final, "gain": gain,
            "target_gain_met": None if gain is None else gain >= TARGETS["gain_min"],
            "staleness_mean": summary.get("staleness_mean"), "wall_s": summary.get("wall_s"),
            "trained_samples": summary.get("trained_samples"), "points": points, "samples": pick_samples(gens)}


def interp(points: list[dict[str, Any]], x: float) -> float:
    """Accuracy of a curve at `x` trained samples: linear between its points, its end values beyond them."""
    pts = sorted((p["trained_samples"], p["accuracy"]) for p in points)
    if x <= pts[0][0]:
        return pts[0][1]
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return pts[-1][1]


def parity(sync: dict[str, Any], fully_async: dict[str, Any]) -> float | None:
    """fully_async's mean accuracy over its last `LAST` evaluations after step 0 minus sync's at the same trained samples.

    >>> s = {"points": [{"step": 0, "trained_samples": 0, "accuracy": 0.0}, {"step": 2, "trained_samples": 100, "accuracy": 0.5}]}
    >>> f = {"points": [{"step": 0, "trained_samples": 0, "accuracy": 0.0}, {"step": 1, "trained_samples": 50, "accuracy": 0.3}]}
    >>> round(parity(s, f), 3)
    0.05
    """
    mine = [p for p in fully_async["points"] if p["step"] > 0 and p["trained_samples"] is not None][-LAST:]
    theirs = [p for p in sync["points"] if p["trained_samples"] is not None]
    if not mine or not theirs:
        return None
    return sum(p["accuracy"] - interp(theirs, p["trained_samples"]) for p in mine) / len(mine)


def aggregate(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The overall figures of the runs by label: `fully_async_minus_sync`, its target, the sync / fully_async wall ratio."""
    s, f = runs.get("sync"), runs.get("fully_async")
    diff: float | None = None
    speedup: float | None = None
    if s is not None and f is not None and not s.get("error") and not f.get("error"):
        diff = parity(s, f)
        speedup = s["wall_s"] / f["wall_s"] if s.get("wall_s") and f.get("wall_s") else None
    return {"fully_async_minus_sync": diff, "fully_async_speedup": speedup, "targets": dict(TARGETS),
            "target_parity_met": None if diff is None else diff >= -TARGETS["fully_async_within"]}


def _jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()] if path.exists() else []


def read_run(run: Path, per_step: int | None = None) -> dict[str, Any]:
    """The figures of the run in `run` (a directory `asyncrl train` wrote)."""
    summary = json.loads((run / "summary.json").read_text())
    return run_figures(summary, _jsonl(run / "metrics.jsonl"), _jsonl(run / "generations.jsonl"), per_step)


def _done(run: Path, steps: int) -> bool:
    """Whether `run` holds a finished run of `steps` steps (read, not rerun)."""
    return (run / "summary.json").exists() and json.loads((run / "summary.json").read_text()).get("steps") == steps


def train_once(label: str, overrides: list[str], common: list[str], out: Path, steps: int, per_step: int | None,
               log: TextIO | None = None) -> dict[str, Any]:
    """One `asyncrl train` of the recipe into `out/label` (or the run already there); its figures, or `error`."""
    run = out / label
    if _done(run, steps):
        return {"label": label, "reused": True, **read_run(run, per_step)}
    if run.exists():  # another step count, or a run that died: kept aside, never trained over
        run.rename(out / f"{label}.replaced-{time.strftime('%Y%m%d-%H%M%S')}")
    cmd = [sys.executable, "-m", "asyncrl.cli", "train", str(RECIPE), *common, *overrides,
           f"trainer.total_steps={steps}", f"logging.run_root={out}", f"logging.run_name={label}"]
    t0, seen = time.time(), 0
    with (out / f"{label}.log").open("w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
        while True:
            try:
                proc.wait(timeout=POLL_S)
                break
            except subprocess.TimeoutExpired:  # the run goes on: show its latest evaluations
                points = curve_points(_jsonl(run / "metrics.jsonl"), per_step)
                for p in points[seen:]:
                    if log:
                        print(f"  {label} step {p['step']}: accuracy {p['accuracy']:.3f} ({time.time() - t0:.0f} s)", file=log, flush=True)
                seen = len(points)
    if proc.returncode != 0 or not (run / "summary.json").exists():
        lines = (out / f"{label}.log").read_text().strip().splitlines()
        why = f"exit {proc.returncode}" + (" (killed by a signal: for memory?)" if proc.returncode < 0 else "")
        return {"label": label, "error": f"{why}: {lines[-1] if lines else 'no output'}", "log": str(out / f"{label}.log")}
    return {"label": label, "reused": False, **read_run(run, per_step)}


def run(model: Path, labels: list[tuple[str, list[str]]], steps: int, seed: int, sets: list[str], out: Path,
        per_step: int | None = None, log: TextIO | None = None) -> dict[str, Any]:
    """Every run, one after another, then `aggregate`."""
    common = [*COMMON, f"model.path={model}", f"seed={seed}", *sets]
    out.mkdir(parents=True, exist_ok=True)
    runs: dict[str, dict[str, Any]] = {}
    for label, overrides in labels:
        t = time.time()
        r = runs[label] = train_once(label, overrides, common, out, steps, per_step, log)
        r["overrides"] = overrides
        if log:
            what = r.get("error") or f"final accuracy {_fmt(r['final_accuracy'], '.3f')}, wall {_fmt(r['wall_s'], '.0f')} s"
            print(f"{label}: {what}{' (read, not rerun)' if r.get('reused') else ''} ({time.time() - t:.0f} s)", file=log, flush=True)
    return {"model": str(model), "recipe": str(RECIPE.relative_to(ROOT)), "steps": steps, "seed": seed, "sets": sets,
            "out": str(out), "runs": runs, **aggregate(runs)}


def table(res: dict[str, Any]) -> str:
    """One row per run, then the target lines."""
    head = f"| run | untrained | final (last {LAST}) | gain | gain >= {TARGETS['gain_min']} | staleness | wall s | trained samples |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for label, r in res["runs"].items():
        if r.get("error"):
            lines.append(f"| {label} | failed: {r['error'][:100]} |" + " |" * 6)
            continue
        lines.append(f"| {label} | {_fmt(r['untrained_accuracy'], '.3f')} | {_fmt(r['final_accuracy'], '.3f')} "
                     f"| {_fmt(r['gain'], '+.3f')} | {'-' if r['target_gain_met'] is None else 'yes' if r['target_gain_met'] else 'no'} | {_fmt(r['staleness_mean'], '.2f')} "
                     f"| {_fmt(r['wall_s'], '.0f')} | {_fmt(r['trained_samples'], '.0f')} |")
    d, within = res["fully_async_minus_sync"], TARGETS["fully_async_within"]
    lines.append(f"\nfully_async - sync at equal trained samples: {_fmt(d, '+.3f')} (target >= -{within}: "
                 f"{'not measured' if d is None else 'met' if res['target_parity_met'] else 'missed'})")
    if res.get("fully_async_speedup"):
        lines.append(f"sync wall / fully_async wall: {res['fully_async_speedup']:.2f}x")
    met = [r["target_gain_met"] for r in res["runs"].values() if not r.get("error")]
    lines.append(f"gain >= {TARGETS['gain_min']}: met by {sum(bool(m) for m in met)} of {len(met)} runs")
    return "\n".join(lines)


def plot(res: dict[str, Any], path: Path) -> bool:
    """Held-out accuracy vs trained samples and vs wall seconds, a line per run, dashed: untrained; False without matplotlib."""
    plt = pyplot()
    if plt is None:
        return False
    runs = {k: r for k, r in res["runs"].items() if not r.get("error") and r["points"]}
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8), dpi=90, sharey=True)
    for label, r in runs.items():
        pts = [p for p in r["points"] if p["trained_samples"] is not None]
        axes[0].plot([p["trained_samples"] for p in pts], [p["accuracy"] for p in pts], ".-", label=label)
        axes[1].plot([p["wall_s"] for p in r["points"]], [p["accuracy"] for p in r["points"]], ".-", label=label)
    base = [r["untrained_accuracy"] for r in runs.values() if r["untrained_accuracy"] is not None]
    for ax, xlabel in zip(axes, ("trained samples", "wall s (start-up excluded)")):
        if base:
            ax.axhline(sum(base) / len(base), color="gray", ls="--", lw=1, label="untrained")
        ax.set_xlabel(xlabel)
        ax.legend(fontsize=7)
    axes[0].set_ylabel("held-out accuracy")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="asyncrl bench learn", description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--quick", action="store_true", help=f"a smoke run: fully_async only, {QUICK_STEPS} steps")
    p.add_argument("--model", type=Path, metavar="DIR", help="the model folder (default: smollm2-135m-instruct float32, prepared if missing)")
    p.add_argument("--modes", default=",".join(MODES), metavar="M,M",
                   help=f"comma-separated, of {list(MODES)}; `none` with --ablation: the ablation's runs only")
    p.add_argument("--steps", type=int, metavar="N", help="trainer steps per run (default: the recipe's trainer.total_steps)")
    p.add_argument("--ablation", action="store_true", help="also fully_async at eta 4 and 8, the recipe's correction and none")
    p.add_argument("--etas", default=",".join(map(str, ETAS)), metavar="E,E", help="the ablation's staleness bounds")
    p.add_argument("--out", type=Path, metavar="DIR", help="runs, learn.json and learn.png here (default runs/bench_learn-<date>); "
                                            "a run already there with the requested steps is read, not rerun")
    p.add_argument("--seed", type=int, default=0, metavar="S", help="the runs' seed")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config override for every run (repeatable)")
    args = p.parse_args(argv)
    modes = ["fully_async"] if args.quick else [] if args.modes == "none" else args.modes.split(",")
    if unknown := [m for m in modes if m not in MODES]:
        p.error(f"unknown modes {unknown}; of {list(MODES)}")
    from asyncrl.config import load

    if args.model is None:
        from asyncrl.data.pretrained import ensure_model

        args.model = ensure_model("smollm2-135m-instruct", "float32")
    model = args.model.resolve()
    cfg = load(str(RECIPE), [f"model.path={model}", *args.set])  # a bad --set fails here, before any run
    steps = QUICK_STEPS if args.quick else args.steps or cfg.trainer.total_steps
    labels = plan_runs(modes, args.ablation and not args.quick, cfg.algorithm.correction,
                       tuple(int(e) for e in args.etas.split(",")))
    if not labels:
        p.error("no run: --modes none runs the --ablation's runs only")
    out = (args.out or Path("runs") / f"bench_learn-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    started = time.time()
    res = run(model, labels, steps, args.seed, args.set, out, cfg.trainer.prompts_per_step * cfg.rollout.group_size, log=sys.stderr)
    res["bench_wall_s"] = round(time.time() - started, 1)
    res["plot"] = str(out / "learn.png") if plot(res, out / "learn.png") else "no matplotlib: no plot"
    (out / "learn.json").write_text(json.dumps(res, indent=1))
    if args.json:
        print(json.dumps(res, indent=1))
    else:
        print(table(res))
        print(f"\n{len(res['runs'])} runs of {steps} steps in {res['bench_wall_s']:.0f} s; {out / 'learn.json'}")
    return 1 if any(r.get("error") for r in res["runs"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
