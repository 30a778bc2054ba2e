"""`asyncrl bench corrections`: each off-policy correction's held-out reward, dropped share and cost under a deliberate mismatch.

Job: run the real `asyncrl train` (the embedded demo, one subprocess per run) for every correction x
mismatch setting x seed, read each run's `summary.json` and `metrics.jsonl`, and print one row per
(setting, correction) with `none` (plain PPO on the behavior policy, measured in the same bench run)
as the baseline: `reward_vs_none` is a row's held-out reward over `none`'s in the same setting.
Boundary: it only sets config keys and reads what a run writes; it knows no correction's internals.

Settings (`--settings`):
- `eta4`, `eta8`: `trainer.max_staleness` 4 / 8 with `trainer.admission=bound`, which admits up to eta
  versions ahead (the pace would keep the demo's samples one version old). The demo's answers are 4
  tokens, every sample the same length, so it has no long tail of its own: `bound` is what makes
  samples as old as a long tail would (the staleness mean is in each row).
- `bf16_rollout`: the rollout engine in bfloat16 against a float32 trainer (`rollout.dtype=bfloat16
  model.dtype=float32`) at the default pace (samples about one version old): a numerical mismatch
  (|log rho| ~1e-3 on the demo), which the same dtype on both sides does not make on CPU (bf16 both:
  |log-prob gap| ~4e-8, the kernels are the same). A setting the config refuses is reported as
  skipped, with the config's own message.
- `bf16_sync`: the same in `trainer.mode=sync`, every sample on-policy: the dtype's mismatch alone
  (at the default pace one version of staleness is the larger part of `bf16_rollout`'s gap).

Figures per row (means over seeds):
- `final_eval_reward`: held-out reward at the last step; `eval_mean`: mean over every held-out
  evaluation after step 0 (the area under the curve: less noisy than one point);
- `trained_samples`;
- `dropped_share`: the share of generated response tokens that gave no gradient,
  1 - (1 - stale) (1 - masked), where `stale` = samples dropped by an explicit rule (`summary.drops`,
  groups x `rollout.group_size`) over samples trained + dropped, and `masked` = loss tokens the
  correction gave weight 0 over loss tokens trained (`correction/masked_frac`, token weighted);
  `clipped_share`: loss tokens whose weight was truncated (`correction/clip_frac`): kept, but capped;
- `step_s`: wall seconds per step (the run's `wall_s` / steps, start-up excluded); `train_s`: the
  trainer's own seconds per step (`time/train_s`: where a proximal pass shows);
- `ess`, `logprob_gap_mean`: `mismatch/ess` and `mismatch/logprob_gap_mean` where the trainer logs them.

`none` and `bypass` are the same weight function (w = 1, anchored on the behavior policy); their
difference in one bench run is a floor for its noise (`noise` per setting).

    asyncrl bench corrections [--json] [--quick] [--corrections none,tis] [--settings eta4,eta8]
                              [--steps 60] [--seeds 1] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from asyncrl.bench.report import pyplot

BASELINE = "none"
TWIN = "bypass"
"""The same weight function as `none` (w = 1): their difference is a floor for the noise."""


@dataclass(frozen=True)
class Setting:
    name: str
    about: str
    overrides: tuple[str, ...]


SETTINGS = {
    s.name: s for s in (
        Setting("eta4", "staleness up to 4 (trainer.admission=bound)", ("trainer.max_staleness=4", "trainer.admission=bound")),
        Setting("eta8", "staleness up to 8 (trainer.admission=bound)", ("trainer.max_staleness=8", "trainer.admission=bound")),
        Setting("bf16_rollout", "bf16 rollout engine, fp32 trainer", ("rollout.dtype=bfloat16", "model.dtype=float32")),
        Setting("bf16_sync", "bf16 rollout engine, fp32 trainer, no staleness (trainer.mode=sync)",
                ("rollout.dtype=bfloat16", "model.dtype=float32", "trainer.mode=sync")),
    )
}
ALL_CORRECTIONS = ("none", "bypass", "decoupled_ppo", "tis", "mis", "token_tis", "seq_tis", "seq_mis", "icepop",
                   "geo_rs", "k3_rs", "m2po")
"""`--corrections` by default: every registered one, the baseline first (`asyncrl.trainer.corrections.CORRECTIONS`)."""
QUICK = dict(corrections=("none", "tis"), settings=("eta4",), steps=6)
COMMON = ("logging.mlflow=false", "logging.progress=false", "trainer.save_every=0")
"""Every run: no MLflow, no progress lines, one checkpoint at the end only."""
NUMERIC = ("final_eval_reward", "eval_mean", "trained_samples", "dropped_share", "stale_share", "masked_share",
           "clipped_share", "step_s", "train_s", "staleness_mean", "ess", "logprob_gap_mean")


def setting_problem(setting: Setting) -> str:
    """Why the config refuses the setting's keys ('' when it loads): e.g. no `rollout.dtype` of its own."""
    from asyncrl.config import ConfigError, load

    try:
        load(None, list(setting.overrides))
    except ConfigError as e:
        return str(e).splitlines()[0]
    return ""


def _weighted(rows: list[dict[str, Any]], key: str, weight: str | None = "train/tokens") -> float | None:
    """Mean of `key` over the rows that have it, weighted by `weight` (None, or missing from a row: 1)."""
    have = [(r[key], r.get(weight, 1.0) if weight else 1.0) for r in rows if r.get(key) is not None]
    total = sum(w for _, w in have)
    return sum(v * w for v, w in have) / total if have and total else None


def run_row(correction: str, setting: str, seed: int, summary: dict[str, Any], metrics: list[dict[str, Any]],
            group_size: int) -> dict[str, Any]:
    """One run's figures from its `summary.json`, `metrics.jsonl` rows and `rollout.group_size` (see the module doc).

    >>> s = {"steps": 2, "trained_samples": 96, "final_eval_reward": 0.5, "wall_s": 3.0, "drops": {"stale": 1},
    ...      "curve": [[0, 0.0], [1, 0.4], [2, 0.5]], "staleness_mean": 2.0}
    >>> m = [{"step": 1, "train/tokens": 100, "train/correction/masked_frac": 0.1, "time/train_s": 0.5}]
    >>> r = run_row("tis", "eta4", 0, s, m, group_size=4)
    >>> round(r["stale_share"], 3), round(r["dropped_share"], 3), r["eval_mean"], r["step_s"]
    (0.04, 0.136, 0.45, 1.5)
    """
    trained = float(summary["trained_samples"])
    stale = float(sum((summary.get("drops") or {}).values())) * group_size
    stale_share = stale / (trained + stale) if trained + stale else 0.0
    steps = [m for m in metrics if "train/tokens" in m]
    masked = _weighted(steps, "train/correction/masked_frac") or 0.0
    evals = [r for s, r in summary.get("curve") or [] if s > 0]
    return {
        "correction": correction, "setting": setting, "seed": seed,
        "final_eval_reward": summary.get("final_eval_reward"),
        "eval_mean": sum(evals) / len(evals) if evals else None,
        "trained_samples": trained,
        "dropped_share": 1.0 - (1.0 - stale_share) * (1.0 - masked),
        "stale_share": stale_share, "masked_share": masked,
        "clipped_share": _weighted(steps, "train/correction/clip_frac") or 0.0,
        "step_s": summary["wall_s"] / max(summary["steps"], 1),
        "train_s": _weighted(steps, "time/train_s", weight=None),
        "staleness_mean": summary.get("staleness_mean"),
        "ess": _weighted(steps, "train/mismatch/ess"),
        "logprob_gap_mean": _weighted(steps, "train/mismatch/logprob_gap_mean"),
        "nan": any(isinstance(v, float) and math.isnan(v) for m in steps for v in m.values()),
    }


def _mean(vals: Iterable[Any]) -> float | None:
    xs = [float(v) for v in vals if v is not None]
    return sum(xs) / len(xs) if xs else None


def aggregate(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Rows per (setting, correction), means over seeds, with `reward_vs_none` / `eval_mean_vs_none`
    against `none` in the same setting, and per setting `noise`: |none - bypass| of the held-out reward.

    >>> a = aggregate([{"setting": "eta4", "correction": c, "seed": 0, "final_eval_reward": r, "eval_mean": r}
    ...                for c, r in (("none", 0.4), ("bypass", 0.5), ("tis", 0.6))])
    >>> [round(r["reward_vs_none"], 2) for r in a["rows"]], round(a["noise"]["eta4"]["final_eval_reward"], 3)
    ([1.0, 1.25, 1.5], 0.1)
    """
    keys: list[tuple[str, str]] = []
    for r in runs:
        if (r["setting"], r["correction"]) not in keys:
            keys.append((r["setting"], r["correction"]))
    rows = []
    for setting, corr in keys:
        mine = [r for r in runs if (r["setting"], r["correction"]) == (setting, corr)]
        ok = [r for r in mine if not r.get("error")]
        row: dict[str, Any] = {"correction": corr, "setting": setting, "seeds": len(ok),
                               **{k: _mean(r.get(k) for r in ok) for k in NUMERIC}}
        if len(ok) > 1 and row["final_eval_reward"] is not None:
            xs = [r["final_eval_reward"] for r in ok]
            row["final_eval_reward_std"] = (sum((x - row["final_eval_reward"]) ** 2 for x in xs) / (len(xs) - 1)) ** 0.5
        errors = [r["error"] for r in mine if r.get("error")]
        if errors:
            row["error"] = errors[0]
        row["nan"] = any(r.get("nan") for r in ok)
        rows.append(row)
    noise: dict[str, dict[str, float]] = {}
    for setting in dict.fromkeys(s for s, _ in keys):
        base = next((r for r in rows if r["setting"] == setting and r["correction"] == BASELINE), None)
        twin = next((r for r in rows if r["setting"] == setting and r["correction"] == TWIN), None)
        for r in (r for r in rows if r["setting"] == setting):
            for key, out in (("final_eval_reward", "reward_vs_none"), ("eval_mean", "eval_mean_vs_none")):
                b = base and base.get(key)
                r[out] = r[key] / b if b and r.get(key) is not None else None
        if base and twin and base.get("final_eval_reward") is not None and twin.get("final_eval_reward") is not None:
            noise[setting] = {k: abs(base[k] - twin[k]) for k in ("final_eval_reward", "eval_mean")
                              if base.get(k) is not None and twin.get(k) is not None}
    return {"rows": rows, "noise": noise}


def _fmt(v: Any, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def table(res: dict[str, Any]) -> str:
    """The rows as a markdown table (what docs/benchmarks.md holds), then skipped settings and the noise."""
    head = ("| setting | correction | held-out final | vs none | held-out mean | vs none | dropped | of it masked "
            "| clipped | staleness | step s | train s | ESS | log-prob gap |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in res["rows"]:
        if r.get("error"):
            lines.append(f"| {r['setting']} | {r['correction']} | failed: {r['error'][:80]} |" + " |" * 12)
            continue
        lines.append(
            f"| {r['setting']} | {r['correction']} | {_fmt(r['final_eval_reward'], '.3f')} | {_fmt(r['reward_vs_none'], '.2f')} "
            f"| {_fmt(r['eval_mean'], '.3f')} | {_fmt(r['eval_mean_vs_none'], '.2f')} | {_fmt(r['dropped_share'], '.1%')} "
            f"| {_fmt(r['masked_share'], '.1%')} | {_fmt(r['clipped_share'], '.1%')} | {_fmt(r['staleness_mean'], '.2f')} "
            f"| {_fmt(r['step_s'], '.2f')} | {_fmt(r['train_s'], '.2f')} | {_fmt(r['ess'], '.2f')} | {_fmt(r['logprob_gap_mean'], '.3f')} |"
            + (" NaN" if r.get("nan") else ""))
    for name, why in (res.get("skipped") or {}).items():
        lines.append(f"\nskipped setting {name}: {why}")
    for name, n in (res.get("noise") or {}).items():
        lines.append(f"\nnoise floor in {name}: |none - bypass| = {n.get('final_eval_reward', 0):.3f} final, "
                     f"{n.get('eval_mean', 0):.3f} mean")
    return "\n".join(lines)


def plot(res: dict[str, Any], path: Path) -> bool:
    """Held-out reward (bars: final, dots: mean) and dropped share per correction, one group per setting; False without matplotlib."""
    plt = pyplot()
    if plt is None:
        return False
    rows = [r for r in res["rows"] if not r.get("error")]
    settings = list(dict.fromkeys(r["setting"] for r in rows))
    corrs = list(dict.fromkeys(r["correction"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.6), dpi=90)
    width = 0.8 / max(len(settings), 1)
    for k, s in enumerate(settings):
        by = {r["correction"]: r for r in rows if r["setting"] == s}
        xs = [i + (k - (len(settings) - 1) / 2) * width for i in range(len(corrs))]
        get = lambda key: [by[c][key] if c in by and by[c][key] is not None else 0.0 for c in corrs]  # noqa: E731
        axes[0].bar(xs, get("final_eval_reward"), width, label=f"{s} final")
        axes[0].plot(xs, get("eval_mean"), "k.", ms=4)
        axes[1].bar(xs, [100 * v for v in get("dropped_share")], width, label=s)
    axes[0].set_ylabel("held-out reward (bar: final, dot: mean)")
    axes[1].set_ylabel("dropped share (%)")
    for ax in axes:
        ax.set_xticks(range(len(corrs)))
        ax.set_xticklabels(corrs, rotation=45, ha="right", fontsize=8)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def train_once(correction: str, setting: Setting, seed: int, steps: int, root: Path) -> dict[str, Any]:
    """One `asyncrl train` of the demo under `setting`; its row, or `error` with the run's last output line."""
    import yaml

    name = f"{setting.name}-{correction}-s{seed}"
    cmd = [sys.executable, "-m", "asyncrl.cli", "train", *setting.overrides, *COMMON, f"algorithm.correction={correction}",
           f"trainer.total_steps={steps}", f"seed={seed}", f"logging.run_root={root}", f"logging.run_name={name}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120 + 10 * steps, cwd=root, env=os.environ.copy())
    run = root / name
    if proc.returncode != 0 or not (run / "summary.json").exists():
        last = (proc.stderr.strip() or proc.stdout.strip() or f"exit {proc.returncode}").splitlines()[-1]
        return {"correction": correction, "setting": setting.name, "seed": seed, "error": last}
    summary = json.loads((run / "summary.json").read_text())
    metrics = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    group_size = int(yaml.safe_load((run / "config.yaml").read_text())["rollout"]["group_size"])
    return run_row(correction, setting.name, seed, summary, metrics, group_size)


def run(corrections: list[str], settings: list[str], steps: int, seeds: int, log: Any = None) -> dict[str, Any]:
    """Every run, one after another (the machine's cores are the runs' own), then `aggregate`."""
    from asyncrl.trainer.corrections import CORRECTIONS

    unknown = [c for c in corrections if c not in CORRECTIONS.names()] + [s for s in settings if s not in SETTINGS]
    if unknown:
        raise SystemExit(f"asyncrl bench corrections: unknown {unknown}; corrections {CORRECTIONS.names()}, settings {list(SETTINGS)}")
    if BASELINE not in corrections:
        corrections = [BASELINE, *corrections]
    skipped = {s: why for s in settings if (why := setting_problem(SETTINGS[s]))}
    runs = []
    with tempfile.TemporaryDirectory(prefix="asyncrl-bench-corrections-") as tmp:
        for s in (s for s in settings if s not in skipped):
            for c in corrections:
                for seed in range(seeds):
                    t = time.time()
                    runs.append(train_once(c, SETTINGS[s], seed, steps, Path(tmp)))
                    if log:
                        r = runs[-1]
                        print(f"  {s} {c} seed {seed}: {r.get('error') or _fmt(r['final_eval_reward'], '.3f')} "
                              f"({time.time() - t:.0f} s)", file=log, flush=True)
    res = aggregate(runs)
    res.update(runs=runs, skipped=skipped, steps=steps, seeds=seeds,
               settings={s: list(SETTINGS[s].overrides) for s in settings}, cores=os.cpu_count())
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="asyncrl bench corrections", description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--quick", action="store_true", help=f"{','.join(QUICK['corrections'])} on {QUICK['settings'][0]}, "
                                                       f"{QUICK['steps']} steps (about 25 s)")
    p.add_argument("--corrections", default=",".join(ALL_CORRECTIONS), help="comma-separated (none is always run)")
    p.add_argument("--settings", default="eta4,eta8,bf16_rollout", help=f"comma-separated, of {list(SETTINGS)}")
    p.add_argument("--steps", type=int, default=60, help="trainer steps per run")
    p.add_argument("--seeds", type=int, default=1, help="runs per (setting, correction), seeds 0..K-1")
    p.add_argument("--out", type=Path, help="write results.json and corrections.png here")
    args = p.parse_args(argv)
    corrs, sets, steps = args.corrections.split(","), args.settings.split(","), args.steps
    if args.quick:
        corrs, sets, steps = list(QUICK["corrections"]), list(QUICK["settings"]), int(QUICK["steps"])  # type: ignore[call-overload]
    started = time.time()
    res = run(corrs, sets, steps, args.seeds, log=sys.stderr)
    res["bench_wall_s"] = round(time.time() - started, 1)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(res, indent=1))
        res["plot"] = str(args.out / "corrections.png") if plot(res, args.out / "corrections.png") else "no matplotlib: no plot"
    if args.json:
        print(json.dumps(res, indent=1))
    else:
        print(table(res))
        print(f"\n{len(res['runs'])} runs of {steps} steps in {res['bench_wall_s']:.0f} s")
    return 1 if any(r.get("error") for r in res["runs"]) else 0


if __name__ == "__main__":
    sys.exit(main())
