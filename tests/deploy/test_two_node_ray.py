"""A real two-node Ray cluster on this host, started by deploy/ray/start_cluster.sh (the script the
Slurm file runs): the head offers the custom resource `node_a`, a second raylet joins with `node_b`,
and `start_cluster.sh run -- asyncrl train ...` runs a two-step pipeline whose trainer rank is
placed on node_a (`trainer.ray_resources`) and whose servers on node_b (`rollout.ray_resources`).
Where each actor ran is read back from Ray's GCS afterwards. Both nodes are ended by their process
group (`start_cluster.sh stop`), never by `ray stop`, which would end other Ray clusters on the host.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.deploy.conftest import BIN, DEPLOY, REPO, tool

SCRIPT = str(DEPLOY / "ray" / "start_cluster.sh")

WHERE_ACTORS_RAN = """
import json, sys
import ray
ray.init(address=sys.argv[1], log_to_driver=False)
nodes = {n["NodeID"]: sorted(k for k in n["Resources"] if k.startswith("node_")) for n in ray.nodes()}
# the GCS actor table (ray.util.state needs the dashboard, which these nodes do not run); it keeps dead actors
from ray._private.state import actors as gcs_actors
actors = [{"class": a["ActorClassName"], "node": nodes.get(a["Address"]["NodeID"], [a["Address"]["NodeID"]]), "state": a["State"]}
          for a in gcs_actors().values()]
print(json.dumps({"nodes": nodes, "actors": actors}))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def group_alive(pgid: int) -> list[str]:
    """Live (not zombie) processes of process group `pgid`, as `pid cmd`."""
    out = subprocess.run(["ps", "-eo", "pgid=,pid=,stat=,comm="], capture_output=True, text=True, check=True).stdout
    rows = [line.split(None, 3) for line in out.splitlines()]
    return [f"{r[1]} {r[3]}" for r in rows if len(r) == 4 and int(r[0]) == pgid and not r[2].startswith("Z")]


@pytest.fixture
def two_nodes(tmp_path: Path):
    """(address, env) of a head (node_a, 2 CPUs) and a worker (node_b, 2 CPUs) on 127.0.0.1."""
    env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}", RAY=tool("ray"), PYTHON=sys.executable,
               RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(16), ASYNCRL_SECRET=secrets.token_hex(16),
               PYTHONPATH=str(REPO))
    short = Path(tempfile.mkdtemp(prefix="ar-", dir="/tmp"))  # Ray's socket paths must stay under 107 bytes
    port = free_port()
    address = f"127.0.0.1:{port}"
    head, worker = tmp_path / "head.pid", tmp_path / "worker.pid"
    run = lambda *a, timeout=120: subprocess.run([SCRIPT, *a], env=env, cwd=REPO, timeout=timeout, check=True)  # noqa: E731
    pgids = []
    try:
        run("head", "--ip", "127.0.0.1", "--port", str(port), "--num-cpus", "2", "--resources", '{"node_a": 2}',
            "--temp-dir", str(short / "ray"), "--pid-file", str(head),
            "--", "--dashboard-port", str(free_port()), "--ray-client-server-port", str(free_port()))
        pgids.append(int(head.read_text()))
        run("run", "--address", address, "--wait-nodes", "1", "--wait-s", "60", "--", "true")
        run("worker", "--address", address, "--ip", "127.0.0.1", "--num-cpus", "2", "--resources", '{"node_b": 2}',
            "--pid-file", str(worker), "--", "--dashboard-agent-listen-port", str(free_port()))
        pgids.append(int(worker.read_text()))
        yield address, env
    finally:
        for pid_file in (worker, head):
            subprocess.run([SCRIPT, "stop", "--pid-file", str(pid_file)], env=env, timeout=60, check=False)
        shutil.rmtree(short, ignore_errors=True)
        left = [p for g in pgids for p in group_alive(g)]
        assert not left, f"a node's processes outlived start_cluster.sh stop: {left}"


@pytest.mark.timeout(240)
def test_trainer_and_servers_run_on_different_nodes(two_nodes, tmp_path):
    address, env = two_nodes
    train = [
        tool("asyncrl"), "train", "configs/demo.yaml", "trainer.total_steps=2", "trainer.prompts_per_step=2",
        "rollout.group_size=2", "rollout.num_servers=2", "data.eval_size=2", "trainer.eval_every=2",
        "trainer.ray_resources={node_a: 1}", "rollout.ray_resources={node_b: 1}",
        "logging.mlflow=false", "logging.progress=false", f"logging.run_root={tmp_path}/runs", "logging.run_name=two-node",
        f"queue.shm_dir={tmp_path}/shm", f"model.cache_dir={tmp_path}/models",
    ]
    (tmp_path / "shm").mkdir()
    done = subprocess.run([SCRIPT, "run", "--address", address, "--wait-nodes", "2", "--wait-s", "60", "--", *train],
                          env=env, cwd=REPO, timeout=200, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "2 Ray nodes alive" in done.stdout

    where = subprocess.run([sys.executable, "-c", WHERE_ACTORS_RAN, address], env=env, timeout=60,
                           capture_output=True, text=True)
    assert where.returncode == 0, where.stderr[-3000:]
    state = json.loads(where.stdout.strip().splitlines()[-1])
    assert sorted(map(tuple, state["nodes"].values())) == [("node_a",), ("node_b",)]
    trainers = [a for a in state["actors"] if a["class"] == "TrainerRankActor"]
    servers = [a for a in state["actors"] if a["class"] == "ServerActor"]
    assert len(trainers) == 1 and len(servers) == 2, state["actors"]
    assert all(a["node"] == ["node_a"] for a in trainers), trainers
    assert all(a["node"] == ["node_b"] for a in servers), servers

    run_dir = tmp_path / "runs" / "two-node"
    status = json.loads((run_dir / "status_final.json").read_text())
    versions = [s["version"] for f in status["fleets"].values() for s in f["servers"]]
    assert versions == [2, 2], status["fleets"]  # both servers on node_b loaded the trainer's weights of step 2
