"""`asyncrl bench pipeline`: trained tokens/s of `sync`, `one_step_off` and `fully_async` on a long-tail load.

Job: measure orchestration. The real `Pipeline` (Rollouter, admission, Router, TrajectoryQueue,
CheckpointEngine publish, trainer loop) runs against simulated servers and a simulated trainer
(`engines/cost_model.py`) whose costs are wall-time sleeps, so CPU contention does not decide the result.
Capacities: rollout = servers * max_concurrency / token_cost_s tokens/s, trainer =
trainer_ratio * rollout (balanced by default). The bound for any mode is min(rollout, trainer).

Why `sync` loses on a long tail: each step generates a whole batch, so it waits for the batch's
longest sample (5% of samples are 10x longer) while most slots idle, then trains while every
server idles. `one_step_off` hides the training but still waits for the tail each step: it
consumes in order (step s trains the groups of version s - 1 and waits for the last of them),
so every group after the first batch is exactly one version old and none is dropped.
`fully_async` admits groups under the staleness bound eta and, by default, only as many as the
trainer consumes while a group generates (`--admission pace`, `asyncrl/admission.py`; `bound`
admits up to eta alone), so both sides stay busy, the slower side sets the pace, and samples do
not wait in the queue for staleness that buys nothing. `--staleness-level token` masks only the
tokens older than eta instead of dropping their group (`token_staleness_mean`,
`stale_token_fraction` report it); the drops described below are then gone, the masked tokens
are what remains of that limit.

What keeps `fully_async` under the bound on this load is the staleness bound, not the schedule.
The trainer takes the oldest ready groups first and admission also waits for a free fleet slot
(`rollout.max_running_samples` = servers x max_concurrency), so groups run as soon as admitted
and a late group is not passed over by younger ones. But a long sample (750-1250 tokens at
5 ms/token: 3.75-6.25 s) spans 2.6-4.3 trainer steps at 0.95 of the bound (1.53 s/step), and
staleness counts from its group's first token: with starts spread evenly over a step (a busy
fleet starts a group whenever a slot frees), a group is trainable within eta = 4 only if its
long sample started early enough in its step. Even with no queueing at all, the share of
tokens that cannot make it is 7% at 0.85 of the bound, 14% at 0.90 and 22% at 0.95, so the
best case is about 0.87. The queue drops such groups (`drops`, cause `stale`); they fall on
groups with a long sample, so long samples are under-represented in what is trained
(`trained_long_fraction` against `long_fraction`). Consuming in order instead (the trainer
waits for the oldest running group, as `one_step_off` does) removes the drops and that bias
but makes the whole pipeline run at the staleness limit, where admission idles the fleet
(measured: rollout idle 13-15%, staleness mean 3.0 instead of 1.7, throughput 0.84-0.86 of
the bound against 0.81-0.83 ready first on the same host). Publishing also pauses every
server each step (`publish_s`), and a loaded host delays the simulated clock (`loop_lag_ms`):
keep the per-token cost large enough that this lag is a small part of a request.

Per mode it reports, over the steps after `warmup` (steady state): trained tokens/s, its ratio
to the bound, the speedup over `sync`, trainer and rollout idle ratios in that window (rollout
idle = 1 - generated tokens / rollout capacity), mean seconds per step and of it not training,
staleness max / mean over all steps, drops. `--json` prints the same as JSON only; `--quick`
runs a small, fast load (a smoke test: its millisecond costs make the figures noisier). The
default load takes about 100 s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from asyncrl.bench.report import finish
from asyncrl.engines.cost_model import CostModelServer, LongTail

MODES = ("sync", "one_step_off", "fully_async")
TARGET_RATIO, TARGET_SPEEDUP = 0.95, 2.8


@dataclass
class Load:
    servers: int = 4
    max_concurrency: int = 16
    """Requests one server runs at once (continuous batching); more wait for a slot."""
    token_cost_s: float = 0.005
    """Seconds per generated token of one running request."""
    lengths: LongTail = field(default_factory=LongTail)
    groups: int = 16
    """Groups per trainer step (trainer.prompts_per_step)."""
    group_size: int = 8
    trainer_ratio: float = 1.0
    """Trainer capacity / rollout capacity."""
    eta: int = 4
    """trainer.max_staleness of fully_async."""
    publish_every: int = 1
    update_mode: str = "keep"
    admission: str = "pace"
    """trainer.admission of fully_async: `pace` (in flight + queued from measured rates) or `bound` (eta alone)."""
    staleness_level: str = "group"
    """trainer.staleness_level: `group` or `token` (older tokens masked out of the loss, not dropped with their group)."""
    steps: dict[str, int] = field(default_factory=lambda: {"sync": 3, "one_step_off": 4, "fully_async": 12})
    """Measured steps per mode (after `warmup`)."""
    warmup: dict[str, int] = field(default_factory=lambda: {"sync": 1, "one_step_off": 1, "fully_async": 3})

    @property
    def rollout_capacity(self) -> float:
        return self.servers * self.max_concurrency / self.token_cost_s

    @property
    def trainer_capacity(self) -> float:
        return self.trainer_ratio * self.rollout_capacity

    @property
    def bound(self) -> float:
        return min(self.rollout_capacity, self.trainer_capacity)


QUICK = dict(servers=2, max_concurrency=8, token_cost_s=0.0005, lengths=LongTail(short_tokens=40), groups=4,
             steps={"sync": 4, "one_step_off": 5, "fully_async": 16}, warmup={"sync": 1, "one_step_off": 1, "fully_async": 4})


def build_parts(load: Load, seed: int) -> Any:
    """Components of a run on the cost model (what `launch.build` makes for a real run): cost-model
    servers behind their hosts, a `TimedEngine` trainer rank, one `local` data plane and a `local`
    weight plane, all in this process."""
    from asyncrl.engines.sample import Sample
    from agents.single_turn import SingleTurnAgent
    from checkpoint_engine import WeightsConfig
    from transfer_queue.storage.local import LocalStorage

    from asyncrl.data.datasets import Prompt, PromptSet, PromptStream
    from asyncrl.launch import Components
    from asyncrl.engines.base import SamplingParams
    from asyncrl.rollout.fleet import FleetManager
    from asyncrl.rollout.fleet_build import Fleet
    from asyncrl.rollout.host import ServerHost
    from asyncrl.rollout.router import Router
    from asyncrl.trainer.rank import TrainerRank

    rng = random.Random(seed)

    async def reward(response: str, answer: str) -> float:
        return rng.random()  # rewards do not matter here; random ones keep advantages non-degenerate

    prompts = PromptSet([Prompt(index=i, text=str(i), prompt_ids=[1 + i % 97, 2, 3], answer="") for i in range(256)])
    decode = lambda ids: ""
    plane = LocalStorage(inline_max_bytes=0)
    agent = SingleTurnAgent(decode=decode, reward_fn=reward, sampling=SamplingParams(max_tokens=load.lengths.max))
    eval_agent = SingleTurnAgent(decode=decode, reward_fn=reward, sampling=SamplingParams(max_tokens=1))

    async def spawn() -> FleetManager:
        servers = [CostModelServer(token_cost_s=load.token_cost_s, max_concurrency=load.max_concurrency, lengths=load.lengths, seed=seed + i)
                   for i in range(load.servers)]
        hosts = [ServerHost(s, name=f"main-{i}", agent=agent, eval_agent=eval_agent, plane=plane) for i, s in enumerate(servers)]
        manager = FleetManager(Router(), restart_dead=False)
        await manager.add_fleet(Fleet("main", hosts))
        return manager

    return Components(
        model_path="",
        tokenizer=None,
        task=None,  # type: ignore[arg-type]  # the pipeline never reads the task
        prompts=PromptStream(prompts, seed=seed),
        trainer=TrainerRank(_timed_engine(load), plane=plane,
                            weights=WeightsConfig(backend="local", bucket_size_mb=1)),
        eval_samples=[Sample(uid="eval-0", group_id="eval-0", index_in_group=0, group_size=1, prompt_ids=[1, 2, 3], answer="")],
        make_plan=TokenBatch(long_above=load.lengths.short_tokens * (1 + load.lengths.jitter)),
        storage=plane,
        spawn=spawn,
    )


def _timed_engine(load: Load) -> Any:
    from asyncrl.trainer.cost_model import TimedEngine

    engine = TimedEngine(1.0 / load.trainer_capacity)
    engine.eta, engine.token_level = load.eta, load.staleness_level == "token"
    return engine


class TokenBatch:
    """`make_plan` of the cost-model run: the plan of the real pipeline, and a count of the trained
    samples that were long (to compare with `LongTail.long_fraction`: stale drops bias it)."""

    def __init__(self, long_above: float) -> None:
        from asyncrl.batching import PlanBuilder
        from asyncrl.config import AlgorithmConfig

        self.plans = PlanBuilder(AlgorithmConfig(), pad_id=0)
        self.long_above = long_above
        self.samples = 0
        self.long = 0

    def __call__(self, groups: list[list[Any]]) -> tuple[Any, int]:
        from asyncrl.trajectory_queue import generated_tokens

        lens = [generated_tokens(s) for g in groups for s in g]
        self.samples += len(lens)
        self.long += sum(n > self.long_above for n in lens)
        return self.plans(groups)


def run_mode(mode: str, load: Load, seed: int = 0) -> dict[str, Any]:
    """One mode on the real `Pipeline`; figures over the steady-state window."""
    from asyncrl.config import LoggingConfig, load as load_config
    from asyncrl.controller import Pipeline
    from asyncrl.metrics import MetricsLogger

    total = load.warmup[mode] + load.steps[mode]
    cfg = load_config(None, [
        f"trainer.mode={mode}", f"trainer.total_steps={total}", f"trainer.prompts_per_step={load.groups}",
        f"trainer.max_staleness={load.eta}", f"trainer.publish_every={load.publish_every}",
        f"trainer.eval_every={10 ** 9}", "trainer.save_every=0", f"rollout.group_size={load.group_size}",
        f"rollout.update_mode={load.update_mode}", f"trainer.admission={load.admission}", f"trainer.staleness_level={load.staleness_level}", f"rollout.max_running_samples={load.servers * load.max_concurrency}",
        "queue.storage=local", "weights.backend=local",
        "weights.bucket_size_mb=1", "logging.mlflow=false", "logging.progress=false", f"seed={seed}",
    ])
    with tempfile.TemporaryDirectory(prefix="asyncrl-bench-pipeline-") as tmp:
        run_dir = Path(tmp)
        metrics = MetricsLogger(LoggingConfig(mlflow=False, progress=False), run_dir, {})

        async def go() -> tuple[dict[str, Any], Any, list[Any]]:
            parts = build_parts(load, seed)
            try:
                summary = await Pipeline(cfg, parts, run_dir, metrics).run()
                return summary, parts, [h.server for h in parts.servers]
            finally:
                await parts.close()

        try:
            summary, parts, servers = asyncio.run(go())
        finally:
            metrics.close()
        logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    publish_s = [m["weights/publish_s"] for m in logged if m["step"] > 0 and "weights/publish_s" in m]
    out = measure(mode, load, summary, parts, servers, sum(publish_s) / max(len(publish_s), 1))
    window = [m for m in logged if m["step"] > load.warmup[mode] and "admission/limit" in m]
    for key, name in (("train/token_staleness_mean", "token_staleness_mean"), ("train/stale_token_fraction", "stale_token_fraction"),
                      ("admission/limit", "admission_limit_mean")):
        vals = [m[key] for m in window if key in m]
        out[name] = round(sum(vals) / len(vals), 3) if vals else None
    return out


def measure(mode: str, load: Load, summary: dict[str, Any], parts: Any, servers: list[Any], publish_s: float) -> dict[str, Any]:
    steps = parts.trainer.engine.steps
    w = load.warmup[mode]
    t0, t1 = steps[w - 1][1] if w else steps[0][0], steps[-1][1]
    window = steps[w:]
    span = t1 - t0
    tokens = sum(s[2] for s in window)
    busy = sum(s[1] - s[0] for s in window)
    generated = sum(k for srv in servers for t, k in srv.completions if t0 < t <= t1)
    hist = {int(k): v for k, v in summary["staleness_hist"].items()}
    n = sum(hist.values())
    tps = tokens / span
    return {
        "steps": len(steps),
        "measured_steps": len(window),
        "trained_tokens_per_s": round(tps, 1),
        "ratio_to_bound": round(tps / load.bound, 3),
        "generated_tokens_per_s": round(generated / span, 1),
        "trainer_idle_ratio": round(1 - busy / span, 3),
        "rollout_idle_ratio": round(1 - generated / (load.rollout_capacity * span), 3),
        "step_s": round(span / len(window), 3),
        "wait_s": round((span - busy) / len(window), 3),
        "staleness_max": max(hist),
        "staleness_mean": round(sum(k * v for k, v in hist.items()) / n, 3),
        "publish_s": round(publish_s, 3),
        "loop_lag_ms": round(1e3 * sum(s.late_s for s in servers) / max(sum(len(s.completions) for s in servers), 1), 2),
        "trained_long_fraction": round(parts.make_plan.long / parts.make_plan.samples, 4),
        "drops": sum(summary["drops"].values()),
        "dropped_fraction": round(sum(summary["drops"].values()) / (sum(summary["drops"].values()) + len(steps) * load.groups), 3),
        "drops_by_cause": summary["drops"],
        "wall_s": summary["wall_s"],
    }


def run(load: Load, modes: tuple[str, ...] = MODES, seed: int = 0) -> dict[str, Any]:
    rows = {m: run_mode(m, load, seed) for m in modes}
    base = rows.get("sync", {}).get("trained_tokens_per_s")
    for r in rows.values():
        r["speedup_vs_sync"] = round(r["trained_tokens_per_s"] / base, 2) if base else None
    lt = load.lengths
    out: dict[str, Any] = {
        "load": {**{k: v for k, v in asdict(load).items() if k != "lengths"}, "lengths": asdict(lt), "mean_length": lt.mean,
                 "samples_per_step": load.groups * load.group_size, "slots": load.servers * load.max_concurrency,
                 "tokens_per_step": lt.mean * load.groups * load.group_size},
        "rollout_capacity_tokens_per_s": load.rollout_capacity,
        "trainer_capacity_tokens_per_s": load.trainer_capacity,
        "bound_tokens_per_s": load.bound,
        "modes": rows,
    }
    fa = rows.get("fully_async")
    if fa is not None:
        out["targets"] = {
            "fully_async_ratio": {"target": TARGET_RATIO, "measured": fa["ratio_to_bound"], "met": fa["ratio_to_bound"] >= TARGET_RATIO},
            "speedup_vs_sync": {"target": TARGET_SPEEDUP, "measured": fa["speedup_vs_sync"],
                                "met": fa["speedup_vs_sync"] is not None and fa["speedup_vs_sync"] >= TARGET_SPEEDUP},
        }
    return out


def print_table(res: dict[str, Any]) -> None:
    ld = res["load"]
    lt = ld["lengths"]
    print(f"load: {ld['servers']} servers x {ld['max_concurrency']} slots, {ld['token_cost_s'] * 1e3:g} ms/token/request; "
          f"lengths {lt['short_tokens']} tokens +-{lt['jitter']:.0%}, {lt['long_fraction']:.0%} x{lt['long_factor']:g} (mean {ld['mean_length']:g}); "
          f"step = {ld['groups']} groups x {ld['group_size']} = {ld['samples_per_step']} samples (~{ld['tokens_per_step']:.0f} tokens); "
          f"eta {ld['eta']}, publish_every {ld['publish_every']}, update_mode {ld['update_mode']}, "
          f"admission {ld['admission']}, staleness_level {ld['staleness_level']}")
    print(f"capacity: rollout {res['rollout_capacity_tokens_per_s']:.0f} tok/s, trainer {res['trainer_capacity_tokens_per_s']:.0f} tok/s, "
          f"bound {res['bound_tokens_per_s']:.0f} tok/s")
    cols = ["mode", "tok/s", "/bound", "x sync", "step_s", "wait_s", "publish_s", "lag_ms", "trainer_idle", "rollout_idle", "stale_max",
            "stale_mean", "drops", "steps"]
    print(("{:<13}" + "{:>13}" * (len(cols) - 1)).format(*cols))
    for m, r in res["modes"].items():
        vals = [r["trained_tokens_per_s"], r["ratio_to_bound"], r["speedup_vs_sync"], r["step_s"], r["wait_s"], r["publish_s"], r["loop_lag_ms"],
                r["trainer_idle_ratio"], r["rollout_idle_ratio"], r["staleness_max"], r["staleness_mean"],
                f"{r['drops']} ({r['dropped_fraction']:.0%})", f"{r['measured_steps']}+{r['steps'] - r['measured_steps']}w"]
        print(("{:<13}" + "{:>13}" * len(vals)).format(m, *[str(v) for v in vals]))
    print("step_s, wait_s: mean seconds per trainer step and of it not training; rollout_idle: 1 - generated tokens / rollout "
          "capacity; lag_ms: mean delay of a request's return past its due time (event-loop lag, CPU load); drops: groups generated, then dropped as too stale (share of all finished groups)")
    rows = res["modes"].items()
    print(f"long samples among trained ones (drawn: {lt['long_fraction']:.1%}): "
          + ", ".join(f"{m} {r['trained_long_fraction']:.1%}" for m, r in rows)
          + "; generated tokens/s: " + ", ".join(f"{m} {r['generated_tokens_per_s']:.0f}" for m, r in rows))
    for name, t in res.get("targets", {}).items():
        print(f"target {name} >= {t['target']}: measured {t['measured']} -> {'met' if t['met'] else 'NOT met'}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="asyncrl bench pipeline", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="print the figures as JSON only")
    p.add_argument("--quick", action="store_true", help="small, fast load (smoke test)")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--servers", type=int)
    p.add_argument("--max-concurrency", type=int)
    p.add_argument("--token-cost-ms", type=float)
    p.add_argument("--short-tokens", type=int)
    p.add_argument("--long-fraction", type=float)
    p.add_argument("--long-factor", type=float)
    p.add_argument("--groups", type=int)
    p.add_argument("--group-size", type=int)
    p.add_argument("--trainer-ratio", type=float)
    p.add_argument("--eta", type=int)
    p.add_argument("--publish-every", type=int)
    p.add_argument("--update-mode", choices=["keep", "wait", "abort"])
    p.add_argument("--admission", choices=["pace", "bound"], help="trainer.admission of fully_async (default pace)")
    p.add_argument("--staleness-level", choices=["group", "token"], help="trainer.staleness_level (default group)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    load = Load(**QUICK) if a.quick else Load()
    lt = load.lengths
    load.lengths = LongTail(short_tokens=a.short_tokens or lt.short_tokens, long_fraction=lt.long_fraction if a.long_fraction is None else a.long_fraction,
                            long_factor=a.long_factor or lt.long_factor, jitter=lt.jitter)
    for key in ("servers", "max_concurrency", "groups", "group_size", "trainer_ratio", "eta", "publish_every", "update_mode", "admission", "staleness_level"):
        if getattr(a, key) is not None:
            setattr(load, key, getattr(a, key))
    if a.token_cost_ms is not None:
        load.token_cost_s = a.token_cost_ms / 1e3
    modes = tuple(m for m in a.modes.split(",") if m)
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        p.error(f"--modes: unknown {unknown}; choose from {MODES}")
    t = time.time()
    return finish(run(load, modes, a.seed), t, a.json, print_table)


if __name__ == "__main__":
    raise SystemExit(main())
