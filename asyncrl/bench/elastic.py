"""asyncrl bench elastic: a live fully_async run whose rollout fleet goes 4 -> 8 -> 2 -> 6 servers.

The run: `asyncrl train configs/demo.yaml` with `ray.enabled=true`, one trainer rank, a Redis queue (a
real redis-server started here) and per-record shm files, on a Ray cluster of its own
(`asyncrl/bench/cluster.py`), the command line of `asyncrl bench chaos` (`chaos._cmd`) with these
changes. Costs are simulated so the bench measures orchestration, not this machine's CPUs: servers are
`rollout.backend=cost_model` (`token_cost_s` per token of each of up to `max_concurrency` running
requests), the trainer `trainer.engine=cost_model` (the tiny model's real weights are published, a step
sleeps `trainer_token_s` per loss token: 5,000 tokens/s, over 6x the 8 servers' capacity, so the fleet
is the bottleneck in every phase). A phase's capacity is servers * max_concurrency / token_cost_s
tokens/s (`asyncrl bench pipeline`'s `Load`). Phases are timed by wall clock from the run's start (its
step-0 row) and changed through `run_control` (what `asyncrl scale RUN --servers N` writes):
1. 4 servers; then `--servers 8` (4 servers join, taking the current weights from a routed peer);
2. 8 servers; then `--servers 2`, and once the controller has taken that request, SIGKILL to two of the
   servers started in step 1 (all above the target: the shrink drains them, so a kill lands mid-drain);
3. 2 servers; then `--servers 6` (4 joins);
4. 6 servers until the run ends: `trainer.total_steps` is what the phases would train at capacity, so
   the run finishes (no interrupt) shortly after the last phase's planned length.

Per phase (`phases`): `servers` (the target), `start_s`, `end_s` (from the run's start: the change's
request to the next one, or the last step), `trained_tokens_per_s` (steady rate: trained tokens, from
metrics.jsonl `train/tokens` at each step's time, linearly interpolated, over [start + `SETTLE_S`, end]),
`capacity_tokens_per_s`, `ratio` (rate / capacity), `seconds_to_new_rate` (from the change to the start
of the first `WINDOW_S` window, windows every `STRIDE_S`, whose rate is >= `NEW_RATE` x the steady rate;
null if none), `publish_s_mean` (weights/publish_s of the phase's steps), `routed_at_end`
(fleet/size_main of its last step).
Top level: `joins` (per join: server, via, `seconds` of the join event, `first_sample_s`),
`join_seconds` (the join events' `seconds`: start of the join to routed), `join_to_first_sample_s` (from
the server's `start` event to the first status.json snapshot, written every second, in which that server
has generated tokens: its first sample, late by at most a snapshot interval; the queue records name
the writing process, not the server), `joins_by_source` (peer / publish / trainer), `publish_s_during_join`
vs `publish_s_without` (mean weights/publish_s of the steps whose publish overlapped a join window, from
a server's `start` event to the end of the first publish after its `join`, the first that reaches it on
the trainer's plane; a row is logged right after its publish, so a publish spans [time - publish_s,
time]; `publishes_during_join` counts them), `kills` (the SIGKILLs sent), `preemptions` and `drains`
(fleet_events.jsonl: what the fleet recorded), `scale_answers` (the controller's answer to each request),
`lost` (put - trained - dropped - resident, from the Redis queue's counters and trained_uids.jsonl, as
`asyncrl bench chaos` counts it; only for a run that finished), `trained_twice`, `staleness_mean`
(summary.json), `completed` (exit 0 and every step trained), `wall_s`, `logs`, `targets` {name:
{target, met}}: `rate_within_10s` (each change's `seconds_to_new_rate` <= 10), `join_publish`
(publish_s_during_join <= 1.1 * publish_s_without + 0.05 s), `lost` 0, `trained_twice` 0.
The default run takes about 5 minutes here, `--quick` (25 s phases) about 3.

    asyncrl bench elastic [--json] [--quick] [--phase-s 50]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SIZES = (4, 8, 2, 6)
"""The fleet's target in each phase (the first is `rollout.num_servers`)."""
PHASE_S, QUICK_PHASE_S = 50.0, 25.0
SETTLE_S = 10.0
"""Seconds after a change left out of its phase's steady rate (spawning, joining, draining)."""
WINDOW_S, STRIDE_S, NEW_RATE = 5.0, 0.5, 0.9
KILLS = 2
POLL_S = 0.25


@dataclass
class Load:
    token_cost_s: float = 0.02
    max_concurrency: int = 2
    tokens: int = 64
    """Mean response length (rollout.cost_model.short_tokens, jitter 0.25, no long tail)."""
    groups: int = 2
    """trainer.prompts_per_step."""
    group_size: int = 4
    trainer_token_s: float = 0.0002

    def capacity(self, servers: int) -> float:
        return servers * self.max_concurrency / self.token_cost_s

    @property
    def tokens_per_step(self) -> int:
        return self.groups * self.group_size * self.tokens

    def overrides(self, servers: int) -> list[str]:
        return [
            "trainer.num_ranks=1", f"rollout.num_servers={servers}", "ray.detached=false", "trainer.save_every=25",
            f"trainer.prompts_per_step={self.groups}", f"rollout.group_size={self.group_size}", "data.eval_size=2",
            "rollout.backend=cost_model", f"rollout.cost_model.token_cost_s={self.token_cost_s}",
            f"rollout.cost_model.max_concurrency={self.max_concurrency}", f"rollout.cost_model.short_tokens={self.tokens}",
            "rollout.cost_model.long_fraction=0", "rollout.cpus_per_server=0.25",
            "trainer.engine=cost_model", f"trainer.cost_model_token_s={self.trainer_token_s}",
            "agent.reward=asyncrl.bench.planes:random_reward",
            f"model.cache_dir={Path('~/.cache/asyncrl/models').expanduser()}",
        ]


# ---- analysis: rows of the run's files -> figures (pure) ------------------------------------------
def trained_curve(rows: list[dict[str, Any]]) -> list[tuple[float, float]]:
    """(time, trained tokens so far) at the run's start (the step-0 row) and after each step.

    >>> trained_curve([{"step": 0, "time": 10.0}, {"step": 1, "time": 12.0, "train/tokens": 500.0}])
    [(10.0, 0.0), (12.0, 500.0)]
    """
    out, total = [], 0.0
    for r in rows:
        if r["step"] == 0 or "train/tokens" in r:
            total += r.get("train/tokens", 0.0) if r["step"] > 0 else 0.0
            out.append((r["time"], total))
    return out


def tokens_at(curve: list[tuple[float, float]], t: float) -> float:
    """Trained tokens at time `t`, linear between two steps (clamped to the curve's ends)."""
    if t <= curve[0][0]:
        return curve[0][1]
    for (t0, c0), (t1, c1) in zip(curve, curve[1:]):
        if t <= t1:
            return c0 + (c1 - c0) * (t - t0) / (t1 - t0) if t1 > t0 else c1
    return curve[-1][1]


def rate(curve: list[tuple[float, float]], a: float, b: float) -> float | None:
    """Trained tokens/s over [a, b]; None unless the curve covers it."""
    if not curve or b <= a or a < curve[0][0] or b > curve[-1][0] + 1e-9:
        return None
    return (tokens_at(curve, b) - tokens_at(curve, a)) / (b - a)


def seconds_to_rate(curve: list[tuple[float, float]], change: float, end: float, target: float) -> float | None:
    """From `change` to the start of the first `WINDOW_S` window (every `STRIDE_S`) whose rate is >= `target`."""
    k = 0
    while change + k * STRIDE_S + WINDOW_S <= end + 1e-9:
        got = rate(curve, change + k * STRIDE_S, change + k * STRIDE_S + WINDOW_S)
        if got is not None and got >= target:
            return round(k * STRIDE_S, 1)
        k += 1
    return None


def phase_figures(rows: list[dict[str, Any]], changes: list[tuple[int, float]], end: float, load: Load,
                  settle_s: float = SETTLE_S) -> list[dict[str, Any]]:
    """One dict per phase; `changes`: (servers, time it was asked; the first: the run's start)."""
    curve, t0 = trained_curve(rows), changes[0][1]
    out = []
    for i, (servers, start) in enumerate(changes):
        stop = changes[i + 1][1] if i + 1 < len(changes) else end
        steady = rate(curve, min(start + settle_s, stop), stop)
        cap = load.capacity(servers)
        steps = [r for r in rows if r["step"] > 0 and start <= r["time"] < stop + (1e-9 if i + 1 == len(changes) else 0)]
        pubs = [r["weights/publish_s"] for r in steps if "weights/publish_s" in r]
        out.append({
            "servers": servers, "start_s": round(start - t0, 1), "end_s": round(stop - t0, 1),
            "trained_tokens_per_s": _round(steady, 1), "capacity_tokens_per_s": round(cap, 1),
            "ratio": _round(steady / cap if steady is not None else None, 3),
            "seconds_to_new_rate": seconds_to_rate(curve, start, stop, NEW_RATE * steady) if steady else None,
            "publish_s_mean": _round(_mean(pubs), 4), "steps": len(steps),
            "routed_at_end": int(steps[-1]["fleet/size_main"]) if steps and "fleet/size_main" in steps[-1] else None,
        })
    return out


def join_windows(events: list[dict[str, Any]], rows: list[dict[str, Any]]) -> list[tuple[float, float]]:
    """Per join: from its server's `start` event to the end of the first publish that began after its `join`."""
    pubs = [(r["time"] - r["weights/publish_s"], r["time"]) for r in rows if r["step"] > 0 and "weights/publish_s" in r]
    starts: dict[str, float] = {}
    out = []
    for e in events:
        if e["kind"] == "start":
            starts[e["server"]] = e["time"]
        elif e["kind"] == "join":
            begin = starts.pop(e["server"], e["time"] - e.get("seconds", 0.0))
            out.append((begin, next((b for a, b in pubs if a >= e["time"]), e["time"])))
    return out


def publish_split(rows: list[dict[str, Any]], windows: list[tuple[float, float]]) -> tuple[list[float], list[float]]:
    """weights/publish_s of the steps whose publish overlapped a join window, and of the others."""
    during, without = [], []
    for r in rows:
        if r["step"] == 0 or "weights/publish_s" not in r:
            continue
        a, b = r["time"] - r["weights/publish_s"], r["time"]
        (during if any(a <= we and b >= ws for ws, we in windows) else without).append(r["weights/publish_s"])
    return during, without


def join_records(events: list[dict[str, Any]], snapshots: list[tuple[float, dict[str, int]]]) -> list[dict[str, Any]]:
    """Per `join` event: its server, source, `seconds`, and `first_sample_s` (from the server's `start` event
    to the first status snapshot after it listing the server with generated tokens; None if none did)."""
    starts: dict[str, float] = {}
    out = []
    for e in events:
        if e["kind"] == "start":
            starts[e["server"]] = e["time"]
        elif e["kind"] == "join":
            begin = starts.pop(e["server"], e["time"] - e.get("seconds", 0.0))
            first = next((t for t, tokens in snapshots if t > begin and tokens.get(e["server"], 0) > 0), None)
            out.append({"server": e["server"], "via": e.get("via"), "seconds": e.get("seconds"),
                        "first_sample_s": round(first - begin, 2) if first is not None else None})
    return out


def event_counts(events: list[dict[str, Any]]) -> dict[str, Any]:
    preempts = [e for e in events if e["kind"] == "preempt"]
    by_source: dict[str, int] = {"peer": 0, "publish": 0, "trainer": 0}
    for e in events:
        if e["kind"] == "join":
            by_source[e.get("via", "?")] = by_source.get(e.get("via", "?"), 0) + 1
    return {"joins_by_source": by_source, "drains": sum(e["kind"] == "drain" for e in events),
            "preemptions": {"total": len(preempts), "replaced": sum(bool(e.get("replaced")) for e in preempts)},
            "restarts": sum(e["kind"] == "restart" for e in events)}


def targets(res: dict[str, Any]) -> dict[str, dict[str, Any]]:
    changes = [p["seconds_to_new_rate"] for p in res["phases"][1:]]
    during, without = res["publish_s_during_join"], res["publish_s_without"]
    return {
        "rate_within_10s": {"target": "seconds_to_new_rate <= 10 after each change",
                            "met": len(changes) == len(SIZES) - 1 and all(s is not None and s <= 10 for s in changes)},
        "join_publish": {"target": "publish_s_during_join <= 1.1 * publish_s_without + 0.05",
                         "met": None if during is None or without is None else during <= 1.1 * without + 0.05},
        "lost": {"target": 0, "met": res["lost"] == 0},
        "trained_twice": {"target": 0, "met": res["trained_twice"] == 0},
    }


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def _round(x: float | None, n: int) -> float | None:
    return None if x is None else round(x, n)


def _jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
