"""The host of a trainer rank dies, on the simulated cluster (`tests/hosts/conftest.py`): the run restarts its
trainer, finds no room for it on the hosts left, stops with the command that resumes it, and that command (the
host back) finishes the run with nothing lost and nothing trained twice. Apart from `test_host_faults.py` (not
in the suite's serial chain, `tests/conftest.py` HEAVY): most of its time is Ray finding the node dead.
"""

from __future__ import annotations

import subprocess

import pytest

from tests.hosts.runs import TIMEOUT_S, output, step, wait_for

pytestmark = pytest.mark.timeout(420)


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
    wait_for(proc, "step 4", lambda: step(hosts, name) >= 4)
    hosts.c.kill_host(1)
    try:
        out = output(proc)
    finally:
        hosts.c.revive(1)
    assert proc.returncode == 1, out[-4000:]
    assert "restarting the trainer from the last checkpoint" in out, out[-4000:]
    stop = [l for l in out.splitlines() if l.startswith("asyncrl: stopped: trainer placement")]
    assert stop and "trainer.placement_timeout_s" in stop[0] and "resume with: asyncrl train" in stop[0], out[-4000:]
    resume = stop[0].split("resume with: ", 1)[1]
    assert "resume=true" in resume and f"logging.run_name={name}" in resume, resume

    # as printed, on host 0, in the environment the run was started in (its Redis URL: ASYNCRL_REDIS_URL)
    again = hosts.c.run(0, ["bash", "-c", resume], env=hosts.env(0), timeout=300, stderr=subprocess.STDOUT)
    assert again.returncode == 0, again.stdout[-4000:]
    acc = hosts.account(name, again.returncode)
    assert acc["lost"] == 0 and acc["trained_twice"] == 0 and acc["last_step"] == steps, acc
