"""`ray.detached`: a controller killed on a Ray cluster leaves its actors serving; `resume=true` takes
them back (no actor is started anew, the run finishes every step; a server gone meanwhile is started
anew, alone), and a controller that never comes back costs its actors only `ray.orphan_timeout_s`: then
they end themselves and their placement groups.

Real: a Ray head of its own on 127.0.0.1 (`asyncrl/bench/cluster.py`, started by
deploy/ray/start_cluster.sh, in its own process group), `asyncrl train` in a subprocess (2 FSDP2 ranks,
2 torch servers, the in-memory queue: the servers' planes are emptied when taken back), SIGKILL to the
controller's process group only (the cluster lives on, as on a real cluster). What ran is read back
from Ray's GCS actor and placement-group tables, which keep dead entries.
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

GCS = """
import json, sys
import ray
from ray._private.state import actors, state
ray.init(address=sys.argv[1], log_to_driver=False, namespace="asyncrl")
out = {"actors": [{"class": a["ActorClassName"], "name": a.get("Name", ""), "state": a["State"], "pid": a.get("Pid", 0)}
                  for a in actors().values()],
       "placement_groups": [{"name": p["name"], "state": p["state"]} for p in ray.util.placement_group_table().values()]}
print(json.dumps(out))
"""


def _cmd(tmp: Path, address: str, name: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "asyncrl.cli", "train", "configs/demo.yaml", "ray.enabled=true", f"ray.address={address}",
            "ray.detached=true", "trainer.num_ranks=2", "rollout.num_servers=2", "trainer.total_steps=12", "trainer.save_every=4",
            "trainer.prompts_per_step=4", "rollout.group_size=4", "data.eval_size=4", "trainer.eval_every=100",
            "rollout.max_tokens=32", "logging.mlflow=false", "logging.progress=false", f"logging.run_root={tmp}/runs",
            f"logging.run_name={name}", f"queue.shm_dir={tmp}/shm", f"model.cache_dir={tmp}/models", *extra]


def _kill_after_first_checkpoint(cmd: list[str], run: Path, env: dict[str, str], log: Path) -> None:
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    t0 = time.time()
    while not list((run / "checkpoints").glob("*/state.json")):
        assert proc.poll() is None, log.read_text()[-3000:]
        assert time.time() - t0 < 240, "no checkpoint in 240 s"
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)  # the controller only: the cluster's processes are in another group
    proc.wait()


def _gcs(address: str, env: dict[str, str], run_id: str) -> dict:
    got = subprocess.run([sys.executable, "-c", GCS, address], env=env, capture_output=True, text=True, timeout=120)
    assert got.returncode == 0, got.stderr[-3000:]
    state = json.loads(got.stdout.strip().splitlines()[-1])
    return {"actors": [a for a in state["actors"] if a["name"].startswith(run_id)],
            "placement_groups": [p for p in state["placement_groups"] if p["name"].startswith(run_id)]}


@pytest.mark.timeout(600)
def test_a_killed_controllers_actors_are_taken_back_or_end_themselves(tmp_path):
    pytest.importorskip("ray")
    from asyncrl.bench.cluster import ray_head

    (tmp_path / "shm").mkdir()
    with ray_head(num_cpus=5) as (address, env, _):
        # 1. killed, then resumed: the same actors finish the run
        run = tmp_path / "runs" / "back"
        cmd = _cmd(tmp_path, address, "back", "ray.orphan_timeout_s=120")
        _kill_after_first_checkpoint(cmd, run, env, tmp_path / "killed.log")
        run_id = (run / "queue_run_id").read_text().strip()
        before = _gcs(address, env, run_id)
        assert sorted(a["class"] for a in before["actors"] if a["state"] == "ALIVE") == ["ServerActor"] * 2 + ["TrainerRankActor"] * 2
        done = subprocess.run(cmd + ["resume=true"], env=env, capture_output=True, text=True, timeout=400)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        assert "took back the run's 2 trainer ranks and 2 servers (ray.detached)" in done.stdout, done.stdout[-3000:]
        summary = json.loads((run / "summary.json").read_text())
        assert summary["steps"] == 12 and summary["resumed"], summary
        after = _gcs(address, env, run_id)
        # no actor was started anew (the GCS keeps every actor the run ever had), and the run ended them all
        assert sorted((a["class"], a["pid"]) for a in after["actors"]) == sorted((a["class"], a["pid"]) for a in before["actors"])
        assert {a["state"] for a in after["actors"]} == {"DEAD"} and {p["state"] for p in after["placement_groups"]} == {"REMOVED"}

        # 2. killed, and a server killed too while no controller ran: the ranks and the other server are
        # taken back, the dead server alone is started anew in its bundle (the chaos run found the whole
        # run started anew when a resume met a server the fleet was replacing)
        run = tmp_path / "runs" / "partial"
        cmd = _cmd(tmp_path, address, "partial", "ray.orphan_timeout_s=120")
        _kill_after_first_checkpoint(cmd, run, env, tmp_path / "partial.log")
        run_id = (run / "queue_run_id").read_text().strip()
        before = _gcs(address, env, run_id)
        servers = sorted(a["pid"] for a in before["actors"] if a["class"] == "ServerActor" and a["state"] == "ALIVE")
        os.kill(servers[0], signal.SIGKILL)
        done = subprocess.run(cmd + ["resume=true"], env=env, capture_output=True, text=True, timeout=400)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        assert "took back the run's 2 trainer ranks and 1 servers (ray.detached); 1 server gone, started anew" in done.stdout, \
            done.stdout[-3000:]
        assert json.loads((run / "summary.json").read_text())["steps"] == 12
        after = _gcs(address, env, run_id)
        ranks = lambda state: sorted(a["pid"] for a in state["actors"] if a["class"] == "TrainerRankActor")
        assert ranks(after) == ranks(before)  # the same rank processes trained to the end
        started = sorted(a["pid"] for a in after["actors"] if a["class"] == "ServerActor")
        assert servers[1] in started and len(started) == 3, after  # the live one kept, one new for the dead one

        # 3. killed, never resumed: its actors end themselves after ray.orphan_timeout_s
        run = tmp_path / "runs" / "orphan"
        _kill_after_first_checkpoint(_cmd(tmp_path, address, "orphan", "ray.orphan_timeout_s=10"), run, env, tmp_path / "orphan.log")
        run_id = (run / "queue_run_id").read_text().strip()
        t0 = time.time()
        while True:
            state = _gcs(address, env, run_id)
            if state["actors"] and {a["state"] for a in state["actors"]} == {"DEAD"}:
                break
            assert time.time() - t0 < 60, state
            time.sleep(1)
        assert len(state["actors"]) == 4 and {p["state"] for p in state["placement_groups"]} == {"REMOVED"}, state
