"""The two-machine recipe of deploy/local/README.md, as written there, on two simulated hosts
(`asyncrl/bench/sim_cluster.py`: each its own network namespace and address, /dev/shm, /tmp, process
table and hostname; nothing host-local passes between them). Host A runs `start_cluster.sh head` (custom
resource `node_a`), host B `start_cluster.sh worker` (`node_b`), each with `--pid-file` as the README says;
`start_cluster.sh run -- asyncrl train ...` on host A runs a two-step pipeline whose trainer rank is placed on
node_a (`trainer.ray_resources`) and whose servers on node_b (`rollout.ray_resources`), with the keys a run
over several hosts needs (`weights.host=auto queue.bind_host=auto`, zmq storage, gloo weights). Where each
actor ran is read back from Ray's GCS. Both nodes are ended by `start_cluster.sh stop --pid-file` (never
`ray stop`): afterwards neither host's process table holds a Ray process. Skipped where namespaces cannot be
made (not root, no iproute2 / util-linux).
"""

from __future__ import annotations

import json
import time

import pytest

from asyncrl.bench.sim_cluster import SimCluster, available
from tests.deploy.conftest import DEPLOY

SCRIPT = str(DEPLOY / "ray" / "start_cluster.sh")

WHERE_ACTORS_RAN = """
import json, sys
import ray
ray.init(address=sys.argv[1], log_to_driver=False)
nodes = {n["NodeID"]: (n["NodeManagerAddress"], sorted(k for k in n["Resources"] if k.startswith("node_"))) for n in ray.nodes()}
from ray._private.state import actors as gcs_actors
actors = [{"class": a["ActorClassName"], "node": nodes.get(a["Address"]["NodeID"], ("", []))[1],
           "address": nodes.get(a["Address"]["NodeID"], ("", []))[0], "state": a["State"]} for a in gcs_actors().values()]
print(json.dumps({"nodes": sorted(nodes.values()), "actors": actors}))
"""


@pytest.fixture
def two_hosts():
    why = available()
    if why:
        pytest.skip(why)
    with SimCluster(2) as c:
        yield c


@pytest.mark.timeout(300)
def test_the_two_machine_recipe_runs_on_two_hosts(two_hosts):
    c = two_hosts
    a, b = c.hosts[0].address, c.hosts[1].address
    pid_a, pid_b = "/tmp/node_a.pid", "/tmp/node_b.pid"  # each in its own host's /tmp
    head = c.run(0, [SCRIPT, "head", "--ip", a, "--port", "6379", "--num-cpus", "2", "--resources", '{"node_a": 2}',
                     "--pid-file", pid_a], timeout=120)
    assert head.returncode == 0, head.stdout + head.stderr
    worker = c.run(1, [SCRIPT, "worker", "--address", f"{a}:6379", "--ip", b, "--num-cpus", "2", "--resources",
                       '{"node_b": 2}', "--pid-file", pid_b], timeout=120)
    assert worker.returncode == 0, worker.stdout + worker.stderr
    try:
        runs = c.shared / "runs"
        train = c.run(0, [
            SCRIPT, "run", "--address", f"{a}:6379", "--wait-nodes", "2", "--wait-s", "90", "--",
            "asyncrl", "train", "trainer.ray_resources={node_a: 1}", "rollout.ray_resources={node_b: 1}", "queue.storage=zmq",
            "weights.backend=gloo", "weights.host=auto", "queue.bind_host=auto",
            "trainer.total_steps=2", "rollout.num_servers=2", "trainer.prompts_per_step=2", "rollout.group_size=2", "data.eval_size=2",
            "trainer.eval_every=2", "logging.mlflow=false", "logging.progress=false", f"logging.run_root={runs}",
            "logging.run_name=two-node", f"model.cache_dir={c.shared / 'models'}",
        ], timeout=240)
        assert train.returncode == 0, train.stdout[-3000:] + train.stderr[-3000:]
        assert "2 Ray nodes alive" in train.stdout
        assert f"trainer rank 0 on {a} (eth0)" in train.stdout, train.stdout[-2000:]

        state = json.loads(c.python(0, WHERE_ACTORS_RAN, f"{a}:6379").strip().splitlines()[-1])
        assert sorted(map(tuple, map(lambda n: (n[0], tuple(n[1])), state["nodes"]))) == [(a, ("node_a",)), (b, ("node_b",))]
        trainers = [x for x in state["actors"] if x["class"] == "TrainerRankActor"]
        servers = [x for x in state["actors"] if x["class"] == "ServerActor"]
        assert len(trainers) == 1 and len(servers) == 2, state["actors"]
        assert all(x["address"] == a for x in trainers) and all(x["address"] == b for x in servers), state["actors"]

        status = json.loads((runs / "two-node" / "status_final.json").read_text())
        versions = [s["version"] for f in status["fleets"].values() for s in f["servers"]]
        assert versions == [2, 2], status["fleets"]  # both servers on host B loaded the trainer's weights of step 2
    finally:
        for i, pid_file in ((1, pid_b), (0, pid_a)):
            c.run(i, [SCRIPT, "stop", "--pid-file", pid_file], timeout=60)
    for i in (0, 1):  # a worker the node had started may take a moment to see its raylet gone
        deadline = time.monotonic() + 15
        while (left := [p for p in c.processes(i) if "ray" in p.split(None, 1)[-1] and "ps -eo" not in p]) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not left, f"host {i}: Ray processes outlived start_cluster.sh stop: {left}"
