"""The rollout:trainer split of a GPU budget, and the projection over budgets.

Job: for a `Profile` and a budget of G GPUs, simulate `fully_async` on every split in steps of
`profile.split_step` GPUs and keep the one with the most trained tokens/s; compare it with
colocated `sync` on all G GPUs (generate with every GPU, then train with every GPU). The batch
grows with G (weak scaling, `Profile.batch_groups`). It knows nothing about deployment: a split
is two GPU counts.
"""

from __future__ import annotations

from typing import Any

from asyncrl.plan.costs import Costs, Profile
from asyncrl.plan.sim import Schedule, simulate


def schedule_for(profile: Profile, mode: str, steps: int, warmup: int) -> Schedule:
    return Schedule(mode=mode, eta=profile.eta, publish_every=profile.publish_every, steps=steps, warmup=warmup)


MAX_GROUPS = 128
"""Simulate at most this many groups per step (a slice of a homogeneous fleet, `Costs.slice_factor`):
a 1,024-GPU budget then costs what a 128-GPU one does; slices of 32 to 128 groups agree within the
long tail's seed-to-seed spread (about 5% on the public profile)."""


def best_split(profile: Profile, gpus: int, *, steps: int = 12, warmup: int = 3, seeds: int = 1, coarse: int = 8) -> dict[str, Any]:
    """The split of `gpus` with the most simulated trained tokens/s in `fully_async`: `coarse` splits
    evenly spread, then, around the best so far, the splits half as far away, until neighbours one
    `split_step` apart (throughput rises with the rollout share until the trainer is the bound, then
    falls); every simulated candidate is listed."""
    step = profile.split_step
    lo = max(step, -(-profile.gpus_per_server // step) * step)
    if gpus - lo < step:
        raise ValueError(f"--gpus {gpus}: needs at least {lo + step} GPUs (split_step {step}, gpus_per_server {profile.gpus_per_server}) of profile {profile.name!r}")
    splits = list(range(lo, gpus, step))
    done: dict[int, dict[str, Any]] = {}

    def sim(rollout: int) -> dict[str, Any]:
        if rollout not in done:
            r = simulate(profile.costs(rollout, gpus - rollout), schedule_for(profile, "fully_async", steps, warmup), seeds=seeds,
                         max_groups=MAX_GROUPS)
            done[rollout] = {"rollout_gpus": rollout, "trainer_gpus": gpus - rollout, **r}
        return done[rollout]

    stride = max(1, len(splits) // coarse)
    for i in range(0, len(splits), stride):
        sim(splits[i])
    best = lambda: splits.index(max(done.values(), key=lambda r: r["trained_tokens_per_s"])["rollout_gpus"])
    while stride > 1:
        stride = (stride + 1) // 2
        i = best()
        for j in (i - stride, i + stride):
            if 0 <= j < len(splits):
                sim(splits[j])
    i = best()
    for j in (i - 1, i + 1):
        if 0 <= j < len(splits):
            sim(splits[j])
    rows = [done[k] for k in sorted(done)]
    return {"best": max(rows, key=lambda r: r["trained_tokens_per_s"]), "candidates": rows}


def colocated_sync(profile: Profile, gpus: int, *, steps: int = 6, warmup: int = 1, seeds: int = 1) -> dict[str, Any]:
    return simulate(profile.colocated(gpus), schedule_for(profile, "sync", steps, warmup), seeds=seeds, max_groups=MAX_GROUPS)


def projection(profile: Profile, budgets: list[int], *, steps: int = 8, warmup: int = 2) -> list[dict[str, Any]]:
    """One row per budget: {gpus, rollout_gpus, trainer_gpus, tokens_per_s, speedup_vs_sync, staleness_mean, ...}."""
    rows = []
    for g in budgets:
        found = best_split(profile, g, steps=steps, warmup=warmup)
        best, sync = found["best"], colocated_sync(profile, g)
        rows.append({
            "gpus": g, "rollout_gpus": best["rollout_gpus"], "trainer_gpus": best["trainer_gpus"],
            "tokens_per_s": best["trained_tokens_per_s"], "speedup_vs_sync": round(best["trained_tokens_per_s"] / sync["trained_tokens_per_s"], 2),
            "staleness_mean": best["staleness_mean"], "staleness_max": best["staleness_max"],
            "trainer_idle_ratio": best["trainer_idle_ratio"], "rollout_idle_ratio": best["rollout_idle_ratio"],
            "dropped_fraction": best["dropped_fraction"], "step_s": best["step_s"],
            "sync_tokens_per_s": sync["trained_tokens_per_s"], "sync_step_s": sync["step_s"],
            "batch_groups": profile.batch_groups(g),
        })
    return rows


def at_split(profile: Profile, rollout_gpus: int, trainer_gpus: int, *, steps: int = 12, warmup: int = 3) -> dict[str, Any]:
    """`fully_async` on one given split, beside colocated sync on the same GPUs (for a reference run)."""
    r = simulate(profile.costs(rollout_gpus, trainer_gpus), schedule_for(profile, "fully_async", steps, warmup), seeds=1, max_groups=MAX_GROUPS)
    sync = colocated_sync(profile, rollout_gpus + trainer_gpus)
    return {**r, "speedup_vs_sync": round(r["trained_tokens_per_s"] / sync["trained_tokens_per_s"], 2), "sync_step_s": sync["step_s"]}


def plot(rows: list[dict[str, Any]], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedFormatter, FixedLocator, NullLocator

    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    g = [r["gpus"] for r in rows]
    ax[0].plot(g, [r["tokens_per_s"] for r in rows], "o-", label="fully_async, best split")
    ax[0].plot(g, [r["sync_tokens_per_s"] for r in rows], "s--", label="colocated sync")
    ax[0].set(xscale="log", yscale="log", xlabel="GPUs", ylabel="trained tokens/s", title=title)
    ax[0].legend()
    ax[1].plot(g, [r["speedup_vs_sync"] for r in rows], "o-", label="speedup vs sync")
    ax[1].plot(g, [r["staleness_mean"] for r in rows], "^-", label="staleness mean")
    for r in rows:
        ax[1].annotate(f"{r['rollout_gpus']}:{r['trainer_gpus']}", (r["gpus"], r["speedup_vs_sync"]), fontsize=8,
                       xytext=(0, 6), textcoords="offset points", ha="center")
    ax[1].set(xscale="log", xlabel="GPUs", title="best split (rollout:trainer)")
    ax[1].legend()
    ax[1].margins(x=0.08, y=0.12)  # room for the split labels at both ends
    for a in ax:  # one label per GPU count, written out (log axes otherwise label 2x10^2, 3x10^2 ... on top of each other)
        a.xaxis.set_major_locator(FixedLocator(g))
        a.xaxis.set_major_formatter(FixedFormatter([f"{x:,}" for x in g]))
        a.xaxis.set_minor_locator(NullLocator())
        a.tick_params(axis="x", labelrotation=45 if len(g) > 6 else 0)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def calibrate_token_cost(profile: Profile, gpus: int, sync_step_s: float) -> float:
    """The `token_cost_s` whose simulated colocated sync step on `gpus` GPUs is `sync_step_s`
    (generation time is proportional to it: the same draws, the same slots)."""
    base = colocated_sync(profile, gpus)["step_s"]
    c = profile.colocated(gpus)
    fixed = c.publish_s + _train_s(c)
    if sync_step_s <= fixed:
        raise ValueError(f"reference.sync_step_s {sync_step_s} is below the step's training and publish time {fixed:.1f} s")
    return profile.token_cost_s * (sync_step_s - fixed) / (base - fixed)


def _train_s(c: Costs) -> float:
    return c.groups * c.group_size * c.lengths.mean / c.trainer_tokens_per_s + c.step_overhead_s
