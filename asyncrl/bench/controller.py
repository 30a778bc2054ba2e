"""`asyncrl bench controller`: the controller's CPU per trajectory, and its trajectories/s, as the fleet and the group grow.

Job: run the real `asyncrl train` on simulated backends (`rollout.backend=cost_model`,
`trainer.engine=cost_model` at 0 s per token), so that generation and training cost sleeps, not CPU,
and what the `asyncrl train` process burns is the controller's own work: admission, routing, the
queue, publishes, metrics, status snapshots. Boundary: it only sets config keys and reads what a run
writes and what the kernel counted for its process; it knows nothing of the controller's internals.

Method, per case (servers N, group G):
- two runs as subprocesses, a short one (S1 steps) and a long one (S2 > S1), the same otherwise;
  `trainer.prompts_per_step` = 256 / G, so every step trains about 256 trajectories whatever G;
- a run's controller CPU is the user + system time of the `asyncrl train` process itself, read exactly
  once it has exited: the bench waits for the exit with `waitid(..., WNOWAIT)`, which leaves the
  process a zombie, reads utime + stime from `/proc/<pid>/stat` (the whole thread group; its children's
  times are separate fields, left out: in Ray mode raylet and the actors are children), then reaps it;
- `controller_cpu_ms_per_trajectory` = (cpu_long - cpu_short) / (trajectories_long - trajectories_short)
  x 1000, trajectories being `trained_samples` of each run's `summary.json`: the difference cancels
  start-up and shutdown (imports, model build, Ray's start), which both runs pay once;
- `trajectories_per_s` = the long run's trajectories over its loop seconds: from the `metrics.jsonl` row
  of step 0 (written once the fleet is up, the weights published and the first evaluation done) to the row
  of the last step, so no start-up is in it. (Until 2026-12-07 17:30 the difference of both runs'
  trajectories over the difference of their loop seconds: with `--quick`'s loops of tenths of a second it
  came out negative under load.) Not `summary.json`'s `wall_s`: that clock starts before the fleet does
  (Ray actors: about 30 s for 16 servers on 2 cores); it is kept in each run's figures (`summary_wall_s`).
  `wall_s` of a row is the long run's loop seconds;
- `samples_in_flight_max`: the most of `admission/in_flight_queued` x G over the steps of both runs
  (`metrics.jsonl`, at each step's end): samples of the groups in generation or queued and not yet taken
  by the trainer, as the admission counts them. It is the same in both modes; the status snapshot's
  `fleets.*.in_flight` is not: in Ray mode a server actor runs whole samples and its proxy counts only
  the controller's own `generate` calls (0);
- `event_loop_lag_ms`: the controller's event-loop lag (how late it runs what is due: `observe/loop_lag.py`),
  the mean over the long run's steps of its per-step mean (`controller/loop_lag_ms_mean` in `metrics.jsonl`),
  and `event_loop_lag_ms_max` the most over its steps. Null when the run did not log it.

`flat_ratio_group8` is max / min of the CPU per trajectory over the server counts at group 8: how far
the controller's cost per trajectory is from flat as the fleet grows (target: within 1.2). The target
for the cost itself is 0.05 ms per trajectory (`TARGET_CPU_MS`). `--ray` puts the servers and the
trainer in Ray actor processes (`ray.enabled=true`), so the process measured is the controller alone;
embedded (the default), the cost-model servers share its process and their bookkeeping counts too.

    asyncrl bench controller [--json] [--quick] [--servers 4,16,64] [--groups 1,8] [--ray]
                             [--steps S1,S2] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

TARGET_CPU_MS = 0.05
"""Controller CPU per trajectory the issue asks for (ms)."""
TRAJECTORIES_PER_STEP = 256
QUICK: dict[str, tuple[int, ...]] = {"servers": (4,), "groups": (8,), "steps": (2, 6)}
RUN_TIMEOUT_S = 480
COMMON = (
    "rollout.backend=cost_model", "trainer.engine=cost_model", "trainer.cost_model_token_s=0",
    "rollout.cost_model.token_cost_s=0.00002", "rollout.cost_model.short_tokens=20", "rollout.cost_model.long_fraction=0",
    "rollout.cost_model.max_concurrency=64", "logging.mlflow=false", "logging.progress=false", "data.eval_size=4",
    "trainer.eval_every=1000",
)
"""Every run: simulated servers and trainer that cost no CPU, no MLflow, no progress lines, no evaluation but
the first and the last."""


def _cpu_s(pid: int) -> float:
    """User + system seconds of `pid`'s thread group from `/proc/<pid>/stat` (its children's fields left out)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _loop(run: Path, group: int) -> tuple[float, int, float | None, float | None]:
    """From a run's `metrics.jsonl`: seconds from its step-0 row (written after the start-up and the first
    evaluation) to its last step's row, the most samples in flight or queued at a step's end, and the event
    loop's lag in ms (the mean of the steps' means, the most of their maxima; None where not logged)."""
    rows = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    times = [r["time"] for r in rows]
    groups = max((r["admission/in_flight_queued"] for r in rows if "admission/in_flight_queued" in r), default=0)
    means = [r["controller/loop_lag_ms_mean"] for r in rows if "controller/loop_lag_ms_mean" in r]
    maxima = [r["controller/loop_lag_ms_max"] for r in rows if "controller/loop_lag_ms_max" in r]
    lag = round(sum(means) / len(means), 3) if means else None
    return max(times) - min(times), int(groups) * group, lag, (max(maxima) if maxima else None)


def _failed(name: str, why: str, cmd: list[str], log: Path) -> RuntimeError:
    tail = "\n".join(log.read_text(errors="replace").strip().splitlines()[-20:])
    return RuntimeError(f"asyncrl bench controller: run {name} failed ({why}):\n  {' '.join(cmd)}\n{tail}")


def train_once(servers: int, group: int, steps: int, ray: bool, root: Path, name: str) -> dict[str, Any]:
    """One `asyncrl train` run: its trajectories, loop seconds, the process's own CPU seconds, the most samples in flight.

    Raises RuntimeError with the command and the run's last output lines when it exits non-zero or
    runs past `RUN_TIMEOUT_S` (then it is stopped: SIGTERM, which lets it stop its Ray, then SIGKILL).
    """
    cmd = [sys.executable, "-m", "asyncrl.cli", "train", *COMMON, f"rollout.num_servers={servers}",
           f"rollout.group_size={group}", f"trainer.prompts_per_step={max(1, TRAJECTORIES_PER_STEP // group)}",
           f"trainer.total_steps={steps}", f"logging.run_root={root}", f"logging.run_name={name}",
           *(("ray.enabled=true",) if ray else ())]
    log = root / f"{name}.log"
    run = root / name
    t0 = time.monotonic()
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=root, env=os.environ.copy())
    while os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT | os.WNOHANG) is None:
        if time.monotonic() - t0 > RUN_TIMEOUT_S:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            raise _failed(name, f"stopped after {RUN_TIMEOUT_S} s", cmd, log)
        time.sleep(0.1)
    cpu = _cpu_s(proc.pid)  # a zombie now: the exited process's own times, before the reap
    rc = proc.wait()
    if rc != 0 or not (run / "summary.json").exists():
        raise _failed(name, f"exit {rc}", cmd, log)
    summary = json.loads((run / "summary.json").read_text())
    loop_s, in_flight, lag, lag_max = _loop(run, group)
    return {"name": name, "servers": servers, "group": group, "steps": summary["steps"],
            "trajectories": int(summary["trained_samples"]), "loop_s": round(loop_s, 3),
            "summary_wall_s": float(summary["wall_s"]), "cpu_s": cpu, "process_s": round(time.monotonic() - t0, 2),
            "samples_in_flight_max": in_flight, "event_loop_lag_ms": lag, "event_loop_lag_ms_max": lag_max}


def case_row(short: dict[str, Any], long: dict[str, Any]) -> dict[str, Any]:
    """One row from a case's short and long run: the differences of the module docstring.

    >>> s = {"servers": 4, "group": 8, "trajectories": 512, "loop_s": 0.5, "cpu_s": 4.0, "samples_in_flight_max": 70}
    >>> r = case_row(s, {**s, "trajectories": 1536, "loop_s": 1.5, "cpu_s": 4.5, "samples_in_flight_max": 90})
    >>> r["trajectories"], r["trajectories_per_s"], round(r["controller_cpu_ms_per_trajectory"], 4), r["samples_in_flight_max"]
    (1024, 1024.0, 0.4883, 90)
    """
    traj = long["trajectories"] - short["trajectories"]
    if traj <= 0:
        raise RuntimeError(f"asyncrl bench controller: the long run trained {long['trajectories']} trajectories, the short "
                           f"one {short['trajectories']}: give --steps S1,S2 with S2 > S1")
    wall = long["loop_s"]  # the loop's seconds start after the start-up already: no difference needed, and a
    # difference of two short loops (--quick: 2 and 6 steps, tenths of a second) came out negative under load
    return {"servers": short["servers"], "group": short["group"], "trajectories": traj,
            "trajectories_per_s": long["trajectories"] / wall,
            "controller_cpu_ms_per_trajectory": (long["cpu_s"] - short["cpu_s"]) / traj * 1000,
            "samples_in_flight_max": max(short["samples_in_flight_max"], long["samples_in_flight_max"]),
            "event_loop_lag_ms": long.get("event_loop_lag_ms"), "event_loop_lag_ms_max": long.get("event_loop_lag_ms_max"),
            "wall_s": round(wall, 2)}


def flat_ratio(rows: list[dict[str, Any]], group: int = 8) -> float | None:
    """max / min of the CPU per trajectory over the server counts at `group` (None: fewer than 2 counts, or a min <= 0)."""
    cpu = [r["controller_cpu_ms_per_trajectory"] for r in rows if r["group"] == group]
    return max(cpu) / min(cpu) if len(cpu) >= 2 and min(cpu) > 0 else None


def run(servers: list[int], groups: list[int], steps: tuple[int, int], ray: bool, log: Any = None) -> dict[str, Any]:
    """Every case, its two runs one after another (the machine's cores are the runs' own)."""
    s1, s2 = steps
    if not 0 < s1 < s2:
        raise SystemExit(f"asyncrl bench controller: --steps S1,S2 needs 0 < S1 < S2, got {s1},{s2}")
    rows, runs = [], []
    with tempfile.TemporaryDirectory(prefix="asyncrl-bench-controller-") as tmp:
        for g in groups:
            for n in servers:
                pair = [train_once(n, g, s, ray, Path(tmp), f"n{n}-g{g}-s{s}") for s in (s1, s2)]
                runs += pair
                rows.append(case_row(*pair))
                if log:
                    r = rows[-1]
                    print(f"  {n} servers, group {g}: {r['controller_cpu_ms_per_trajectory']:.4f} ms/trajectory, "
                          f"{r['trajectories_per_s']:.0f} trajectories/s", file=log, flush=True)
    return {"rows": rows, "target_cpu_ms_per_trajectory": TARGET_CPU_MS, "flat_ratio_group8": flat_ratio(rows),
            "cores": os.cpu_count(), "mode": "ray" if ray else "embedded", "steps": [s1, s2],
            "trajectories_per_step": TRAJECTORIES_PER_STEP, "runs": runs}


def table(res: dict[str, Any]) -> str:
    """The rows as a markdown table (what docs/benchmarks.md holds), each row against the target, then the flatness."""
    head = ("| servers | group | trajectories | trajectories/s | controller CPU ms / trajectory | x target "
            "| samples in flight (max) | event-loop lag ms (mean / max) | wall s |")
    lines = [f"mode {res['mode']}, {res['cores']} cores, steps {res['steps'][0]} and {res['steps'][1]}", "",
             head, "|" + "---|" * (head.count("|") - 1)]
    for r in res["rows"]:
        cpu = r["controller_cpu_ms_per_trajectory"]
        lines.append(f"| {r['servers']} | {r['group']} | {r['trajectories']} | {r['trajectories_per_s']:.0f} "
                     f"| {cpu:.4f} | {cpu / TARGET_CPU_MS:.1f} | {r['samples_in_flight_max']} "
                     f"| {_lag(r)} | {r['wall_s']:.1f} |")
    lines.append("")
    for r in res["rows"]:
        x = r["controller_cpu_ms_per_trajectory"] / TARGET_CPU_MS
        verdict = "met" if x <= 1 else "missed"
        lines.append(f"{r['servers']} servers, group {r['group']}: {x:.1f} times the target of {TARGET_CPU_MS} ms "
                     f"per trajectory ({verdict})")
    flat = res["flat_ratio_group8"]
    lines.append("flat over server counts at group 8 (max / min, target 1.2): "
                 + ("- (fewer than 2 server counts)" if flat is None else f"{flat:.2f} ({'met' if flat <= 1.2 else 'missed'})"))
    return "\n".join(lines)


def _lag(row: dict[str, Any]) -> str:
    mean, most = row.get("event_loop_lag_ms"), row.get("event_loop_lag_ms_max")
    return "-" if mean is None else f"{mean:.2f} / {most:.1f}"


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="asyncrl bench controller", description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--quick", action="store_true", help=f"{QUICK['servers'][0]} servers, group {QUICK['groups'][0]}, "
                                                       f"steps {QUICK['steps'][0]} and {QUICK['steps'][1]} (about 12 s)")
    p.add_argument("--servers", default="4,16,64", help="comma-separated server counts")
    p.add_argument("--groups", default="1,8", help="comma-separated group sizes (prompts per step: 256 / group)")
    p.add_argument("--ray", action="store_true",
                   help="servers and trainer as Ray actors: the process measured is the controller alone")
    p.add_argument("--steps", default="4,32", help="S1,S2: steps of the short and the long run of each case")
    p.add_argument("--out", type=Path, help="write results.json here")
    args = p.parse_args(argv)
    servers, groups, steps = _ints(args.servers), _ints(args.groups), _ints(args.steps)
    if args.quick:
        servers, groups, steps = list(QUICK["servers"]), list(QUICK["groups"]), list(QUICK["steps"])
    if len(steps) != 2:
        p.error(f"--steps needs two step counts S1,S2, got {args.steps!r}")
    started = time.time()
    res = run(servers, groups, (steps[0], steps[1]), args.ray, log=sys.stderr)
    res["bench_wall_s"] = round(time.time() - started, 1)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(res, indent=1))
    if args.json:
        print(json.dumps(res, indent=1))
    else:
        print(table(res))
        print(f"\n{len(res['runs'])} runs in {res['bench_wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
