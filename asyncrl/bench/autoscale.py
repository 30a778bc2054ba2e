"""asyncrl bench elastic --autoscale: `rollout.autoscale` on a load whose trainer slows down mid-run.

The run: `asyncrl train configs/demo.yaml` in the embedded mode (servers in the controller's process: the
bench measures the closed loop, not how long this host takes to start server processes, which
`asyncrl bench elastic` measures on Ray), fully_async, cost-model servers (`token_cost_s` per token of
each of up to `max_concurrency` running requests: 100 tokens/s a server) and a cost-model trainer whose
speed `trainer.cost_model_schedule` changes at step `SLOW_AT`:
1. `fast`: the trainer trains `FAST_TOKENS_S` tokens/s, what 2.9 servers generate; the run starts with 1
   server, so the controller has to grow the fleet;
2. `slow`: from step `SLOW_AT` it trains `SLOW_TOKENS_S`, what 1.8 servers generate, so it has to shrink.
The autoscaler's knobs are the defaults but for a shorter window and cooldown (`interval_s` 5, `cooldown_s`
15), so each phase settles in about 40 s.

Figures come from the run's files: each autoscale window is a line of `RUN_DIR/autoscale.jsonl` (time, its
seconds, trainer idle, server slots idle, routed servers, the verdict, the size decided), each change a line
of `fleet_events.jsonl`. Per phase (`phases`): `start_s` / `end_s` (from the run's step-0 row; the slow
phase starts at the time of step `SLOW_AT`'s row), `needed_servers` (its trainer's tokens/s over a server's:
what a perfect split would run), `changes` (autoscale decisions in it, with their time), `settled_s` (the
last change's time plus one window: the controller's own measurement of the new size; the phase's start
when it made none), `servers_settled` (routed in the windows after that), `trainer_idle` / `rollout_idle`
(mean over the windows that begin at or after `settled_s` and end by the phase's end), `windows` (how many).
Targets (issue: "after the controller settles"): in every phase trainer idle <= 0.05 and rollout idle <= 0.2.
About 3 minutes on a 2-core host.

    asyncrl bench elastic --autoscale [--json]
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

TOKEN_COST_S, MAX_CONCURRENCY, TOKENS = 0.02, 2, 64
SERVER_TOKENS_S = MAX_CONCURRENCY / TOKEN_COST_S
FAST_TOKENS_S, SLOW_TOKENS_S = 290.0, 180.0
SLOW_AT, STEPS = 40, 66
INTERVAL_S, COOLDOWN_S = 5.0, 15.0
TRAINER_IDLE_MAX, ROLLOUT_IDLE_MAX = 0.05, 0.2


def overrides(tmp: Path) -> list[str]:
    return [
        "rollout.num_servers=1", "trainer.mode=fully_async", f"trainer.total_steps={STEPS}", "trainer.eval_every=1000",
        "trainer.save_every=0", "trainer.prompts_per_step=2", "rollout.group_size=4", "data.eval_size=2",
        "rollout.backend=cost_model", f"rollout.cost_model.token_cost_s={TOKEN_COST_S}",
        f"rollout.cost_model.max_concurrency={MAX_CONCURRENCY}", f"rollout.cost_model.short_tokens={TOKENS}",
        "rollout.cost_model.long_fraction=0", f"rollout.max_tokens={round(TOKENS * 1.5)}",
        "trainer.engine=cost_model", f"trainer.cost_model_token_s={1.0 / FAST_TOKENS_S:.6f}",
        f"trainer.cost_model_schedule=[[{SLOW_AT},{1.0 / SLOW_TOKENS_S:.6f}]]",
        "agent.reward=asyncrl.bench.planes:random_reward",
        "rollout.autoscale.enabled=true", "rollout.autoscale.min_servers=1", "rollout.autoscale.max_servers=6",
        f"rollout.autoscale.interval_s={INTERVAL_S}", f"rollout.autoscale.cooldown_s={COOLDOWN_S}",
        f"logging.run_root={tmp}/runs", "logging.run_name=autoscale", "logging.mlflow=false", "logging.progress=false",
        f"model.cache_dir={Path('~/.cache/asyncrl/models').expanduser()}",
    ]


# ---- analysis: the run's files -> figures (pure) ---------------------------------------------------
def phase_figures(windows: list[dict[str, Any]], rows: list[dict[str, Any]], slow_at: int = SLOW_AT,
                  interval_s: float = INTERVAL_S) -> list[dict[str, Any]]:
    """The two phases' figures (see the module's text); `windows`: autoscale.jsonl, `rows`: metrics.jsonl."""
    t0 = next((r["time"] for r in rows if r["step"] == 0), None)
    turn = next((r["time"] for r in rows if r["step"] == slow_at), None)
    end = max((r["time"] for r in rows), default=None)
    if t0 is None or end is None:
        return []
    spans = [("fast", FAST_TOKENS_S, t0, turn if turn is not None else end)]
    if turn is not None:
        spans.append(("slow", SLOW_TOKENS_S, turn, end))
    out = []
    for name, tokens_s, a, b in spans:
        inside = [w for w in windows if a <= w["time"] + w["seconds"] and w["time"] < b]
        changes = [(w["time"] + w["seconds"], w["decided"]) for w in inside if w.get("decided") is not None]
        settled = changes[-1][0] + interval_s if changes else a
        measured = [w for w in inside if w["time"] >= settled - 0.5 and w["time"] + w["seconds"] <= b + 0.5]
        mean = lambda k: round(sum(w[k] for w in measured) / len(measured), 3) if measured else None  # noqa: E731
        out.append({
            "phase": name, "start_s": round(a - t0, 1), "end_s": round(b - t0, 1),
            "trainer_tokens_per_s": tokens_s, "needed_servers": round(tokens_s / SERVER_TOKENS_S, 2),
            "changes": [{"t_s": round(t - t0, 1), "to": n} for t, n in changes],
            "settled_s": round(settled - t0, 1), "servers_settled": sorted({w["servers"] for w in measured}),
            "trainer_idle": mean("trainer_idle"), "rollout_idle": mean("rollout_idle"), "windows": len(measured),
        })
    return out


def targets(phases: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    ok = len(phases) == 2 and all(p["windows"] > 0 for p in phases)
    return {
        "trainer_idle_settled": {"target": f"<= {TRAINER_IDLE_MAX} in every phase once settled",
                                 "met": ok and all(p["trainer_idle"] <= TRAINER_IDLE_MAX for p in phases)},
        "rollout_idle_settled": {"target": f"<= {ROLLOUT_IDLE_MAX} in every phase once settled",
                                 "met": ok and all(p["rollout_idle"] <= ROLLOUT_IDLE_MAX for p in phases)},
    }


def _jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


# ---- the run ------------------------------------------------------------------------------------------
def run(timeout_s: float = 600.0) -> dict[str, Any]:
    from asyncrl.bench.cluster import REPO

    tmp = Path(tempfile.mkdtemp(prefix="asyncrl-autoscale-"))
    cmd = [sys.executable, "-m", "asyncrl.cli", "train", "configs/demo.yaml", *overrides(tmp)]
    t = time.time()
    with open(tmp / "autoscale.log", "wb") as log:
        try:
            code = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            code = None
    run_dir = tmp / "runs" / "autoscale"
    windows, rows, events = _jsonl(run_dir / "autoscale.jsonl"), _jsonl(run_dir / "metrics.jsonl"), _jsonl(run_dir / "fleet_events.jsonl")
    phases = phase_figures(windows, rows)
    return {
        "phases": phases, "targets": targets(phases), "completed": code == 0, "exit_code": code,
        "wall_s": round(time.time() - t, 1), "windows": len(windows),
        "fleet_events": [{"t_s": round(e["time"] - rows[0]["time"], 1), "kind": e["kind"], "server": e.get("server")}
                         for e in events] if rows else [],
        "load": {"server_tokens_per_s": SERVER_TOKENS_S, "fast_trainer_tokens_per_s": FAST_TOKENS_S,
                 "slow_trainer_tokens_per_s": SLOW_TOKENS_S, "slow_at_step": SLOW_AT, "steps": STEPS,
                 "interval_s": INTERVAL_S, "cooldown_s": COOLDOWN_S},
        "logs": str(tmp),
    }


def table(res: dict[str, Any]) -> str:
    lines = ["phase  trainer tok/s  needed  changes                 settled_s  servers  trainer_idle  rollout_idle  windows"]
    for p in res["phases"]:
        ch = ", ".join(f"{c['t_s']}s->{c['to']}" for c in p["changes"]) or "-"
        lines.append(f"{p['phase']:<6} {p['trainer_tokens_per_s']:>13.0f}  {p['needed_servers']:>6}  {ch:<22}  {p['settled_s']:>9}  "
                     f"{str(p['servers_settled']):<7}  {p['trainer_idle']!s:>12}  {p['rollout_idle']!s:>12}  {p['windows']:>7}")
    lines.append("targets: " + ", ".join(f"{k} {'met' if v['met'] else 'MISSED'} ({v['target']})" for k, v in res["targets"].items()))
    lines.append(f"completed {res['completed']}, wall {res['wall_s']} s, logs {res['logs']}")
    return "\n".join(lines)
