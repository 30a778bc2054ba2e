"""`rollout.follow_cluster` on a real Ray cluster whose rollout nodes come and go (what KubeRay's autoscaler
does to deploy/kuberay/rayjob-elastic.yaml's rollout group): a head that offers one `rollout_node` runs the
trainer and one server; a second raylet that offers another joins mid-run and the fleet grows onto it (the
joiner's weights from its peer); then that node is ended (`start_cluster.sh stop`: its raylet and every
process on it gone, as a preempted pod) and its server is a preemption, not restarted; the run finishes every
step with no sample trained twice. Both nodes are started by deploy/ray/start_cluster.sh on 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from asyncrl.bench.cluster import free_port
from tests.deploy.conftest import BIN, DEPLOY, REPO, tool

SCRIPT = str(DEPLOY / "ray" / "start_cluster.sh")

STEPS = 25


def _events(run: Path) -> list[dict]:
    path = run / "fleet_events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _wait(cond, proc: subprocess.Popen, log: Path, what: str, timeout_s: float = 150.0):
    t0 = time.time()
    while not cond():
        assert proc.poll() is None, f"the run ended while waiting for {what}:\n{log.read_text()[-4000:]}"
        assert time.time() - t0 < timeout_s, f"no {what} in {timeout_s} s:\n{log.read_text()[-4000:]}"
        time.sleep(0.5)


@pytest.mark.timeout(480)
def test_the_fleet_follows_rollout_nodes_that_join_and_vanish(tmp_path):
    env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}", RAY=tool("ray"), PYTHON=sys.executable,
               RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(16), ASYNCRL_SECRET=secrets.token_hex(16),
               PYTHONPATH=str(REPO))
    short = Path(tempfile.mkdtemp(prefix="ar-", dir="/tmp"))  # Ray's socket paths must stay under 107 bytes
    address = f"127.0.0.1:{free_port()}"
    head, worker = tmp_path / "head.pid", tmp_path / "worker.pid"
    script = lambda *a: subprocess.run([SCRIPT, *a], env=env, cwd=REPO, timeout=120, check=True)  # noqa: E731
    (tmp_path / "shm").mkdir()
    run = tmp_path / "runs" / "follow"
    log = tmp_path / "train.log"
    proc = None
    try:
        script("head", "--ip", "127.0.0.1", "--port", address.rsplit(":", 1)[1], "--num-cpus", "3",
               "--resources", '{"rollout_node": 1}', "--temp-dir", str(short / "ray"), "--pid-file", str(head),
               "--", "--dashboard-port", str(free_port()), "--ray-client-server-port", str(free_port()))
        train = [tool("asyncrl"), "train", "configs/demo.yaml", f"trainer.total_steps={STEPS}", "trainer.prompts_per_step=4",
                 "rollout.group_size=4", "data.eval_size=4", "trainer.eval_every=1000", "trainer.save_every=0",
                 "rollout.max_tokens=16", "trainer.engine=cost_model", "trainer.cost_model_token_s=0.005",
                 "ray.enabled=true", f"ray.address={address}", "rollout.num_servers=1", "rollout.ray_resources={rollout_node: 1}",
                 "rollout.follow_cluster=rollout_node", "rollout.health_interval_s=2", "rollout.health_timeout_s=10",
                 "logging.mlflow=false", "logging.progress=false", f"logging.run_root={tmp_path}/runs", "logging.run_name=follow",
                 f"queue.shm_dir={tmp_path}/shm", f"model.cache_dir={tmp_path}/models"]
        with open(log, "w") as out:
            proc = subprocess.Popen(train, env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        _wait(lambda: (run / "metrics.jsonl").exists() and len((run / "metrics.jsonl").read_text().splitlines()) >= 3,
              proc, log, "step 2")
        script("worker", "--address", address, "--ip", "127.0.0.1", "--num-cpus", "2", "--resources", '{"rollout_node": 1}',
               "--pid-file", str(worker), "--", "--dashboard-agent-listen-port", str(free_port()))
        _wait(lambda: any(e["kind"] == "join" for e in _events(run)), proc, log, "a server on the new node")
        join = next(e for e in _events(run) if e["kind"] == "join")
        assert join["server"] == "main-1" and join["via"] == "peer", _events(run)  # a join_pending says why not
        script("stop", "--pid-file", str(worker))  # the node vanishes with its server
        _wait(lambda: any(e["kind"] in ("preempt", "drain") and e["server"] == "main-1" for e in _events(run)),
              proc, log, "the vanished node's server to leave")
        assert proc.wait(timeout=300) == 0, log.read_text()[-4000:]
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
        for pid_file in (worker, head):
            if pid_file.exists():
                subprocess.run([SCRIPT, "stop", "--pid-file", str(pid_file)], env=env, timeout=60, check=False)
        shutil.rmtree(short, ignore_errors=True)
    kinds = [e["kind"] for e in _events(run)]
    assert "restart" not in kinds, _events(run)  # a vanished node's server is not started again
    assert json.loads((run / "summary.json").read_text())["fleet"]["size"] == {"main": 1}
    steps = [json.loads(line) for line in (run / "trained_uids.jsonl").read_text().splitlines()]
    uids = [u for s in steps for u in s["uids"]]
    assert len(steps) == STEPS and len(uids) == len(set(uids))
    out = log.read_text()
    assert "hold room for 2 servers: main 1 -> 2" in out
