"""A killed run's shared memory does not outlive the need for it: real `asyncrl train` runs (the
embedded default: an in-memory queue, `shm` arenas) in one shm directory.

Run B trains on; run A is SIGKILLed mid-training (its arena stays: no process is left to remove it);
another uid's file under A's own prefix is planted. Run C then starts: its start removes A's arena and
mark and says so; B's arena (live) and the other user's file stay. B is then killed and
`asyncrl status` shows what it holds; `asyncrl status --gc` removes it. (A durable queue's run with a
checkpoint keeps its files for its resume: `tests/integration/test_resume_in_flight.py`.)
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


def _cmd(tmp: Path, name: str, steps: int) -> list[str]:
    return [sys.executable, "-m", "asyncrl.cli", "train", f"trainer.total_steps={steps}", "trainer.eval_every=1000",
            f"logging.run_root={tmp}/runs", f"logging.run_name={name}", "logging.mlflow=false", "logging.progress=false",
            f"queue.shm_dir={tmp}/shm", f"model.cache_dir={tmp}/models"]


def _files(shm: Path, run: Path) -> list[str]:
    run_id = (run / "queue_run_id").read_text().strip()
    return sorted(p.name for p in shm.iterdir() if p.name.startswith(f"tq-{run_id}-") or p.name == f"tq-{run_id}.run")


def _start(tmp: Path, name: str, steps: int) -> subprocess.Popen:
    """A run, once it has trained a step (its arena made)."""
    proc = subprocess.Popen(_cmd(tmp, name, steps), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    trained = tmp / "runs" / name / "trained_uids.jsonl"
    deadline = time.time() + 180
    while proc.poll() is None and time.time() < deadline and not (trained.exists() and trained.read_text().strip()):
        time.sleep(0.1)
    assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
    return proc


def _kill(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _status(tmp: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "asyncrl.cli", "status", "--root", f"{tmp}/runs", "--shm-dir", f"{tmp}/shm", *args],
                          capture_output=True, text=True, timeout=60)


@pytest.mark.timeout(400)
def test_a_killed_runs_arena_goes_at_the_next_start_and_a_live_runs_and_another_users_stay(tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir()
    b = _start(tmp_path, "b", 5000)
    try:
        a = _start(tmp_path, "a", 5000)
        _kill(a)
        a_files, b_files = _files(shm, tmp_path / "runs" / "a"), _files(shm, tmp_path / "runs" / "b")
        assert any(n.endswith("-arena") for n in a_files) and any(n.endswith(".run") for n in a_files), a_files
        a_id = (tmp_path / "runs" / "a" / "queue_run_id").read_text().strip()
        theirs = shm / f"tq-{a_id}-777-abcdef-arena"  # another user's, under the killed run's own prefix
        theirs.write_bytes(b"\0" * 4096)
        os.chown(theirs, 54321, 54321)
        snap = json.loads(_status(tmp_path, "--run", f"{tmp_path}/runs/a", "--json").stdout)
        assert snap["shm_dead"]["runs"] == 1 and snap["shm_dead"]["removable_bytes"] > 0, snap["shm_dead"]
        c = subprocess.run(_cmd(tmp_path, "c", 2), capture_output=True, text=True, timeout=240)
        assert c.returncode == 0, c.stderr[-3000:]
        assert f"from {tmp_path}/shm: 1 runs that are gone" in c.stdout, c.stdout[-2000:]
        left = sorted(p.name for p in shm.iterdir())
        assert not set(a_files) & set(left), left  # the killed run's arena and mark are gone
        assert set(b_files) <= set(left) and theirs.name in left, left  # the live run's and the other user's stay
        assert b.poll() is None
    finally:
        _kill(b)
    snap = json.loads(_status(tmp_path, "--run", f"{tmp_path}/runs/b", "--json").stdout)
    assert snap["shm_dead"]["runs"] == 1 and snap["shm_dead"]["files"] == len(b_files), snap["shm_dead"]
    out = _status(tmp_path, "--gc")
    assert out.returncode == 0 and ": 1 runs that are gone" in out.stdout, out.stdout + out.stderr
    assert sorted(p.name for p in shm.iterdir()) == [theirs.name]
    assert "nothing of a run that is gone" in _status(tmp_path, "--gc").stdout
