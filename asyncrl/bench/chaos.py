"""asyncrl bench chaos: a fully_async run on Ray with a Redis queue while a fault injector kills its parts.

The run: `asyncrl train configs/demo.yaml` with `ray.enabled=true`, 2 trainer ranks, 2 rollout
servers, a durable queue (a real redis-server started here, per-record shm files, acks at
checkpoints), for `--steps` steps, on a Ray cluster of its own (a head on 127.0.0.1 that outlives the
controller, `asyncrl/bench/cluster.py`, as on a real cluster) with `ray.detached=true`: the actors
outlive a controller that dies and its resume takes them back. The injector touches only processes of
the run (the descendants of that head and of the `asyncrl train` process, by their Ray process titles):
- a random rollout server (`ray::ServerActor...`) every `--server-every` seconds of the run (the interval
  goes on across the controller's resume), among the servers whose process has run that long (a
  replacement just started is spared: on a loaded host a start can outlast the interval, and killing
  every replacement before it serves ends the run): the first one is hung (SIGSTOP: alive, connected,
  silent; the fleet must find it, by its health probe or the weight plane's silence, kill it and start
  another), every later one SIGKILLed;
- one trainer rank (`ray::TrainerRankActor...`) once, after the first checkpoint: SIGKILL
  (`asyncrl train` restarts the run's processes from that checkpoint);
- the controller once, after a later checkpoint: SIGKILL to the whole `asyncrl train` process
  group (the cluster lives on), then `asyncrl train ... resume=true`;
- the reward (`flaky_digits`): 5% of calls raise, 5% hang past `agent.reward_timeout_s`.
Then the same run without faults (`wall_s_no_faults`, the plain reward; `--no-baseline` skips it).
The demo model and tokenizer the two runs share are built before either is timed (the first run would
otherwise build them within its wall time: charged to the run with faults alone).

Accounting, from the Redis queue's counters and the run's audit (`trained_uids.jsonl`, one line
per trained step; a step trained again after a restart replaces the later ones: the lineage of the
final model): `trajectories_produced` (records put), `trained` (records in the lineage),
`trained_twice` (records in two steps of the lineage, target 0), `acked`, `dropped_by_cause`,
`resident` (still queued at the end), `lost` = produced - trained - dropped - resident (target 0;
only for a run that finished, which has acked its whole lineage), `queue_consistent` (put = acked
+ dropped + resident),
`completed` (the final segment finished every step), `restart_stale_drops` (records dropped as stale
that were generated before the last resume; target <= 1% of produced), `wall_ratio` (with faults over
without; target 1.5), `lengths` (response lengths by fate, from summary.json), `samples_continued` (samples
in flight at the controller's kill continued from the tokens its checkpoint saved; target > 0), `redone`
(those generated again from their prompt) and `resume` (what the resume did with the checkpoint's work in
flight, `asyncrl/rollout/resume.py`).

    asyncrl bench chaos [--json] [--steps 100] [--quick]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from asyncrl.bench.redis_tools import REDIS_URL_ENV
from plane_common.liveness import held

QUICK_STEPS = 20
"""`--quick`'s steps (the suite's run, `tests/integration/test_chaos_quick.py`)."""
MAX_TOKENS = 32
"""`rollout.max_tokens` of the runs: long enough that a checkpoint finds samples mid-generation (the demo's 4
tokens finish between two looks), so the controller's kill measures what a resume continues."""


def flaky_digits(response: str, answer: str) -> float:
    """The demo's reward, except that 5% of calls raise and 5% hang for 3 s (decided by a hash of the
    response, so a retried sample meets the same fate)."""
    from agents.rewards import get_reward

    fate = hashlib.sha256(response.encode()).digest()[0] % 20
    if fate == 0:
        raise RuntimeError("flaky reward: injected failure")
    if fate == 1:
        time.sleep(3.0)
    return get_reward("digits")(response, answer)


def _cmd(tmp: Path, redis_url: str, address: str, steps: int, faults: bool, name: str, *extra: str,
         max_tokens: int = MAX_TOKENS) -> list[str]:
    from asyncrl.bench.cluster import REPO

    return [  # the recipe by its path in the checkout: the bench runs from any directory
        sys.executable, "-m", "asyncrl.cli", "train", str(REPO / "configs" / "demo.yaml"), f"rollout.max_tokens={max_tokens}",
        "ray.enabled=true", f"ray.address={address}", "ray.detached=true", "ray.orphan_timeout_s=120",
        "trainer.num_ranks=2", "rollout.num_servers=2", "trainer.mode=fully_async",
        f"trainer.total_steps={steps}", "trainer.save_every=5", "trainer.eval_every=1000",
        "trainer.prompts_per_step=4", "rollout.group_size=4", "data.eval_size=8",
        "queue.metadata=redis", REDIS_URL_ENV[1], f"queue.run_id={name}", "queue.lease_timeout_s=10",
        "queue.shm_arena_bytes=0", f"queue.shm_dir={tmp}/shm", "rollout.health_timeout_s=5", "rollout.health_interval_s=2",
        "weights.timeout_s=10", "agent.reward_timeout_s=1",
        *(["agent.reward=asyncrl.bench.chaos:flaky_digits"] if faults else []),
        f"logging.run_root={tmp}/runs", f"logging.run_name={name}", "logging.mlflow=false", "logging.progress=false",
        f"model.cache_dir={tmp}/models", *extra,
    ]


def _descendants(pid: int, title: str) -> list[Any]:
    import psutil

    out = []
    try:
        procs = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return out
    for p in procs:
        try:
            if p.cmdline() and p.cmdline()[0].startswith(title):
                out.append(p)
        except psutil.Error:
            pass
    return out


def _age_s(proc: Any) -> float:
    import psutil

    try:
        return time.time() - proc.create_time()
    except psutil.Error:
        return 0.0


def _checkpoints(run: Path) -> list[int]:
    return sorted(int(p.parent.name.split("_")[1]) for p in (run / "checkpoints").glob("step_*/state.json"))


def _segment(cmd: list[str], run: Path, steps: int, faults: dict[str, int], *, kill_trainer: bool, kill_controller_after: int | None,
             server_every: float, rng: random.Random, log: Any, timeout_s: float, cluster: int, env: dict[str, str],
             clock: dict[str, float]) -> tuple[int, str]:
    """Run one `asyncrl train` process, injecting faults (the trainer rank once, and the controller
    once, counted in `faults` across segments) into its actors, which run under the Ray head `cluster`
    (its process group leader's pid); returns (exit code, 'killed' or 'exited'). `clock["server"]`: when
    the last server fault was due, kept across segments (a resume does not restart the interval)."""
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    t0 = time.time()
    ended_at = None  # when the last step's checkpoint appeared: the process should exit soon after
    try:
        while proc.poll() is None:
            if time.time() - t0 > timeout_s:
                raise TimeoutError(f"chaos: a segment ran past {timeout_s} s")
            time.sleep(0.5)
            ckpts = _checkpoints(run)
            if ckpts and ckpts[-1] == steps and ended_at is None:
                ended_at = time.time()
            if ended_at is not None and time.time() - ended_at > 60:  # stuck after its last step: where?
                proc.send_signal(signal.SIGUSR1)  # the controller prints every task's stack into the log
                time.sleep(2)
                faults["stuck_at_end"] = faults.get("stuck_at_end", 0) + 1
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                return proc.returncode, "stuck"
            if kill_trainer and ckpts and faults["trainer_rank"] == 0:
                ranks = _descendants(cluster, "ray::TrainerRankActor")
                if len(ranks) >= 2:
                    rng.choice(ranks).send_signal(signal.SIGKILL)
                    faults["trainer_rank"] += 1
                    continue
            if (kill_controller_after is not None and faults["controller"] == 0 and faults["trainer_rank"] > 0
                    and ckpts and ckpts[-1] >= kill_controller_after):
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                faults["controller"] += 1
                return proc.returncode, "killed"
            if time.time() - clock["server"] >= server_every:
                servers = [p for p in _descendants(cluster, "ray::ServerActor") if _age_s(p) >= server_every]
                if servers:
                    hang = faults["server_hung"] == 0
                    rng.choice(servers).send_signal(signal.SIGSTOP if hang else signal.SIGKILL)
                    faults["server_hung" if hang else "server"] += 1
                clock["server"] = time.time()
        return proc.returncode, "exited"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def lineage(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The steps of the final model: a step trained again (after a restart from a checkpoint)
    replaces that step and every later one of the earlier attempt.

    >>> [l["step"] for l in lineage([{"step": 1}, {"step": 2}, {"step": 3}, {"step": 2}, {"step": 3}])]
    [1, 2, 3]
    """
    out: list[dict[str, Any]] = []
    for line in lines:
        while out and out[-1]["step"] >= line["step"]:
            out.pop()
        out.append(line)
    return out


def accounting(redis_url: str, run_id: str, run: Path, code: int) -> dict[str, Any]:
    """A run's Redis queue counters against its trained lineage (`trained_uids.jsonl`): `trajectories_produced`,
    `trained`, `trained_twice`, `dropped`, `resident`, `last_step`, and `lost` (produced - trained - dropped -
    resident; only for a run that finished (`code` 0), which acked its whole lineage at its last checkpoint)."""
    from transfer_queue import TransferQueueConfig, connect

    lines = [json.loads(line) for line in (run / "trained_uids.jsonl").read_text().splitlines() if line.strip()] \
        if (run / "trained_uids.jsonl").exists() else []
    effective = lineage(lines)
    uids = [u for line in effective for u in line["uids"]]
    stats = connect(TransferQueueConfig(metadata="redis", redis_url=redis_url, run_id=run_id, storage="local")).stats()
    dropped = sum(stats.dropped.get("trainer", {}).values())
    resident = sum(stats.depth.get("trainer", {}).values())
    return {"trajectories_produced": stats.put, "trained": len(set(uids)), "trained_twice": len(uids) - len(set(uids)),
            "dropped": dropped, "dropped_by_cause": {k: v for k, v in stats.dropped.get("trainer", {}).items() if v},
            "acked": sum(stats.acked.values()), "resident": resident, "last_step": effective[-1]["step"] if effective else 0,
            "lost": stats.put - len(set(uids)) - dropped - resident if code == 0 else None}


def run_once(tmp: Path, redis_url: str, steps: int, faults_on: bool, server_every: float, seed: int,
             max_tokens: int = MAX_TOKENS) -> dict[str, Any]:
    """One run (with or without faults) on a Ray head of its own."""
    from asyncrl.bench.cluster import ray_head

    with ray_head(num_cpus=5) as (address, env, cluster):
        env = {**env, REDIS_URL_ENV[0]: redis_url}  # its password on no command line
        return _run_once(tmp, redis_url, address, env, cluster, steps, faults_on, server_every, seed, max_tokens)


def _run_once(tmp: Path, redis_url: str, address: str, env: dict[str, str], cluster: int, steps: int, faults_on: bool,
              server_every: float, seed: int, max_tokens: int) -> dict[str, Any]:
    from transfer_queue import TransferQueueConfig, connect

    name = "chaos" if faults_on else "calm"
    run = tmp / "runs" / name
    faults = {"server": 0, "server_hung": 0, "trainer_rank": 0, "controller": 0, "reward": 0}
    rng = random.Random(seed)
    t0 = time.time()
    clock = {"server": t0}
    segments = []
    with open(tmp / f"{name}.log", "ab") as log:
        how, code = "", 0
        while not segments or how == "killed":  # a killed controller is resumed; a failed run is not retried
            code, how = _segment(_cmd(tmp, redis_url, address, steps, faults_on, name, *(["resume=true"] if segments else []),
                                      max_tokens=max_tokens),
                                 run, steps, faults,
                                 kill_trainer=faults_on, kill_controller_after=steps // 2 if faults_on else None,
                                 server_every=server_every if faults_on else 1e9, rng=rng, log=log, timeout_s=1800,
                                 cluster=cluster, env=env, clock=clock)
            segments.append(how)
    wall = time.time() - t0
    summary = json.loads((run / "summary.json").read_text()) if (run / "summary.json").exists() else {}
    audit = [json.loads(l) for l in (run / "trained_uids.jsonl").read_text().splitlines()] if (run / "trained_uids.jsonl").exists() else []
    effective = lineage(audit)
    uids = [u for line in effective for u in line["uids"]]
    stats = connect(TransferQueueConfig(metadata="redis", redis_url=redis_url, run_id=name, storage="local")).stats()
    dropped = {c: n for c, n in stats.dropped.get("trainer", {}).items()}
    resident = sum(stats.depth.get("trainer", {}).values())
    faults["reward"] = int(summary.get("reward_failures", 0))
    return {
        "faults_injected": faults,
        "segments": segments,
        "exit_code": code,
        "trajectories_produced": stats.put,
        "trained": len(set(uids)),
        "trained_twice": len(uids) - len(set(uids)),
        "acked": sum(stats.acked.values()),
        "redelivered": sum(stats.redelivered.values()),
        "dropped_by_cause": dropped,
        "resident": resident,
        # a finished run has acked its whole lineage at its last checkpoint, so what is neither
        # trained, dropped nor still queued is lost; before that the count means nothing
        "lost": stats.put - len(set(uids)) - sum(dropped.values()) - resident if code == 0 else None,
        "queue_consistent": stats.put == sum(stats.acked.values()) + sum(dropped.values()) + resident,
        "completed": code == 0 and summary.get("steps") == steps and bool(effective) and effective[-1]["step"] == steps,
        # dropped as stale, generated before the last resume: what the restart cost in samples
        "restart_stale_drops": summary.get("stale_dropped_from_before_resume"),
        "lengths": summary.get("lengths"),
        "samples_continued": summary.get("samples_continued"),
        "redone": summary.get("redone"),
        "resume": summary.get("resume"),
        "failover": summary.get("failover"),
        "steps": summary.get("steps"),
        # every segment's (summary.json is the last segment's, whose process restarted nothing)
        "trainer_restarts": (tmp / f"{name}.log").read_text(errors="replace").count("restarting the trainer from the last checkpoint"),
        # resumes that took the killed controller's actors back instead of starting new ones (ray.detached)
        "actors_taken_back": (tmp / f"{name}.log").read_text(errors="replace").count("took back the run's"),
        "final_eval_reward": summary.get("final_eval_reward"),
        "wall_s": round(wall, 1),
    }


def _build_model(cache_dir: Path) -> None:
    """The demo model under the runs' `model.cache_dir` (`_cmd`), as `asyncrl train` would build it."""
    from asyncrl.bench.cluster import REPO
    from asyncrl.config import load
    from asyncrl.data.tiny_model import ensure_tiny_model

    ensure_tiny_model(cache_dir, load(REPO / "configs" / "demo.yaml").model.tiny)


def run(steps: int, server_every: float, seed: int, baseline: bool = True, max_tokens: int = MAX_TOKENS) -> dict[str, Any]:
    """The run with faults, then (`baseline`) the same run without them, for the wall-time ratio."""
    from asyncrl.bench.redis_tools import redis_server as _redis_server

    from asyncrl.shm_gc import collect

    tmp = Path(tempfile.mkdtemp(prefix="asyncrl-chaos-"))
    (tmp / "shm").mkdir()
    found = _dev_shm()
    redis, url = _redis_server(str(tmp))
    try:
        _build_model(tmp / "models")
        chaos = run_once(tmp, url, steps, True, server_every, seed, max_tokens)
        calm = run_once(tmp, url, steps, False, server_every, seed, max_tokens) if baseline else None
    finally:
        redis.kill()
        redis.wait()
    res = {**chaos, "wall_s_no_faults": calm["wall_s"] if calm else None, "no_faults": calm, "logs": str(tmp)}
    # what the runs' killed processes left in shared memory: their own shm dir (per-record files of a
    # durable queue) once the runs are over, what the gc of a next run removes of it, and /dev/shm
    left = sum(1 for e in os.scandir(tmp / "shm") if e.name.startswith("tq-"))
    gc = collect(str(tmp / "shm"))
    res["shm"] = {"run_files_left": left, "removed_by_gc": sum(v.removed for v in gc.dead),
                  "left_after_gc": sum(1 for e in os.scandir(tmp / "shm") if e.name.startswith("tq-")),
                  "dev_shm_left": sorted(n for n in _dev_shm() - found if not held(os.path.join("/dev/shm", n)))}
    drops = chaos["restart_stale_drops"]
    res["restart_stale_drop_ratio"] = round(drops / chaos["trajectories_produced"], 4) if drops is not None and chaos["trajectories_produced"] else None
    res["wall_ratio"] = round(chaos["wall_s"] / calm["wall_s"], 2) if calm else None
    res["targets"] = {"lost": {"target": 0, "met": chaos["lost"] == 0}, "trained_twice": {"target": 0, "met": chaos["trained_twice"] == 0},
                      "completed": {"target": True, "met": chaos["completed"]},
                      "restart_stale_drop_ratio": {"target": 0.01, "met": res["restart_stale_drop_ratio"] is not None and res["restart_stale_drop_ratio"] <= 0.01},
                      "samples_continued": {"target": "> 0", "met": bool(chaos["samples_continued"])}}
    res["targets"]["dev_shm_left"] = {"target": 0, "met": not res["shm"]["dev_shm_left"]}
    res["targets"]["left_after_gc"] = {"target": 0, "met": res["shm"]["left_after_gc"] == 0}
    if calm:
        res["targets"]["wall_ratio"] = {"target": 1.5, "met": res["wall_ratio"] <= 1.5}
    if all(t["met"] for t in res["targets"].values()) and (calm is None or calm["completed"]):
        shutil.rmtree(tmp / "shm", ignore_errors=True)
    return res


def _dev_shm() -> set[str]:
    """Names of this user's files of both planes in /dev/shm (queue arenas and marks, weight slots)."""
    from checkpoint_engine.backends.shm import PREFIX
    from transfer_queue.storage.shm_runs import own_files

    return {e.name for prefix in ("tq-", PREFIX) for e, _ in own_files("/dev/shm", prefix)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="asyncrl bench chaos", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--steps", type=int, default=100, help="trainer steps of the run (default 100)")
    p.add_argument("--quick", action="store_true", help=f"{QUICK_STEPS} steps")
    p.add_argument("--server-every", type=float, default=10.0, help="seconds between server kills (default 10)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-tokens", type=int, default=MAX_TOKENS, help=f"rollout.max_tokens of the runs (default {MAX_TOKENS})")
    p.add_argument("--no-baseline", action="store_true", help="skip the run without faults (no wall ratio; what the test runs)")
    a = p.parse_args(argv)
    res = run(QUICK_STEPS if a.quick else a.steps, a.server_every, a.seed, baseline=not a.no_baseline, max_tokens=a.max_tokens)
    if a.json:
        print(json.dumps(res, indent=1))
    else:
        for k in ("faults_injected", "segments", "trajectories_produced", "trained", "trained_twice", "acked", "dropped_by_cause",
                  "resident", "lost", "completed", "restart_stale_drops", "restart_stale_drop_ratio", "trainer_restarts",
                  "final_eval_reward", "wall_s", "wall_s_no_faults", "wall_ratio", "samples_continued", "redone", "resume", "failover", "actors_taken_back",
                  "lengths", "shm", "logs"):
            print(f"{k:24} {res[k]}")
        for name, t in res["targets"].items():
            print(f"target {name} {t['target']}: {'met' if t['met'] else 'NOT met'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
