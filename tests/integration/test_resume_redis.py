"""Kill the whole pipeline (trainer included) with SIGKILL mid-run and resume it from its checkpoint.

The queue is durable (a real redis-server, records' tensors in per-record shm files), the
trainer acks at its checkpoints: after the resume nothing acked is trained again, nothing
is lost (a record trained after the checkpoint but before the kill is redelivered, or
dropped by a counted rule), the staleness accounting continues from the checkpoint, and versions
never go back (the checkpoint's weights come back under a new, higher version).
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.integration.transfer_queue._redis import RedisServer
from transfer_queue import TransferQueueConfig, connect

ETA = 2


def _cmd(tmp_path, redis_url, *extra):
    return [
        sys.executable, "-m", "asyncrl.cli", "train", "configs/demo.yaml",
        "trainer.mode=fully_async", f"trainer.max_staleness={ETA}", "trainer.total_steps=10", "trainer.save_every=3",
        "trainer.prompts_per_step=4", "rollout.group_size=4", "data.eval_size=4", "trainer.eval_every=100",
        "queue.metadata=redis", f"queue.redis_url={redis_url}", "queue.run_id=resume", "queue.lease_timeout_s=6",
        "queue.shm_arena_bytes=0", f"queue.shm_dir={tmp_path}/shm",
        f"logging.run_root={tmp_path}/runs", "logging.run_name=r", "logging.mlflow=false", "logging.progress=false",
        f"model.cache_dir={tmp_path}/models", *extra,
    ]


def _steps(run):
    p = run / "trained_uids.jsonl"
    return [json.loads(l) for l in p.read_text().splitlines()] if p.exists() else []


@pytest.mark.timeout(420)
def test_kill_and_resume_loses_nothing_and_trains_nothing_twice(tmp_path):
    (tmp_path / "shm").mkdir()
    redis = RedisServer(str(tmp_path))
    run = tmp_path / "runs" / "r"
    try:
        proc = subprocess.Popen(_cmd(tmp_path, redis.url), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
        deadline = time.time() + 240
        while time.time() < deadline and proc.poll() is None and (not _steps(run) or _steps(run)[-1]["step"] < 5):
            time.sleep(0.1)
        assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        first = _steps(run)
        ckpt = max(int(p.name.split("_")[1]) for p in (run / "checkpoints").glob("step_*") if (p / "state.json").exists())
        killed_at = first[-1]["step"]
        assert ckpt < killed_at, "the kill must land after the checkpoint for the test to mean something"
        published = json.loads((run / "published_version.json").read_text())["version"]
        assert published > ckpt, "a version must have been published after the checkpoint"

        out = subprocess.run(_cmd(tmp_path, redis.url, "resume=true"), capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        summary = json.loads((run / "summary.json").read_text())
        assert summary["resumed"] and summary["steps"] == 10

        lines = _steps(run)
        second = lines[len(first):]
        assert [l["step"] for l in second] == list(range(ckpt + 1, 11))  # continues from the checkpoint
        effective = [l for l in first if l["step"] <= ckpt] + second
        uids = [u for l in effective for u in l["uids"]]
        assert len(uids) == len(set(uids)) == 10 * 16, "a record was trained twice across the resume"

        # trained after the checkpoint but before the kill (never acked): redelivered, or dropped and counted
        unacked = {u for l in first if l["step"] > ckpt for u in l["uids"]}
        retrained = {u for l in second for u in l["uids"]}
        stats = connect(TransferQueueConfig(metadata="redis", redis_url=redis.url, run_id="resume", storage="local")).stats()
        stale_dropped = stats.dropped.get("trainer", {}).get("stale", 0)
        assert len(unacked - retrained) <= stale_dropped, (len(unacked - retrained), stale_dropped)
        assert len(unacked & retrained) > 0

        # staleness accounting continues: the bound held on both sides of the resume
        metrics = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines() if '"staleness/max"' in l]
        assert metrics and all(m["staleness/max"] <= ETA for m in metrics)
        # versions never go back: the resumed run published the checkpoint's weights above every version
        # published before the kill, so the logged versions rise across the resume
        versions = [m["version"] for m in metrics]
        assert versions == sorted(set(versions)) and versions[-1] == 10 + published + 1 - ckpt, (versions, published, ckpt)
        state = json.loads((run / "checkpoints" / "step_000010" / "state.json").read_text())
        # (the version the checkpoint's weights came back as, the version they had)
        assert state["staleness"]["lineage"] == [[published + 1, ckpt]]
    finally:
        redis.stop()
