"""`asyncrl scale` against live runs: real `asyncrl train` processes, resized from another process.

Embedded (servers in the controller's process) and Ray (each server an actor of its own): the fleet
grows (the joiners take the current weights from a routed peer, not from the trainer), shrinks (the
servers taken away drain), a malformed request is refused and counted, a finished run is not asked, and
every step is trained with no sample twice. The trainer is the cost model (its step sleeps per token), so
the run lasts long enough for the requests whatever the machine's load.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

STEPS = 24
COMMON = ["trainer.prompts_per_step=4", "rollout.group_size=4", "data.eval_size=4", "trainer.eval_every=1000",
          "trainer.save_every=0", "rollout.max_tokens=16", "logging.mlflow=false", "logging.progress=false",
          "trainer.engine=cost_model", "trainer.cost_model_token_s=0.004", "trainer.mode=fully_async"]


def _start(tmp: Path, name: str, *extra: str) -> tuple[subprocess.Popen, Path, Path]:
    log = tmp / f"{name}.log"
    cmd = [sys.executable, "-m", "asyncrl.cli", "train", "configs/demo.yaml", *COMMON, f"trainer.total_steps={STEPS}",
           f"logging.run_root={tmp}/runs", f"logging.run_name={name}", f"model.cache_dir={tmp}/models", *extra]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, tmp / "runs" / name, log


def _wait(cond, proc: subprocess.Popen, log: Path, what: str, timeout_s: float = 240.0):
    t0 = time.time()
    while True:
        got = cond()
        if got:
            return got
        assert proc.poll() is None, f"the run ended while waiting for {what}:\n{log.read_text()[-3000:]}"
        assert time.time() - t0 < timeout_s, f"no {what} in {timeout_s} s:\n{log.read_text()[-3000:]}"
        time.sleep(0.3)


def _step(run: Path) -> int:
    """The last step the run logged (metrics.jsonl, one line per step)."""
    try:
        lines = (run / "metrics.jsonl").read_text().splitlines()
        return int(json.loads(lines[-1])["step"]) if lines else 0
    except (OSError, ValueError, KeyError):
        return 0


def _scale(run: Path, servers: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "asyncrl.cli", "scale", str(run), "--servers", servers, "--wait", "180"],
                          capture_output=True, text=True, timeout=240)


def _events(run: Path) -> list[dict]:
    path = run / "fleet_events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _finish(proc: subprocess.Popen, log: Path) -> None:
    try:
        rc = proc.wait(timeout=400)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert rc == 0, log.read_text()[-3000:]


def _trained_once(run: Path) -> None:
    steps = [json.loads(line) for line in (run / "trained_uids.jsonl").read_text().splitlines()]
    uids = [u for s in steps for u in s["uids"]]
    assert len(steps) == STEPS and len(uids) == len(set(uids))  # every step, no sample twice


@pytest.mark.timeout(600)
def test_scale_an_embedded_run_up_and_down(tmp_path):
    proc, run, log = _start(tmp_path, "embedded", "rollout.num_servers=1")
    _wait(lambda: _step(run) >= 2, proc, log, "step 2")
    up = _scale(run, "+2")
    assert up.returncode == 0, up.stderr
    assert "fleet main: 1 -> 3 servers" in up.stdout
    joins = _wait(lambda: [e for e in _events(run) if e["kind"] == "join"], proc, log, "join events")
    assert {e["via"] for e in joins} == {"peer"} and len(joins) == 2  # weights from a peer, not the trainer

    (run / "control" / "0-bad.request").write_text('{"fleet": "main", "servers": "many"}')  # refused and counted
    down = _scale(run, "1")
    assert down.returncode == 0, down.stderr
    assert "fleet main: 3 -> 1 servers" in down.stdout
    refused = _scale(run, "-5")  # the controller refuses what would leave no server
    assert refused.returncode == 1 and "at least 1 server" in refused.stderr
    _finish(proc, log)

    drains = [e for e in _events(run) if e["kind"] == "drain"]
    assert len(drains) == 2 and drains[-1]["size"] == {"main": 1}
    sizes = [row.get("fleet/size_main") for row in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())]
    assert 3.0 in sizes and sizes[-1] == 1.0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["fleet"]["joins_by_source"]["peer"] == 2 and summary["fleet"]["changes"]["drains"] == 2
    assert summary["fleet"]["control_rejected"] == 1
    assert "control request refused" in log.read_text()
    _trained_once(run)
    gone = _scale(run, "+1")  # a finished run is not asked
    assert gone.returncode == 1 and "not running" in gone.stderr


@pytest.mark.timeout(600)
def test_scale_a_ray_run_up_and_down(tmp_path):
    """Each server an actor: the joiner's weights from its peer actor over the weight plane, the shrink a
    drain. (A server SIGKILLed under a live Ray run: tests/deploy/test_follow_cluster.py, whose rollout node
    is ended with its server, and `asyncrl bench chaos`/`elastic`.)"""
    pytest.importorskip("ray")
    (tmp_path / "shm").mkdir()
    proc, run, log = _start(tmp_path, "ray", "ray.enabled=true", "rollout.num_servers=1", "trainer.num_ranks=1",
                            f"queue.shm_dir={tmp_path}/shm", "rollout.health_interval_s=2", "rollout.health_timeout_s=10",
                            "ray.num_cpus=4")  # room for a second server (a local Ray has slots for the configured ones only)
    _wait(lambda: _step(run) >= 2, proc, log, "step 2")
    up = _scale(run, "2")
    assert up.returncode == 0, up.stderr
    join = _wait(lambda: [e for e in _events(run) if e["kind"] == "join"], proc, log, "a join")
    assert join[0]["via"] == "peer" and join[0]["server"] == "main-1"
    step = _step(run)
    _wait(lambda: _step(run) >= step + 1, proc, log, "a step with two servers")
    down = _scale(run, "1")
    assert down.returncode == 0, down.stderr
    _finish(proc, log)
    kinds = [e["kind"] for e in _events(run)]
    assert kinds.count("join") == 1 and kinds.count("drain") == 1 and "preempt" not in kinds
    # the joiner's start, split: its own placement group, Ray starting its process, the imports, the build
    split = next(e for e in _events(run) if e["kind"] == "start")["startup"]
    assert set(split) == {"placement_s", "queued_s", "imports_s", "build_s", "total_s"}, split
    assert min(split.values()) >= 0 and split["imports_s"] > 0.1 and split["build_s"] > 0, split
    assert split["queued_s"] + split["imports_s"] + split["build_s"] <= split["total_s"] + 0.05, split
    assert json.loads((run / "summary.json").read_text())["fleet"]["size"] == {"main": 1}
    _trained_once(run)
