"""asyncrl bench elastic: a live fully_async run whose rollout fleet goes 4 -> 8 -> 2 -> 6 servers.

The run: `asyncrl train configs/demo.yaml` with `ray.enabled=true`, one trainer rank, a Redis queue (a
real redis-server started here) and per-record shm files, on a Ray cluster of its own
(`asyncrl/bench/cluster.py`), the command line of `asyncrl bench chaos` (`chaos._cmd`) with these
changes. Costs are simulated so the bench measures orchestration, not this machine's CPUs: servers are
`rollout.backend=cost_model` (`token_cost_s` per token of each of up to `max_concurrency` running
requests), the trainer `trainer.engine=cost_model` (the tiny model's real weights are published, a step
sleeps `trainer_token_s` per loss token: 5,000 tokens/s, over 6x the 8 servers' capacity, so the fleet
is the bottleneck in every phase). A phase's capacity is servers * max_concurrency / token_cost_s
tokens/s (`asyncrl bench pipeline`'s `Load`). Phases are timed by wall clock: each change is asked
through `run_control` (what `asyncrl scale RUN --servers N` writes) `phase_s` after the fleet reached
the previous size (routed servers, fleet_events.jsonl; the first phase from the run's step-0 row), so
every phase has the same time at its size however long this host takes to start servers:
1. 4 servers; then `--servers 8` (4 servers join, taking the current weights from a routed peer);
2. 8 servers; then `--servers 2`, and once the controller has taken that request, SIGKILL to two of the
   servers started in step 1 (all above the target: the shrink drains them, so a kill lands mid-drain);
3. 2 servers; then `--servers 6` (4 joins);
4. 6 servers until the run ends: `trainer.total_steps` is what the phases would train at capacity (a
   grow's servers taking `START_S` to start), so the run finishes, uninterrupted, about when the last
   phase's time is up (later by what it trained below capacity, earlier if servers start faster).

Per phase (`phases`): `servers` (the target), `start_s`, `end_s` (from the run's start: the change's
request to the next one; the last phase to the last step but one, whose row waits for the final
evaluation), `seconds_to_size` (from the request to the first fleet event at which that many servers
were routed: for a grow, its servers' processes starting, then joining), `trained_tokens_per_s` (steady
rate: trained tokens, metrics.jsonl `train/tokens` at each step's time, linearly interpolated, over the
phase from `SETTLE_S` after it reached its size), `capacity_tokens_per_s`, `ratio` (rate / capacity),
`seconds_to_new_rate` (from the request to the start of the first `WINDOW_S` window, one every
`STRIDE_S`, whose rate is >= `NEW_RATE` x the phase's steady rate; null if none),
`seconds_to_new_rate_after_start` (a grow: the same from its servers' `start` events, their processes up,
so without what starting processes costs on this host's CPUs; null for a shrink), `publish_s_mean`
(weights/publish_s of the phase's steps), `steps`, `routed_at_end` (fleet/size_main of its last step).
Top level: `joins` (per join event: server, via, `seconds`, `first_sample_s`), `join_seconds` (the join
events' `seconds`: from the server's start to routed; a join via a publish carries none: from its
`start` event to its `join` event), `join_to_first_sample_s` (from the server's
`start` event to the first status.json snapshot, written every second, in which it has generated tokens:
its first sample, late by up to a snapshot's interval; the queue's records name the process that wrote
them, not the server), `joins_by_source` (peer / publish / trainer), `publish_s_during_join` vs
`publish_s_without` (mean weights/publish_s of the steps whose publish overlapped a join window, from a
server's `start` event to the end of the first publish after its `join`, the first that reaches it on
the trainer's plane, vs the steps that overlapped neither that nor a grow's start; a row is logged right
after its publish, so a publish spans [time - publish_s, time]), `publishes_during_join`,
`publish_s_while_starting` (publishes overlapping a grow's request to its `start` events: the new
servers' processes starting on the same host), `kills` (the SIGKILLs sent), `preemptions`, `drains`,
`restarts` (what fleet_events.jsonl recorded), `scale_answers` (the controller's answer to each request),
`lost` (put - trained - dropped - resident, from the Redis queue's counters and trained_uids.jsonl, as
`asyncrl bench chaos` counts it; only for a run that finished), `trained_twice`, `staleness_mean`
(summary.json), `completed` (exit 0, every step trained), `wall_s` (of `asyncrl train`), `logs` (the
run, its log, and `drive.json`: what this process saw), and `targets` {name: {target, met}}:
`rate_within_10s` (each change's `seconds_to_new_rate` <= 10: the issue's target),
`rate_within_10s_of_servers_up` (each grow's `seconds_to_new_rate_after_start` <= 10: not a target, what
the orchestration adds to starting the processes), `join_publish` (publish_s_during_join <=
1.1 * publish_s_without + 0.05 s), `lost` 0, `trained_twice` 0.
The default run takes about 5 minutes on a 2-core host, `--quick` (20 s phases) about 3.

    asyncrl bench elastic [--json] [--quick] [--phase-s 50]
    asyncrl bench elastic --autoscale [--json]     # the closed loop instead: asyncrl/bench/autoscale.py
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
PHASE_S, QUICK_PHASE_S = 50.0, 20.0
SETTLE_S = 5.0
"""Seconds after the fleet reached a phase's size left out of its steady rate (the queue and admission catching up)."""
START_S = 15.0
"""Seconds a grow's servers take to start on this host (measured: 10-22 s for 4 at once): `total_steps` counts them."""
READY_TIMEOUT_S = 90.0
"""A fleet not at its size this long after a change: its phase's clock starts anyway."""
WINDOW_S, STRIDE_S, NEW_RATE = 5.0, 0.5, 0.9
KILLS = 2
POLL_S = 0.25


@dataclass
class Load:
    """The simulated costs: servers (`rollout.cost_model`), responses, batches and the trainer's step."""

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
            total += r.get("train/tokens", 0.0)
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


def seconds_to_size(events: list[dict[str, Any]], change: float, servers: int, fleet: str = "main") -> float | None:
    """From `change` to the first fleet event after it at which `servers` servers were routed."""
    return next((round(e["time"] - change, 1) for e in events if e["time"] >= change and e.get("size", {}).get(fleet) == servers), None)


def phase_figures(rows: list[dict[str, Any]], events: list[dict[str, Any]], changes: list[tuple[int, float]], end: float,
                  load: Load, settle_s: float = SETTLE_S) -> list[dict[str, Any]]:
    """One dict per phase; `changes`: (servers, time it was asked; the first: the run's start, at that size)."""
    curve, t0 = trained_curve([r for r in rows if r["time"] <= end]), changes[0][1]
    out = []
    for i, (servers, start) in enumerate(changes):
        stop = changes[i + 1][1] if i + 1 < len(changes) else end
        sized = 0.0 if i == 0 else seconds_to_size(events, start, servers)
        steady = rate(curve, min(start + (sized or 0.0) + settle_s, stop), stop)
        cap = load.capacity(servers)
        last = i + 1 == len(changes)
        steps = [r for r in rows if r["step"] > 0 and (start <= r["time"] < stop or last and r["time"] == stop)]
        pubs = [r["weights/publish_s"] for r in steps if "weights/publish_s" in r]
        out.append({
            "servers": servers, "start_s": round(start - t0, 1), "end_s": round(stop - t0, 1),
            "trained_tokens_per_s": _round(steady, 1), "capacity_tokens_per_s": round(cap, 1),
            "ratio": _round(steady / cap if steady is not None else None, 3),
            "seconds_to_size": sized,
            "seconds_to_new_rate": seconds_to_rate(curve, start, stop, NEW_RATE * steady) if steady else None,
            "seconds_to_new_rate_after_start": _after_start(curve, events, start, stop, NEW_RATE * steady)
            if steady and i > 0 and servers > changes[i - 1][0] else None,
            "publish_s_mean": _round(_mean(pubs), 4), "steps": len(steps),
            "routed_at_end": int(steps[-1]["fleet/size_main"]) if steps and "fleet/size_main" in steps[-1] else None,
        })
    return out


def _after_start(curve: list[tuple[float, float]], events: list[dict[str, Any]], asked: float, stop: float,
                 target: float) -> float | None:
    """A grow: from its servers' `start` events (their processes up: what this host's CPUs cost is behind
    it) to the new rate, as `seconds_to_new_rate` counts from the request."""
    up = [e["time"] for e in events if e["kind"] == "start" and asked <= e["time"] < stop]
    return seconds_to_rate(curve, max(up), stop, target) if up else None


def _publishes(rows: list[dict[str, Any]]) -> list[tuple[float, float, float]]:
    """(begin, end, publish_s) of each step's publish: its row is logged right after it."""
    return [(r["time"] - r["weights/publish_s"], r["time"], r["weights/publish_s"]) for r in rows if r["step"] > 0 and "weights/publish_s" in r]


def _joins(events: list[dict[str, Any]]) -> list[tuple[float, dict[str, Any]]]:
    """(time of its server's `start` event, the `join` event) per join (a name comes back after a shrink)."""
    starts: dict[str, float] = {}
    out = []
    for e in events:
        if e["kind"] == "start":
            starts[e["server"]] = e["time"]
        elif e["kind"] == "join":
            out.append((starts.pop(e["server"], e["time"] - e.get("seconds", 0.0)), e))
    return out


def join_windows(events: list[dict[str, Any]], rows: list[dict[str, Any]]) -> list[tuple[float, float]]:
    """Per join: from its server's `start` event to the end of the first publish that began after its `join`."""
    pubs = _publishes(rows)
    return [(begin, next((b for a, b, _ in pubs if a >= e["time"]), e["time"])) for begin, e in _joins(events)]


def start_windows(events: list[dict[str, Any]], changes: list[tuple[int, float]]) -> list[tuple[float, float]]:
    """Per grow: from its request to its servers' `start` events (their processes starting, nothing joined yet)."""
    out = []
    for (before, _), (servers, asked) in zip(changes, changes[1:]):
        if servers > before:
            out.append((asked, next((e["time"] for e in events if e["kind"] == "start" and e["time"] >= asked), asked)))
    return out


def publish_split(rows: list[dict[str, Any]], windows: dict[str, list[tuple[float, float]]]) -> dict[str, list[float]]:
    """weights/publish_s of the steps whose publish overlapped a window of each kind (the first kind that
    matches), and of the others (`without`)."""
    out: dict[str, list[float]] = {k: [] for k in [*windows, "without"]}
    for a, b, s in _publishes(rows):
        kind = next((k for k, ws in windows.items() if any(a <= we and b >= wb for wb, we in ws)), "without")
        out[kind].append(s)
    return out


def join_records(events: list[dict[str, Any]], snapshots: list[tuple[float, dict[str, int]]]) -> list[dict[str, Any]]:
    """Per `join` event: its server, source, `seconds`, and `first_sample_s` (from the server's `start` event
    to the first status snapshot after it listing the server with generated tokens; None if none did)."""
    out = []
    for begin, e in _joins(events):
        first = next((t for t, tokens in snapshots if t > begin and tokens.get(e["server"], 0) > 0), None)
        seconds = e["seconds"] if "seconds" in e else round(e["time"] - begin, 3)  # a join via a publish says none
        out.append({"server": e["server"], "via": e.get("via"), "seconds": seconds,
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
    ups = [p["seconds_to_new_rate_after_start"] for p, (a, b) in zip(res["phases"][1:], zip(SIZES, SIZES[1:])) if b > a]
    return {
        "rate_within_10s": {"target": "seconds_to_new_rate <= 10 after each change",
                            "met": len(changes) == len(SIZES) - 1 and all(s is not None and s <= 10 for s in changes)},
        "rate_within_10s_of_servers_up": {"target": "seconds_to_new_rate_after_start <= 10 after each grow (not the issue's)",
                                          "met": bool(ups) and all(s is not None and s <= 10 for s in ups)},
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


# ---- the run ------------------------------------------------------------------------------------------
def total_steps(phase_s: float, load: Load) -> int:
    """What the phases would train at capacity, each grow's servers starting for `START_S` at the old size
    first: the run ends soon after the last phase's planned end (later where it trains below capacity)."""
    starts = sum(START_S * load.capacity(a) for a, b in zip(SIZES, SIZES[1:]) if b > a)
    return math.ceil((sum(phase_s * load.capacity(n) for n in SIZES) + starts) / load.tokens_per_step)


def _run_start(run: Path) -> float | None:
    """The time of the run's step-0 row (version 0 published, first evaluation done: rollouts start)."""
    try:
        with (run / "metrics.jsonl").open() as f:
            line = f.readline()
        return json.loads(line)["time"] if line.endswith("\n") else None
    except (OSError, ValueError, KeyError):
        return None


def _status(run: Path) -> tuple[float, dict[str, int]] | None:
    """(snapshot time, generated tokens per server of fleet main) from status.json, if it is a run's snapshot."""
    try:
        snap = json.loads((run / "status.json").read_text())
        return snap["time"], {s["name"]: int(s["generated_tokens"]) for s in snap["fleets"]["main"]["servers"]}
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _drive(cmd: list[str], run: Path, env: dict[str, str], cluster: int, phase_s: float, log: Any,
           timeout_s: float, rng: random.Random) -> dict[str, Any]:
    """Run `asyncrl train`, change the fleet's size on schedule, kill servers after the shrink is taken."""
    from asyncrl import run_control
    from asyncrl.bench.chaos import _descendants
    from asyncrl.bench.cluster import REPO

    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env, cwd=REPO)
    launched = time.time()
    changes: list[tuple[int, float]] = []
    requests: list[Any] = []
    snapshots: list[tuple[float, dict[str, int]]] = []
    kills: list[dict[str, Any]] = []
    initial: set[int] = set()
    ready: float | None = None  # when the fleet reached the last change's size
    shrink: Any = None  # a shrink request the controller has not taken yet: the kills follow it
    timed_out = False
    try:
        while proc.poll() is None:
            if time.time() - launched > timeout_s:
                proc.send_signal(signal.SIGUSR1)  # every task's stack into the log
                time.sleep(2)
                timed_out = True
                break
            time.sleep(POLL_S)
            if not changes:
                t0 = _run_start(run)
                if t0 is not None:
                    changes.append((SIZES[0], t0))
                    ready = t0
                continue
            snap = _status(run)
            if snap is not None and (not snapshots or snap[0] > snapshots[-1][0]):
                snapshots.append(snap)
            k = len(changes)
            if ready is None:  # the fleet at the last change's size: its phase's clock starts
                servers, asked = changes[-1]
                sized = seconds_to_size(_jsonl(run / "fleet_events.jsonl"), asked, servers)
                if sized is not None:
                    ready = asked + sized
                elif time.time() - asked > READY_TIMEOUT_S:
                    ready = time.time()
            if k < len(SIZES) and ready is not None and time.time() >= ready + phase_s:
                if k == 1:
                    initial = {p.pid for p in _descendants(cluster, "ray::ServerActor")}
                req = run_control.new_request("main", servers=SIZES[k])
                run_control.write(run, req)
                changes.append((SIZES[k], req.time))
                requests.append(req)
                ready = None
                shrink = req if SIZES[k] < SIZES[k - 1] else shrink
            if shrink is not None and not any((run / run_control.CONTROL_DIR).glob(f"*{shrink.id}.request")):
                above = [p for p in _descendants(cluster, "ray::ServerActor") if p.pid not in initial]  # started by the grow: drained
                for p in rng.sample(above, min(KILLS, len(above))):
                    p.send_signal(signal.SIGKILL)
                    kills.append({"pid": p.pid, "t_s": round(time.time() - changes[0][1], 1)})
                shrink = None
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    answers = [run_control.read_answer(run, r.id) or {"id": r.id, "ok": None, "error": "no answer"} for r in requests]
    return {"code": proc.returncode, "timed_out": timed_out, "changes": changes, "snapshots": snapshots, "kills": kills,
            "answers": [{"servers": r.servers, **a} for r, a in zip(requests, answers)], "wall_s": round(time.time() - launched, 1)}


def run(phase_s: float = PHASE_S, seed: int = 0, load: Load | None = None) -> dict[str, Any]:
    from asyncrl.bench.chaos import _cmd, accounting
    from asyncrl.bench.cluster import ray_head
    from asyncrl.bench.redis_tools import REDIS_URL_ENV, redis_server

    load = load or Load()
    name, steps = "elastic", total_steps(phase_s, load)
    tmp = Path(tempfile.mkdtemp(prefix="asyncrl-elastic-"))
    (tmp / "shm").mkdir()
    run_dir = tmp / "runs" / name
    redis, url = redis_server(str(tmp))
    try:
        with ray_head(num_cpus=5) as (address, env, cluster), open(tmp / f"{name}.log", "ab") as log:
            env = {**env, REDIS_URL_ENV[0]: url}  # chaos._cmd reads the URL, password and all, from it
            cmd = _cmd(tmp, url, address, steps, False, name, *load.overrides(SIZES[0]), max_tokens=round(load.tokens * 1.5))
            drive = _drive(cmd, run_dir, env, cluster, phase_s, log, timeout_s=len(SIZES) * phase_s * 2 + 300, rng=random.Random(seed))
        (tmp / "drive.json").write_text(json.dumps(drive))  # what the run's files do not say, for a second look
        acc = accounting(url, name, run_dir, drive["code"])
    finally:
        redis.kill()
        redis.wait()
    rows, events = _jsonl(run_dir / "metrics.jsonl"), _jsonl(run_dir / "fleet_events.jsonl")
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").exists() else {}
    return report(rows, events, summary, drive, acc, load, steps, str(tmp))


def report(rows: list[dict[str, Any]], events: list[dict[str, Any]], summary: dict[str, Any], drive: dict[str, Any],
           acc: dict[str, Any], load: Load, steps: int, logs: str) -> dict[str, Any]:
    """The bench's figures from the run's files and what `_drive` saw."""
    # the last step's row waits for the final evaluation (queued behind the servers' backlog): not a rate
    end = max((r["time"] for r in rows if 0 < r["step"] < steps), default=0.0)
    phases = phase_figures(rows, events, drive["changes"], end, load) if drive["changes"] and end else []
    joins = join_records(events, drive["snapshots"])
    pubs = publish_split(rows, {"join": join_windows(events, rows), "starting": start_windows(events, drive["changes"])})
    res: dict[str, Any] = {
        "phases": phases, "joins": joins,
        "join_seconds": [j["seconds"] for j in joins], "join_to_first_sample_s": [j["first_sample_s"] for j in joins],
        **event_counts(events),
        "publish_s_during_join": _round(_mean(pubs["join"]), 4), "publish_s_without": _round(_mean(pubs["without"]), 4),
        "publishes_during_join": len(pubs["join"]), "publish_s_while_starting": _round(_mean(pubs["starting"]), 4),
        "kills": drive["kills"], "scale_answers": drive["answers"],
        "lost": acc["lost"], "trained_twice": acc["trained_twice"], "accounting": acc,
        "staleness_mean": summary.get("staleness_mean"), "drops": summary.get("drops"), "failover": summary.get("failover"),
        "completed": drive["code"] == 0 and summary.get("steps") == steps and acc["last_step"] == steps,
        "exit_code": drive["code"], "timed_out": drive["timed_out"], "total_steps": steps, "wall_s": drive["wall_s"],
        "load": {**load.__dict__, "trainer_capacity_tokens_per_s": round(1 / load.trainer_token_s)}, "logs": logs,
    }
    res["targets"] = targets(res)
    return res


def _table(res: dict[str, Any]) -> str:
    lines = [f"{'servers':>7} {'start s':>7} {'end s':>6} {'tokens/s':>9} {'capacity':>8} {'ratio':>6} {'to size s':>9} "
             f"{'to rate s':>9} {'publish s':>9} {'routed':>6}"]
    for p in res["phases"]:
        lines.append(f"{p['servers']:>7} {p['start_s']:>7} {p['end_s']:>6} {p['trained_tokens_per_s']!s:>9} {p['capacity_tokens_per_s']:>8} "
                     f"{p['ratio']!s:>6} {p['seconds_to_size']!s:>9} {p['seconds_to_new_rate']!s:>9} {p['publish_s_mean']!s:>9} "
                     f"{p['routed_at_end']!s:>6}")
    for k in ("join_seconds", "join_to_first_sample_s", "joins_by_source", "publish_s_during_join", "publish_s_without",
              "publishes_during_join", "publish_s_while_starting", "kills", "preemptions", "drains", "lost", "trained_twice", "staleness_mean",
              "completed", "wall_s", "logs"):
        lines.append(f"{k:24} {res[k]}")
    for a in res["scale_answers"]:
        lines.append(f"scale to {a['servers']}: {'ok' if a.get('ok') else 'NOT ok: ' + str(a.get('error'))}")
    for name, t in res["targets"].items():
        lines.append(f"target {name} ({t['target']}): {'met' if t['met'] else 'NOT met' if t['met'] is False else 'not measured'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="asyncrl bench elastic", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--quick", action="store_true", help=f"{QUICK_PHASE_S:g} s phases")
    p.add_argument("--phase-s", type=float, default=PHASE_S, help=f"seconds per phase (default {PHASE_S:g})")
    p.add_argument("--seed", type=int, default=0, help="which servers are killed")
    p.add_argument("--autoscale", action="store_true",
                   help="instead: rollout.autoscale on a load whose trainer slows mid-run (asyncrl/bench/autoscale.py)")
    a = p.parse_args(argv)
    if a.autoscale:
        from asyncrl.bench import autoscale

        res = autoscale.run()
        print(json.dumps(res, indent=1) if a.json else autoscale.table(res))
        return 0
    res = run(QUICK_PHASE_S if a.quick else a.phase_s, a.seed)
    print(json.dumps(res, indent=1) if a.json else _table(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
