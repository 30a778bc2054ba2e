"""Faults that only exist with hosts, on the simulated cluster (`tests/hosts/conftest.py`): runs whose servers
are on hosts 1 and 3 (`fault_slot`, one each) while host 3 is cut off for a while, then killed whole (every
process on it, its link down). Host 3 holds nothing else (the trainer, the controller and Redis run on) and
its clocks run an hour ahead of the others'. Each run finishes every step with nothing lost and nothing
trained twice (the Redis queue's counters against the trained lineage: a record leaves only trained or by a
counted drop), and no publish waits past `weights.timeout_s`. A killed host boots again afterwards.
"""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from tests.hosts.conftest import SKEW_S

pytestmark = pytest.mark.timeout(420)

TIMEOUT_S = 10
FAULT_RUN = ("weights.backend=gloo", "queue.storage=zmq", "rollout.placement_strategy=SPREAD", "queue.read_timeout_s=15",
             f"weights.timeout_s={TIMEOUT_S}", "trainer.save_every=4")


def _rows(hosts, name: str) -> list[dict]:
    path = hosts.run_dir(name) / "metrics.jsonl"
    return [json.loads(l) for l in path.read_text().splitlines() if l.strip()] if path.exists() else []


def _events(hosts, name: str) -> list[dict]:
    path = hosts.run_dir(name) / "fleet_events.jsonl"
    return [json.loads(l) for l in path.read_text().splitlines() if l.strip()] if path.exists() else []


def _step(hosts, name: str) -> int:
    return max([r.get("step", 0) for r in _rows(hosts, name)] or [-1])


def _server_hosts(hosts) -> list[int]:
    return sorted(hosts.host_of(a["host"]) for a in hosts.where() if a["state"] == "ALIVE" and a["class"] == "ServerActor")


def _wait(proc, what: str, check, timeout_s: float = 240) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        if check():
            return
        time.sleep(1)
    out = proc.communicate(timeout=30)[0] if proc.poll() is not None else ""
    proc.kill()
    raise AssertionError(f"{what} did not happen: {out[-3000:]}")


def _finish(hosts, name: str, proc, steps: int) -> tuple[str, dict]:
    try:
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, out[-5000:]
    acc = hosts.account(name, proc.returncode)
    assert acc["lost"] == 0 and acc["trained_twice"] == 0 and acc["last_step"] == steps, acc
    publish_s = [r["weights/publish_s"] for r in _rows(hosts, name) if "weights/publish_s" in r]
    assert publish_s and max(publish_s) < TIMEOUT_S + 5, publish_s  # no publish waited past weights.timeout_s
    summary = json.loads((hosts.run_dir(name) / "summary.json").read_text())
    print(f"{name}: {acc}; failover {summary.get('failover')}; fleet {summary.get('fleet')}; publish_s max "
          f"{max(publish_s):.2f}; output: {[l for l in out.splitlines() if 'unreadable' in l or 'out of routing' in l][:6]}")
    return out, acc


def test_a_host_cut_off_for_12_s_is_ridden_out_and_a_clock_an_hour_ahead_sees_the_run_alive(hosts):
    """Host 3 is cut off for 12 s: reads of its records give up after `queue.read_timeout_s` (5 s here: those
    records are dropped, counted, and the trainer goes on), its server misses a publish and is taken out of
    routing, and is re-synced once the link is back (the cut is shorter than `rollout.health_timeout_s`: a
    live server, not a dead one). Before the cut, `asyncrl status --redis` run on host 3, whose clocks are an
    hour ahead, sees the run alive with a heartbeat seconds old."""
    name, steps = "partition", 60
    proc = hosts.popen(name, steps, *FAULT_RUN, "queue.read_timeout_s=5", "rollout.health_timeout_s=30", servers_on="fault_slot")
    _wait(proc, "step 2 with servers on hosts 1 and 3", lambda: _step(hosts, name) >= 2 and _server_hosts(hosts) == [1, 3])
    status = hosts.c.run(3, ["asyncrl", "status", "--redis", hosts.redis_url, "--name", name, "--json"], timeout=60)
    assert status.returncode == 0, status.stderr[-2000:]
    snap = json.loads(status.stdout)
    assert snap["liveness"]["alive"] and snap["liveness"]["heartbeat_age_s"] < 30, snap["liveness"]
    assert abs(snap["clock_offset_s"] - SKEW_S) < 30, snap["clock_offset_s"]

    cut = time.time()
    hosts.c.partition(3)
    try:
        time.sleep(12)
    finally:
        hosts.c.heal(3)
    healed = time.time()
    out, acc = _finish(hosts, name, proc, steps)
    rows = _rows(hosts, name)
    during = [r["step"] for r in rows if cut < r.get("time", 0) < healed]
    assert during, [(r.get("step"), r.get("time")) for r in rows]  # the trainer kept stepping while host 3 was cut off
    evicted = sum(r.get("weights/evicted", 0) for r in rows if cut < r.get("time", 0) < healed + 5)
    assert evicted >= 1, [(r["step"], r.get("weights/evicted")) for r in rows if r.get("time", 0) > cut]  # out of routing ...
    status = json.loads((hosts.run_dir(name) / "status_final.json").read_text())
    versions = [s["version"] for f in status["fleets"].values() for s in f["servers"]]
    assert versions == [steps, steps], status["fleets"]  # ... and brought back to the current weights


def test_a_server_grown_on_another_host_joins_from_a_peer_then_its_host_dies(hosts):
    """One server (host 1 or 3), grown to two with `asyncrl scale` (the other host: one `fault_slot` each),
    whose weights come from the first over the weight plane, across the bridge; its start-up split is in
    seconds although one of them runs on host 3, an hour ahead. Then host 3 dies whole: its server is a
    preemption, its records the trainer had not read are dropped as `unreadable` (counted), the run goes on
    with the other server."""
    name, steps = "grow-kill", 60
    # a publish every 4 steps leaves a peer's hand-out time to land between two (the demo steps in 0.3 s)
    proc = hosts.popen(name, steps, *FAULT_RUN, "rollout.num_servers=1", "trainer.publish_every=4", servers_on="fault_slot")
    _wait(proc, "step 2", lambda: _step(hosts, name) >= 2)
    scaled = hosts.c.run(0, ["asyncrl", "scale", str(hosts.run_dir(name)), "--servers", "2"], timeout=120)
    assert scaled.returncode == 0, scaled.stdout + scaled.stderr
    _wait(proc, "the grown server's join", lambda: any(e["kind"] == "join" for e in _events(hosts, name)))
    joins = [e for e in _events(hosts, name) if e["kind"] in ("join", "join_pending")]
    assert [e.get("via") for e in joins] == ["peer"], joins
    assert _server_hosts(hosts) == [1, 3], _server_hosts(hosts)
    start = [e for e in _events(hosts, name) if e["kind"] == "start"]
    assert start and all(0 <= v < 120 for v in start[0]["startup"].values()), start  # no hour of skew in it

    killed_at = _step(hosts, name)
    hosts.c.kill_host(3)
    try:
        out, acc = _finish(hosts, name, proc, steps)
    finally:
        hosts.c.revive(3)  # for the tests after this one: a host that boots again, a new Ray node
    preempts = [e for e in _events(hosts, name) if e.get("kind") == "preempt"]
    assert preempts, _events(hosts, name)  # its server counted as preempted
    summary = json.loads((hosts.run_dir(name) / "summary.json").read_text())
    assert summary["steps"] == steps and killed_at < steps, summary


def test_a_trainer_host_killed_stops_with_the_resume_command_and_the_resume_loses_nothing(hosts):
    """The host of trainer rank 1 (host 1; the servers run on host 3) dies whole: the rank's death restarts the
    trainer from its last checkpoint, whose two ranks find room on one host only (host 0: the hosts left hold one
    `trainer_slot`), so after `trainer.placement_timeout_s` the run stops with one line that carries the command
    resuming it. Host 1 boots again; that command, run as printed, finishes the run: over both segments nothing is
    lost and nothing trained twice."""
    name, steps = "trainer-host", 30
    extra = ("weights.backend=gloo", "queue.storage=zmq", "queue.read_timeout_s=10", f"weights.timeout_s={TIMEOUT_S}",
             "trainer.save_every=3", "trainer.placement_timeout_s=15", "rollout.num_servers=1")
    proc = hosts.popen(name, steps, *extra, servers_on="host3")
    _wait(proc, "step 4", lambda: _step(hosts, name) >= 4)
    hosts.c.kill_host(1)
    try:
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        hosts.c.revive(1)
    assert proc.returncode == 1, out[-4000:]
    assert "restarting the trainer from the last checkpoint" in out, out[-4000:]
    stop = [l for l in out.splitlines() if l.startswith("asyncrl: stopped: trainer placement")]
    assert stop and "trainer.placement_timeout_s" in stop[0] and "resume with: asyncrl train" in stop[0], out[-4000:]
    resume = stop[0].split("resume with: ", 1)[1]
    assert "resume=true" in resume and f"logging.run_name={name}" in resume, resume

    again = hosts.c.run(0, ["bash", "-c", resume], timeout=300, stderr=subprocess.STDOUT)  # as printed, on host 0
    assert again.returncode == 0, again.stdout[-4000:]
    acc = hosts.account(name, again.returncode)
    assert acc["lost"] == 0 and acc["trained_twice"] == 0 and acc["last_step"] == steps, acc
