"""A trainer rank killed mid-run: `asyncrl train` restarts the trainer's processes from the last
checkpoint and finishes every step; the rollout server's process is kept (it joins the new trainer).

Real: `asyncrl train` in a subprocess with Ray, two FSDP2 rank actors and a rollout server; the
fault is SIGKILL to one rank's process (found among the run's own descendants by its Ray
process title)."""

import json
import signal
import subprocess
import sys
import time

import psutil
import pytest

STEPS = 12
"""The kill comes right after the first checkpoint (step 3): the steps after it are the resumed segment."""


def _actors(pid: int, title: str = "ray::TrainerRankActor") -> list[psutil.Process]:
    out = []
    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return out
    for p in children:
        try:
            if title in " ".join(p.cmdline()):
                out.append(p)
        except psutil.Error:
            pass
    return out


@pytest.mark.timeout(480)
def test_killed_trainer_rank_restarts_from_the_last_checkpoint(tmp_path):
    pytest.importorskip("ray")
    run_dir = tmp_path / "runs" / "restart"
    cmd = [sys.executable, "-m", "asyncrl.cli", "train", "configs/demo.yaml", "ray.enabled=true", "ray.num_cpus=4",
           "trainer.num_ranks=2", "rollout.num_servers=1", f"trainer.total_steps={STEPS}", "trainer.save_every=3",
           "trainer.prompts_per_step=4", "rollout.group_size=4", "data.eval_size=4", "trainer.eval_every=100",
           "logging.mlflow=false", "logging.progress=false", f"logging.run_root={tmp_path}/runs", "logging.run_name=restart",
           f"queue.shm_dir={tmp_path}", f"model.cache_dir={tmp_path}/models"]
    log = open(tmp_path / "out.log", "w+")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True)
    killed = None
    servers: set[int] = set()
    try:
        t0 = time.time()
        while proc.poll() is None and time.time() - t0 < 400:
            servers.update(p.pid for p in _actors(proc.pid, "ray::ServerActor"))
            saved = list((run_dir / "checkpoints").glob("*/state.json"))
            ranks = _actors(proc.pid)
            if killed is None and saved and len(ranks) == 2:  # past the first complete checkpoint (step 3), both ranks up
                killed = ranks[1].pid
                ranks[1].send_signal(signal.SIGKILL)
            time.sleep(0.2)
        proc.wait(timeout=60)
        log.seek(0)
        out = log.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert killed is not None, f"no rank was killed; output:\n{out[-3000:]}"
    assert proc.returncode == 0, out[-4000:]
    assert "restarting the trainer from the last checkpoint (1 of trainer.max_restarts=2)" in out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == STEPS and summary["trainer_restarts"] == 1 and summary["resumed"]
    steps = [json.loads(l)["step"] for l in (run_dir / "trained_uids.jsonl").read_text().splitlines()]
    assert sorted(set(steps)) == list(range(1, STEPS + 1))  # every step trained (re-done ones appear again)
    assert not psutil.pid_exists(killed) or psutil.Process(killed).status() == psutil.STATUS_ZOMBIE
    # the trainer restarted; the rollout server's process served on (a server left waiting for the dead
    # trainer's update held the join to the new trainer past rollout.health_timeout_s and was replaced as hung)
    assert len(servers) == 1, f"server processes {sorted(servers)}, fleet {summary['fleet']}; output:\n{out[-4000:]}"
