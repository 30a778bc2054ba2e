"""64 embedded servers in one process finish a run and exit (issue 51, "no executor starvation").

Each embedded server's weight receiver used to wait for updates, and its engine to read them, on threads
of asyncio's shared default executor (min(32, cores + 4) threads: 6 here). With 16 servers those threads
were all taken, a publish (which every receiver takes bucket by bucket) could not finish, servers were
removed "out of routing (timeout)", and 6 steps took 292 s; with 64 the run did not finish. Now each
server waits and reads on a thread of its own (`checkpoint_engine.server_loop`). The real `asyncrl train`
CLI, cost-model servers and a cost-model trainer (no GPU in either; the weights are real and really
published to all 64), in its own process: it must finish every step, drop no server, and exit.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.timeout(180)
def test_64_embedded_servers_finish_and_exit(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "asyncrl.cli", "train", "rollout.backend=cost_model", "trainer.engine=cost_model",
         "rollout.num_servers=64", "trainer.total_steps=4", "logging.mlflow=false", "logging.progress=false",
         f"logging.run_root={tmp_path}/runs", "logging.run_name=many"],
        capture_output=True, text=True, timeout=150, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "out of routing" not in out.stderr, out.stderr[-3000:]
    summary = json.loads((tmp_path / "runs" / "many" / "summary.json").read_text())
    assert summary["steps"] == 4, summary
