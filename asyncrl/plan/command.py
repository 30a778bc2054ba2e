"""`asyncrl plan`: the planner's command line (prediction, split search, projection, validation).

    asyncrl plan --profile NAME [--gpus 128,256,512,1024] [--plot PATH] [--json]
    asyncrl plan --profile NAME --split 64:64 [--batch-gpus N] [--json]
                                                            one split beside colocated sync
    asyncrl plan --profile-from-bench [--mode M] [--trainer-ratio R] [--json]
                                                            the cost-model bench load, simulated
    asyncrl plan --validate [--validate-kind K] [--json]    predictions against the real bench and real demo runs
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from asyncrl.plan.costs import Costs, load_profile
from asyncrl.plan.sim import MODES, Schedule, simulate

DEFAULT_PROFILE = "qwen2.5-math-7b-h800"


def _gpus(text: str) -> list[int]:
    try:
        return [int(g) for g in text.split(",") if g]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--gpus: a comma-separated list of GPU counts, got {text!r}") from None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="asyncrl plan", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", default=None, help=f"a profile name in asyncrl/plan/profiles or a YAML path (default {DEFAULT_PROFILE})")
    p.add_argument("--gpus", type=_gpus, help="GPU budgets to project (best split each)")
    p.add_argument("--split", help="ROLLOUT:TRAINER GPUs to predict")
    p.add_argument("--batch-gpus", type=int, help="with --split: the batch of this many GPUs (default: the split's own, weak scaling; "
                                                  "the reference's GPUs: its batch, as a run on fewer GPUs with the same batch)")
    p.add_argument("--plot", help="write the projection as a PNG here")
    p.add_argument("--profile-from-bench", action="store_true", help="simulate the `asyncrl bench pipeline` load (its Load parameters)")
    p.add_argument("--quick", action="store_true", help="with --profile-from-bench / --validate: the bench's --quick load")
    p.add_argument("--mode", choices=MODES, help="with --profile-from-bench: one mode (default all)")
    p.add_argument("--trainer-ratio", type=float, default=1.0)
    p.add_argument("--eta", type=int, help="override the profile's / load's eta")
    p.add_argument("--validate", action="store_true", help="run the real bench pipeline and real demo runs, and report the prediction errors")
    p.add_argument("--validate-kind", choices=("all", "cost_model_bench", "demo_run"), default="all",
                   help="with --validate: only the bench cases (~20 s) or only the demo runs (five runs and an engine sweep, ~2-5 min)")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    if a.validate:
        from asyncrl.plan.demo import demo_cases
        from asyncrl.plan.validate import bench_cases, summary

        rows = bench_cases(quick=True) if a.validate_kind in ("all", "cost_model_bench") else []
        out = summary(rows + (demo_cases() if a.validate_kind in ("all", "demo_run") else []))
    elif a.profile_from_bench:
        out = _from_bench(a)
    else:
        out = _projection(a, p)
    print(json.dumps(out, indent=1) if a.json else _table(out))
    return 0


def _from_bench(a: argparse.Namespace) -> dict[str, Any]:
    from asyncrl.bench.pipeline import QUICK, Load

    load = Load(**QUICK) if a.quick else Load()
    load.trainer_ratio = a.trainer_ratio
    if a.eta is not None:
        load.eta = a.eta
    costs = Costs.from_load(load)
    rows = [simulate(costs, Schedule(mode=m, eta=load.eta, publish_every=load.publish_every, admission=load.admission,
                                     steps=4 * load.steps[m], warmup=load.warmup[m]), seeds=3)
            for m in ((a.mode,) if a.mode else MODES)]
    return {"profile": "bench pipeline" + (" --quick" if a.quick else ""), "bound_tokens_per_s": costs.bound, "modes": rows}


def _projection(a: argparse.Namespace, p: argparse.ArgumentParser) -> dict[str, Any]:
    from dataclasses import asdict

    from asyncrl.plan.search import at_split, limits, plot, projection

    try:
        prof = load_profile(a.profile or DEFAULT_PROFILE)
    except ValueError as e:
        p.error(str(e))
    if a.eta is not None:
        prof.eta = a.eta
    out: dict[str, Any] = {"profile": prof.name, "eta": prof.eta, "publish_every": prof.publish_every, "update_mode": prof.update_mode,
                           "staleness_level": prof.staleness_level, "scaling": "weak (batch grows with the GPUs)"}
    if a.split:
        try:
            r, t = (int(x) for x in a.split.split(":"))
        except ValueError:
            p.error(f"--split: ROLLOUT:TRAINER GPU counts, got {a.split!r}")
        out["split"] = {"rollout_gpus": r, "trainer_gpus": t, "batch_gpus": a.batch_gpus or r + t, **at_split(prof, r, t, batch_gpus=a.batch_gpus)}
    rows = projection(prof, a.gpus or [128, 256, 512, 1024])
    out["projection"] = rows
    out["limits"] = limits(prof, rows[0])
    ref = prof.reference
    if ref is not None:
        split = out.get("split")
        same = split if split and (split["rollout_gpus"], split["trainer_gpus"], split["batch_gpus"]) == (ref.rollout_gpus, ref.trainer_gpus, ref.gpus) \
            else at_split(prof, ref.rollout_gpus, ref.trainer_gpus)
        best = next((r for r in rows if r["gpus"] == ref.gpus), None)
        out["reference"] = {**asdict(ref), "predicted_at_reference_split": reference_figures(same),
                            "rel_error": reference_errors(ref, same),
                            "predicted_best_split": None if best is None else {k: best[k] for k in ("rollout_gpus", "trainer_gpus", "speedup_vs_sync")}}
    if a.plot:
        plot(rows, a.plot, prof.name)
        out["plot"] = a.plot
    return out


def reference_figures(r: dict[str, Any]) -> dict[str, Any]:
    """A simulated split in the reference's terms: its step is one published version (`version_s`)."""
    return {"speedup_vs_sync": r["speedup_vs_sync"], "async_step_s": r["version_s"], "sync_step_s": r["sync_step_s"],
            **{k: r[k] for k in ("trainer_idle_ratio", "staleness_mean", "stale_token_fraction", "partial_fraction", "max_partial_span",
                                 "prefill_s", "dropped_fraction")}}


def reference_errors(ref: Any, r: dict[str, Any]) -> dict[str, float]:
    """Relative errors of the prediction on the figures the reference publishes."""
    out = {"speedup_vs_sync": round(r["speedup_vs_sync"] / ref.speedup_vs_sync - 1, 4)}
    if ref.async_step_s:
        out["async_step_s"] = round(r["version_s"] / ref.async_step_s - 1, 4)
    return out


def _table(out: dict[str, Any]) -> str:
    if "validation" in out:
        lines = [f"{'case':<52}{'kind':>18}{'predicted':>12}{'measured':>12}{'rel_error':>11}"]
        lines += [f"{r['case']:<52}{r['kind']:>18}{r['predicted']:>12.1f}{r['measured']:>12.1f}{r['rel_error']:>11.3f}" for r in out["validation"]]
        return "\n".join(lines + [f"max_rel_error {out['max_rel_error']:.3f} (targets: {out['targets']})"])
    if "modes" in out:
        return "\n".join(f"{r['mode']:<13} {r['trained_tokens_per_s']:>10.0f} tok/s  /bound {r['ratio_to_bound']:.3f}  staleness {r['staleness_mean']:.2f}"
                         f"  trainer_idle {r['trainer_idle_ratio']:.2f}  rollout_idle {r['rollout_idle_ratio']:.2f}  drops {r['drops']}" for r in out["modes"])
    lines = [f"profile {out['profile']}, eta {out['eta']}, publish_every {out['publish_every']}, update_mode {out['update_mode']}, "
             f"staleness_level {out['staleness_level']}, {out['scaling']}",
             f"{'gpus':>6}{'rollout':>9}{'trainer':>9}{'tokens/s':>12}{'x sync':>8}{'staleness':>11}{'trainer_idle':>14}{'drops':>8}"]
    lines += [f"{r['gpus']:>6}{r['rollout_gpus']:>9}{r['trainer_gpus']:>9}{r['tokens_per_s']:>12.0f}{r['speedup_vs_sync']:>8.2f}"
              f"{r['staleness_mean']:>11.2f}{r['trainer_idle_ratio']:>14.2f}{r['dropped_fraction']:>8.1%}"
              f"  fanout {r['terms']['publish_fanout']['fanout_s']:.2f} s, all-reduce {r['terms']['all_reduce']['per_version_s']:.1f} s/version,"
              f" straggler {r['terms']['straggler']['seconds']:.2f} s" for r in out["projection"]]
    lim = out["limits"]
    lines.append(f"a term grows by {lim['share']:.0%} of the {lim['from_gpus']}-GPU step at: " + ", ".join(
        f"{k} {lim[k + '_gpus'] or 'never (up to ' + str(lim['searched_up_to_gpus']) + ')'}" for k in ("publish_fanout", "all_reduce", "sync_straggler")))
    if "split" in out:
        sp = out["split"]
        lines.append(f"split {sp['rollout_gpus']}:{sp['trainer_gpus']} (batch of {sp['batch_gpus']} GPUs): {sp['speedup_vs_sync']}x sync, "
                     f"{sp['version_s']:.1f} s per version (colocated sync {sp['sync_step_s']:.1f} s), trainer_idle {sp['trainer_idle_ratio']:.2f}")
    if "reference" in out:
        ref, pred = out["reference"], out["reference"]["predicted_at_reference_split"]
        lines.append(f"reference: {ref['rollout_gpus']}:{ref['trainer_gpus']} on {ref['gpus']} GPUs measured {ref['speedup_vs_sync']}x sync, "
                     f"{ref['async_step_s']} s per step; predicted {pred['speedup_vs_sync']}x, {pred['async_step_s']:.1f} s "
                     f"(errors {ref['rel_error']}), best split {ref['predicted_best_split']}")
    return "\n".join(lines)
