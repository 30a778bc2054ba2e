"""A run spread over simulated hosts (`tests/hosts/conftest.py`): nothing host-local passes between them, so
every plane has to cross a real network (its own address per host, its own /dev/shm, no shared 127.0.0.1).

- the issue's 3-host run: controller and a trainer rank on host 0, the other trainer rank on host 1 (the
  trainer's own process group spans two hosts), servers on hosts 1 and 2, Redis (with a password) on
  host 2; weights over gloo, data over zmq storage; it trains to its step count with lost 0 and trained
  twice 0, the servers load the trainer's last weights, host 2's link carried every publish's bytes, and
  no host's /dev/shm holds another's segments. The same with nixl on both planes.
- servers on another host join the version-0 publish (before, every listener advertised 127.0.0.1 and they
  were evicted as "not joined");
- a plane that cannot cross hosts, or a loopback listener, with the roles on different hosts: a config error
  naming the key, before anything starts (pinned roles) or once placed.
"""

from __future__ import annotations

import json
import time

import pytest

pytestmark = pytest.mark.timeout(420)

GLOO_ZMQ = ("weights.backend=gloo", "queue.storage=zmq")


def _summary(hosts, name: str) -> dict:
    return json.loads((hosts.run_dir(name) / "summary.json").read_text())


def _live_actors(hosts) -> dict[str, set[int]]:
    """The hosts (indices) of the live trainer ranks and servers, by actor class."""
    out: dict[str, set[int]] = {}
    for a in hosts.where():
        if a["state"] == "ALIVE":
            out.setdefault(a["class"], set()).add(hosts.host_of(a["host"]))
    return out


def _watch(hosts, proc, timeout_s: float) -> tuple[str, dict[str, set[int]]]:
    """Wait for `proc` (its output), noting on which hosts its trainer ranks and servers ran meanwhile."""
    seen: dict[str, set[int]] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            for cls, where in _live_actors(hosts).items():
                seen.setdefault(cls, set()).update(where)
            time.sleep(2)
        out, _ = proc.communicate(timeout=max(deadline - time.monotonic(), 1))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return out, seen


def _model_bytes(hosts) -> int:
    return sum(f.stat().st_size for f in hosts.models.rglob("*.safetensors"))


def _run_over_three_hosts(hosts, name: str, *planes: str) -> None:
    steps = 6
    rx0 = hosts.link_bytes(2)[0]
    proc = hosts.popen(name, steps, *planes, "trainer.save_every=3")
    out, seen = _watch(hosts, proc, 360)
    assert proc.returncode == 0, out[-4000:]
    summary = _summary(hosts, name)
    assert summary["steps"] == steps, summary
    acc = hosts.account(name, proc.returncode)
    assert acc["lost"] == 0 and acc["trained_twice"] == 0 and acc["last_step"] == steps, acc
    assert acc["trained"] == steps * 4 * 4, acc  # every step trained its 4 groups of 4, once

    # where it ran: the trainer's two ranks on hosts 0 and 1, one server on each of hosts 1 and 2
    assert seen.get("TrainerRankActor") == {0, 1} and seen.get("ServerActor") == {1, 2}, seen
    lines = [line for line in out.splitlines() if line.startswith("asyncrl: trainer rank")]
    assert lines and "10.213.0.1 (eth0)" in lines[-1] and "10.213.0.2 (eth0)" in lines[-1], lines
    status = json.loads((hosts.run_dir(name) / "status_final.json").read_text())
    servers = [s for f in status["fleets"].values() for s in f["servers"]]
    assert [s["version"] for s in servers] == [steps, steps], servers  # both loaded the trainer's last weights

    # the weights crossed the bridge: host 2's server received every publish over its link
    rx = hosts.link_bytes(2)[0] - rx0
    publishes = steps + 1  # version 0, then one per step
    assert rx >= _model_bytes(hosts) * publishes, (rx, _model_bytes(hosts))

    # each host's /dev/shm holds only what its own processes made: no queue segment of this run on any host
    # (zmq and nixl keep tensors in the servers' processes, not in /dev/shm)
    for h in range(hosts.c.n):
        mine = [f for f in hosts.c.shm_files(h) if name in f]
        assert not mine, (h, mine)


def test_a_run_over_three_hosts_trains_with_gloo_and_zmq_losing_nothing(hosts):
    _run_over_three_hosts(hosts, "three-gloo", *GLOO_ZMQ)


def test_a_run_over_three_hosts_trains_with_nixl_on_both_planes(hosts):
    pytest.importorskip("nixl_cu12", reason="nixl is not installed (pip install nixl-cu12)")
    _run_over_three_hosts(hosts, "three-nixl", "weights.backend=nixl", "queue.storage=nixl")


def test_servers_on_another_host_join_the_version_0_publish(hosts):
    """The two-machine recipe of deploy/local/README.md on two simulated hosts: the trainer on host 0, the
    servers on host 1 (before, they dialed 127.0.0.1 on their own host, never joined the version-0 publish
    and the run stopped with `router: no active rollout server` after 4 restarts)."""
    name = "two-node"
    done = hosts.train(name, 2, *GLOO_ZMQ, "trainer.num_ranks=1", "queue.metadata=memory", timeout=300,
                       trainer_on="host0", servers_on="host1")
    assert done.returncode == 0, done.stdout[-4000:]
    assert "not joined" not in done.stdout and "restart of" not in done.stdout, done.stdout[-3000:]
    line = [l for l in done.stdout.splitlines() if l.startswith("asyncrl: servers ")]
    assert line and line[0].count("on 10.213.0.2 (eth0)") == 2, line  # where they run, and their sockets' interface
    status = json.loads((hosts.run_dir(name) / "status_final.json").read_text())
    versions = [s["version"] for f in status["fleets"].values() for s in f["servers"]]
    assert versions == [2, 2], status["fleets"]


@pytest.mark.parametrize("keys, error", [
    (("queue.storage=shm",), "queue.storage=shm: this data plane does not cross hosts"),
    (("weights.backend=shm",), "weights.backend=shm: this weight plane does not cross hosts"),
    (("weights.host=127.0.0.1",), "weights.host=127.0.0.1: a loopback address is reached from its own host only"),
    (("queue.bind_host=127.0.0.1",), "queue.bind_host=127.0.0.1: a loopback address is reached from its own host only"),
])
def test_a_plane_that_cannot_cross_hosts_is_a_config_error_before_anything_starts(hosts, keys, error):
    done = hosts.train("bad-plane", 2, *GLOO_ZMQ, "queue.metadata=memory", "trainer.num_ranks=1", *keys, timeout=120,
                       trainer_on="host0", servers_on="host2")
    assert done.returncode != 0
    line = [l for l in done.stdout.splitlines() if l.startswith("asyncrl: config error")]
    assert line and error in line[0] and "10.213.0.1" in line[0] and "10.213.0.3" in line[0], done.stdout[-2000:]
    assert "asyncrl: trainer rank" not in done.stdout  # nothing started


def test_a_placement_known_only_at_start_is_the_same_config_error_then(hosts):
    """Unpinned roles may land on one host; once placed over several, shm cannot serve them."""
    done = hosts.train("late-plane", 2, "weights.backend=gloo", "queue.storage=shm", "queue.metadata=memory",
                       "trainer.num_ranks=1", "rollout.num_servers=3", "rollout.placement_strategy=SPREAD", timeout=180,
                       trainer_on="host0", servers_on="any_host")
    assert done.returncode != 0
    line = [l for l in done.stdout.splitlines() if l.startswith("asyncrl: config error")]
    assert line and "queue.storage=shm: this data plane does not cross hosts" in line[0], done.stdout[-2000:]
    assert "the trainer ranks run on 10.213.0.1" in line[0], line
