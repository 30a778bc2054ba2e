"""Faults that only exist with hosts, on the simulated cluster (`tests/hosts/conftest.py`): runs whose servers
are on hosts 1 and 3 (`fault_slot`, one each) while host 3 is cut off for a while, then killed whole (every
process on it, its link down). Host 3 holds nothing else (the trainer, the controller and Redis run on) and
its clocks run an hour ahead of the others'. Each run finishes every step with nothing lost and nothing
trained twice (the Redis queue's counters against the trained lineage: a record leaves only trained or by a
counted drop), and no publish waits past `weights.timeout_s`. A killed host boots again afterwards.
"""

from __future__ import annotations

import json
import time

import pytest

from tests.hosts.conftest import SKEW_S
from tests.hosts.runs import FAULT_RUN, TIMEOUT_S, events, output, rows, server_hosts, step, wait_for

pytestmark = pytest.mark.timeout(420)

def _finish(hosts, name: str, proc, steps: int) -> tuple[str, dict]:
    out = output(proc)
    assert proc.returncode == 0, out[-5000:]
    acc = hosts.account(name, proc.returncode)
    print(f"{name}: {acc}")
    assert acc["lost"] == 0 and acc["trained_twice"] == 0 and acc["last_step"] == steps, acc
    publish_s = [r["weights/publish_s"] for r in rows(hosts, name) if "weights/publish_s" in r]
    assert publish_s and max(publish_s) < TIMEOUT_S + 5, publish_s  # no publish waited past weights.timeout_s
    summary = json.loads((hosts.run_dir(name) / "summary.json").read_text())
    print(f"{name}: {acc}; failover {summary.get('failover')}; fleet {summary.get('fleet')}; publish_s max "
          f"{max(publish_s):.2f}; output: {[l for l in out.splitlines() if 'unreadable' in l or 'out of routing' in l][:6]}")
    return out, acc


def test_a_host_cut_off_for_12_s_is_ridden_out_and_a_clock_an_hour_ahead_sees_the_run_alive(hosts):
    """Host 3 is cut off for 12 s: reads of its records give up after `queue.read_timeout_s` (5 s here: those
    records are dropped, counted, and the trainer goes on), a publish meanwhile takes its server out of routing,
    and it is re-synced once the link is back (the cut is shorter than `rollout.health_timeout_s`: a live
    server, not a dead one). Whether the trainer steps during the cut depends on what it holds (requests
    stuck on the cut server hold admission slots: on a loaded host it may wait the cut out); no step waits
    longer than the cut and a read timeout. Before the cut, `asyncrl status --redis` run on host 3, whose clocks are an
    hour ahead, sees the run alive with a heartbeat seconds old."""
    name, steps = "partition", 60
    proc = hosts.popen(name, steps, *FAULT_RUN, "queue.read_timeout_s=5", "rollout.health_timeout_s=30", servers_on="fault_slot")
    wait_for(proc, "step 2 with servers on hosts 1 and 3", lambda: step(hosts, name) >= 2 and server_hosts(hosts) == [1, 3])
    status = hosts.c.run(3, ["asyncrl", "status", "--redis", "env", "--name", name, "--json"], env=hosts.env(3), timeout=60)
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
    logged = rows(hosts, name)
    times = [r["time"] for r in logged if r.get("step", 0) > 0]
    gap = max(b - a for a, b in zip(times, times[1:]))
    assert gap < (healed - cut) + 5 + 15, gap  # no step waited past the cut and a read timeout (and some slack)
    during = [r for r in logged if cut < r.get("time", 0) < healed]
    if during:  # a step published while host 3 was cut off: its server missed that publish, out of routing ...
        evicted = sum(r.get("weights/evicted", 0) for r in logged if cut < r.get("time", 0) < healed + 5)
        assert evicted >= 1, [(r["step"], r.get("weights/evicted")) for r in logged if r.get("time", 0) > cut]
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
    wait_for(proc, "step 2", lambda: step(hosts, name) >= 2)
    scaled = hosts.c.run(0, ["asyncrl", "scale", str(hosts.run_dir(name)), "--servers", "2"], timeout=120)
    assert scaled.returncode == 0, scaled.stdout + scaled.stderr
    wait_for(proc, "the grown server's join", lambda: any(e["kind"] == "join" for e in events(hosts, name)))
    joins = [e for e in events(hosts, name) if e["kind"] in ("join", "join_pending")]
    assert [e.get("via") for e in joins] == ["peer"], joins
    assert server_hosts(hosts) == [1, 3], server_hosts(hosts)
    start = [e for e in events(hosts, name) if e["kind"] == "start"]
    assert start and all(0 <= v < 120 for v in start[0]["startup"].values()), start  # no hour of skew in it

    killed_at = step(hosts, name)
    hosts.c.kill_host(3)
    try:
        out, acc = _finish(hosts, name, proc, steps)
    finally:
        hosts.c.revive(3)  # for the tests after this one: a host that boots again, a new Ray node
    preempts = [e for e in events(hosts, name) if e.get("kind") == "preempt"]
    assert preempts, events(hosts, name)  # its server counted as preempted
    summary = json.loads((hosts.run_dir(name) / "summary.json").read_text())
    assert summary["steps"] == steps and killed_at < steps, summary

