"""The rollout:trainer split of a GPU budget, and the projection over budgets.

Job: for a `Profile` and a budget of G GPUs, simulate `fully_async` on every split in steps of
`profile.split_step` GPUs and keep the one with the most trained tokens/s; compare it with
colocated `sync` on all G GPUs (generate with every GPU, then train with every GPU). The batch
grows with G (weak scaling, `Profile.batch_groups`), so what changes from one budget to the next
is what grows with the cluster: each row carries those terms (`terms`: the publish fan-out, the
all-reduce of the split's trainer and of colocated sync, the sync step's straggler; see
`scale.py`). It knows nothing about deployment: a split is two GPU counts.

`step_s` is one trainer step; `version_s` one published version (`publish_every` trainer steps),
which is what a run that publishes every k steps calls a step (the profile's reference).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from asyncrl.plan.costs import Profile
from asyncrl.plan.scale import straggler_terms
from asyncrl.plan.sim import Schedule, simulate


def schedule_for(profile: Profile, mode: str, steps: int, warmup: int) -> Schedule:
    """The profile's run in `mode`; fully_async's steps and warmup rounded up to whole publish
    periods (a window that cuts one measures part of a period's publish)."""
    if mode != "fully_async":
        return Schedule(mode=mode, eta=profile.eta, publish_every=profile.publish_every, steps=steps, warmup=warmup)
    k = profile.publish_every
    return Schedule(mode=mode, eta=profile.eta, publish_every=k, admission=profile.admission, steps=-(-steps // k) * k,
                    warmup=-(-warmup // k) * k, update_mode=profile.update_mode, staleness_level=profile.staleness_level)


WINDOW = (16, 16)
"""(steps, warmup) over which a projection row's split is measured: long samples run over about 8
trainer steps (two versions) of the public profile, so a window that starts sooner reads the
start-up, when the trainer takes the short groups first (+5-10% tokens/s there)."""

MAX_GROUPS = 128
"""Simulate at most this many groups per step (a slice of a homogeneous fleet, `Costs.slice_factor`):
a 1,024-GPU budget then costs what a 128-GPU one does; slices of 32 to 128 groups agree within the
long tail's seed-to-seed spread (about 5% on the public profile)."""


SEARCH = {"steps": 8, "warmup": 8, "max_groups": 64}
"""The projection's split search, a quarter of `WINDOW`'s cost (shorter, on a smaller slice: the
start-up's bias is about the same for neighbouring splits); the split it picks is then simulated
over `WINDOW` on `MAX_GROUPS`."""


def best_split(profile: Profile, gpus: int, *, steps: int = 12, warmup: int = 3, seeds: int = 1, coarse: int = 8,
               max_groups: int = MAX_GROUPS) -> dict[str, Any]:
    """The split of `gpus` with the most simulated trained tokens/s in `fully_async`: about `coarse`
    splits evenly spread, then, around the best so far, the splits half as far away, until neighbours
    one `split_step` apart (throughput rises with the rollout share until the trainer is the bound,
    then falls); every simulated candidate is listed. Splits are `split_step` apart, or further where
    a slice of at most `max_groups` groups needs it: every candidate's servers divide by the slice."""
    step = math.lcm(profile.split_step, profile.gpus_per_server * _slice(profile.batch_groups(gpus), max_groups))
    lo = max(step, -(-profile.gpus_per_server // step) * step)
    if gpus - lo < step:
        raise ValueError(f"--gpus {gpus}: needs at least {lo + step} GPUs (split_step {step}, gpus_per_server {profile.gpus_per_server}) of profile {profile.name!r}")
    splits = list(range(lo, gpus, step))
    done: dict[int, dict[str, Any]] = {}

    def sim(rollout: int) -> dict[str, Any]:
        if rollout not in done:
            r = simulate(profile.costs(rollout, gpus - rollout), schedule_for(profile, "fully_async", steps, warmup), seeds=seeds,
                         max_groups=max_groups)
            done[rollout] = {"rollout_gpus": rollout, "trainer_gpus": gpus - rollout, **r}
        return done[rollout]

    stride = max(1, -(-len(splits) // coarse))
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


def _slice(groups: int, max_groups: int) -> int:
    """The smallest f dividing `groups` with groups / f <= max_groups (as `Costs.slice_factor` for a fleet that allows it)."""
    return next(f for f in range(1, groups + 1) if groups % f == 0 and groups / f <= max_groups)


def colocated_sync(profile: Profile, gpus: int, *, steps: int = 6, warmup: int = 1, seeds: int = 1) -> dict[str, Any]:
    """Colocated sync on `gpus` GPUs (one simulated step = one version, `Profile.colocated`), its
    step lengthened by the straggler the simulated slice does not see (`scale.straggler_terms`)."""
    c = profile.colocated(gpus)
    r = simulate(c, schedule_for(profile, "sync", steps, warmup), seeds=seeds, max_groups=MAX_GROUPS)
    samples = c.groups * c.group_size
    straggler = straggler_terms(c.lengths, samples, samples // r["slice"], c.token_cost_at(1))
    step = r["step_s"] + straggler["seconds"]
    return {**r, "trained_tokens_per_s": round(r["trained_tokens_per_s"] * r["step_s"] / step, 1), "step_s": round(step, 4),
            "version_s": round(step, 4), "straggler": straggler}


def terms(profile: Profile, rollout_gpus: int, trainer_gpus: int, sync: dict[str, Any]) -> dict[str, Any]:
    """What grows with the cluster at this split (seconds each; `scale.py` has the models)."""
    k, s = profile.publish_every, profile.scaling
    all_reduce = s.collective_terms(trainer_gpus)
    sync_all_reduce = s.collective_terms(rollout_gpus + trainer_gpus)
    return {
        "publish_fanout": {**s.publish_terms(rollout_gpus), "fixed_s": profile.publish_s, "per": "publish (every version)"},
        "all_reduce": {**all_reduce, "per": "trainer step", "per_version_s": round(k * all_reduce["seconds"], 4)},
        "sync_all_reduce": {**sync_all_reduce, "per": "trainer step of colocated sync", "per_version_s": round(k * sync_all_reduce["seconds"], 4)},
        "straggler": {**sync["straggler"], "per": "colocated sync step (the split's trainer takes ready groups: no straggler wait)"},
    }


def projection(profile: Profile, budgets: list[int], *, steps: int = WINDOW[0], warmup: int = WINDOW[1]) -> list[dict[str, Any]]:
    """One row per budget: {gpus, rollout_gpus, trainer_gpus, tokens_per_s, speedup_vs_sync, staleness_mean, ..., terms}."""
    rows: list[dict[str, Any]] = []
    for g in budgets:
        found = best_split(profile, g, **SEARCH)
        near = _neighbours(found)
        best = max((_fully_async(profile, r, g - r, steps, warmup) for r in near), key=lambda row: row["trained_tokens_per_s"])
        sync = colocated_sync(profile, g)
        rows.append({
            "gpus": g, "rollout_gpus": best["rollout_gpus"], "trainer_gpus": best["trainer_gpus"],
            "tokens_per_s": best["trained_tokens_per_s"], "speedup_vs_sync": round(best["trained_tokens_per_s"] / sync["trained_tokens_per_s"], 2),
            "staleness_mean": best["staleness_mean"], "staleness_max": best["staleness_max"],
            "stale_token_fraction": best["stale_token_fraction"], "partial_fraction": best["partial_fraction"],
            "trainer_idle_ratio": best["trainer_idle_ratio"], "rollout_idle_ratio": best["rollout_idle_ratio"],
            "dropped_fraction": best["dropped_fraction"], "step_s": best["step_s"], "version_s": best["version_s"],
            "sync_tokens_per_s": sync["trained_tokens_per_s"], "sync_step_s": sync["step_s"],
            "batch_groups": profile.batch_groups(g),
            "weak_scaling_efficiency": round(best["trained_tokens_per_s"] / g / (rows[0]["tokens_per_s"] / rows[0]["gpus"]), 3) if rows else 1.0,
            "terms": terms(profile, best["rollout_gpus"], best["trainer_gpus"], sync),
        })
    return rows


LIMIT_SHARE = 0.10


def limits(profile: Profile, first: dict[str, Any], share: float = LIMIT_SHARE, upto: int = 1 << 20) -> dict[str, Any]:
    """Where weak scaling stops: for each term that grows with the cluster, the first budget (doubling
    from the first projection row's, at its rollout share) where the term has grown by `share` of
    that row's time per version (the straggler: of its colocated sync step, the only step that waits
    for it); None: not up to `upto` GPUs (the term saturates or grows too slowly)."""
    g0, r0, t0, k, s = first["gpus"], first["rollout_gpus"], first["trainer_gpus"], profile.publish_every, profile.scaling
    c = profile.colocated(g0)
    samples = lambda g: profile.batch_groups(g) * k * profile.group_size
    growth = {
        "publish_fanout": (lambda g: s.publish_terms(r0 * g // g0)["fanout_s"] - s.publish_terms(r0)["fanout_s"], first["version_s"]),
        "all_reduce": (lambda g: k * (s.collective_s(t0 * g // g0) - s.collective_s(t0)), first["version_s"]),
        "sync_straggler": (lambda g: straggler_terms(c.lengths, samples(g), samples(g0), c.token_cost_at(1))["seconds"], first["sync_step_s"]),
    }
    out: dict[str, Any] = {"share": share, "from_gpus": g0, "searched_up_to_gpus": upto}
    for name, (grown, of) in growth.items():
        g = g0 * 2
        while g <= upto and grown(g) < share * of:
            g *= 2
        out[f"{name}_gpus"] = g if g <= upto else None
        out[f"{name}_at_{upto}_s"] = round(grown(upto), 3)
    return out


def _neighbours(found: dict[str, Any]) -> list[int]:
    """The search's best split and the candidates on either side of it (rollout GPUs)."""
    splits = [r["rollout_gpus"] for r in found["candidates"]]
    i = splits.index(found["best"]["rollout_gpus"])
    return splits[max(0, i - 1):i + 2]


def _fully_async(profile: Profile, rollout_gpus: int, trainer_gpus: int, steps: int, warmup: int) -> dict[str, Any]:
    r = simulate(profile.costs(rollout_gpus, trainer_gpus), schedule_for(profile, "fully_async", steps, warmup), seeds=1, max_groups=MAX_GROUPS)
    return {"rollout_gpus": rollout_gpus, "trainer_gpus": trainer_gpus, **r}


def at_split(profile: Profile, rollout_gpus: int, trainer_gpus: int, *, batch_gpus: int | None = None, steps: int = 32,
             warmup: int = 16, seeds: int = 3) -> dict[str, Any]:
    """`fully_async` on one given split, beside colocated sync on the same GPUs (for a reference run);
    `batch_gpus`: the batch of that many GPUs (default: the split's own, weak scaling)."""
    gpus = rollout_gpus + trainer_gpus
    r = simulate(profile.costs(rollout_gpus, trainer_gpus, batch_gpus=batch_gpus), schedule_for(profile, "fully_async", steps, warmup),
                 seeds=seeds, max_groups=MAX_GROUPS)
    sync = colocated_sync(profile, gpus) if batch_gpus in (None, gpus) else _colocated_with_batch(profile, gpus, batch_gpus)
    return {**r, "speedup_vs_sync": round(r["trained_tokens_per_s"] / sync["trained_tokens_per_s"], 2), "sync_step_s": sync["step_s"],
            "terms": terms(profile, rollout_gpus, trainer_gpus, sync)}


def _colocated_with_batch(profile: Profile, gpus: int, batch_gpus: int) -> dict[str, Any]:
    """Colocated sync on `gpus` GPUs with the batch of `batch_gpus` (strong scaling from there)."""
    scaled = replace(profile, groups=profile.batch_groups(batch_gpus), base_gpus=gpus)
    return colocated_sync(scaled, gpus)


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


def calibrate_token_cost(profile: Profile, gpus: int, sync_step_s: float) -> tuple[float, float]:
    """(`token_cost_s`, `token_cost_slope_s`), both scaled by one factor f (the curve's shape kept),
    whose simulated colocated sync step on `gpus` GPUs is `sync_step_s`. The step is linear in f
    (generation and its straggler scale with it: the same draws, the same slots; training and
    publish do not), so two simulations, at f = 1 and f = 2, give it."""
    at = lambda f: colocated_sync(replace(profile, token_cost_s=f * profile.token_cost_s,
                                          token_cost_slope_s=f * profile.token_cost_slope_s), gpus)["step_s"]
    one, two = at(1.0), at(2.0)
    fixed = 2 * one - two
    if sync_step_s <= fixed:
        raise ValueError(f"reference.sync_step_s {sync_step_s} is below the step's training and publish time {fixed:.1f} s")
    f = (sync_step_s - fixed) / (two - one)
    return profile.token_cost_s * f, profile.token_cost_slope_s * f
