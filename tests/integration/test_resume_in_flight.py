"""Kill -9 a run after a checkpoint and resume it: the work the checkpoint held is not generated again.

A real `asyncrl train` (fully_async, eta 4, admission by the bound alone so groups are always in
flight, 96-token responses: the tiny model rarely stops early) is SIGKILLed after its latest checkpoint
and a later publish, then resumed. The checkpoint's `async_state.msgpack` holds the in-process queue's
records and every running group with what its samples had generated. After the resume:
- in-process (`memory`) queue: every queued record of the checkpoint is trained (the same uid: put
  back, not regenerated); every sample in flight at the checkpoint is either continued from its saved
  tokens (the tokens and their versions from before the kill begin its response) or counted as redone;
- durable (`redis`) queue: a group in flight at the checkpoint that reached the queue before the kill is
  neither continued nor generated again (found in the queue, counted), the others are continued or redone;
  nothing is lost and nothing trained twice.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from asyncrl.rollout.resume import read_async_state
from tests.integration.transfer_queue._redis import RedisServer
from transfer_queue import TransferQueueConfig, connect


def _cmd(tmp_path, *extra):
    return [
        sys.executable, "-m", "asyncrl.cli", "train", "configs/demo.yaml",
        "trainer.mode=fully_async", "trainer.max_staleness=4", "trainer.admission=bound", "trainer.total_steps=8",
        "trainer.save_every=2", "trainer.prompts_per_step=4", "rollout.group_size=4", "rollout.max_tokens=96",
        "data.eval_size=4", "trainer.eval_every=100",
        f"logging.run_root={tmp_path}/runs", "logging.run_name=r", "logging.mlflow=false", "logging.progress=false",
        f"model.cache_dir={tmp_path}/models", *extra,
    ]


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _latest(run):
    done = sorted(int(p.name.split("_")[1]) for p in (run / "checkpoints").glob("step_*") if (p / "state.json").exists())
    return done[-1] if done else 0


def _published(run):
    p = run / "published_version.json"
    return json.loads(p.read_text())["version"] if p.exists() else -1


def _kill_and_resume(tmp, *extra, also=lambda ckpt: True, between=lambda: None):
    """Run, SIGKILL after the latest checkpoint, a step and a publish after it (and `also(checkpoint dir)`),
    `between()`, resume."""
    run = tmp / "runs" / "r"
    proc = subprocess.Popen(_cmd(tmp, *extra), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.time() + 180
    while time.time() < deadline and proc.poll() is None:
        ckpt, steps = _latest(run), _lines(run / "trained_uids.jsonl")
        if (ckpt >= 2 and steps and steps[-1]["step"] > ckpt and _published(run) > ckpt
                and also(run / "checkpoints" / f"step_{ckpt:06d}")):
            break
        time.sleep(0.02)
    assert proc.poll() is None, ("the run ended before a checkpoint it took held the work the test needs",
                                 proc.stderr.read().decode()[-3000:])
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    ckpt = _latest(run)
    before = _lines(run / "trained_uids.jsonl")
    published = _published(run)
    saved = read_async_state(run / "checkpoints" / f"step_{ckpt:06d}")
    gc = between()
    out = subprocess.run(_cmd(tmp, *extra, "resume=true"), capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    after = _lines(run / "trained_uids.jsonl")[len(before):]
    return {"ckpt": ckpt, "published": published, "saved": saved, "before": before, "after": after,
            "summary": json.loads((run / "summary.json").read_text()), "resumed": _lines(run / "resumed_samples.jsonl"),
            "gc": gc}


def _holds_queued_and_midway(ckpt):  # the checkpoint the tests read holds both kinds of work: kill now
    saved = read_async_state(ckpt)
    return bool(saved and saved.queued and any(p.tokens > 0 for g in saved.groups for p in g.partial))


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    # a checkpoint taken between two samples' tokens holds none mid-way: wait for the next one then
    return _kill_and_resume(tmp_path_factory.mktemp("resume_memory"), also=_holds_queued_and_midway)


@pytest.fixture(scope="module")
def resumed_redis(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("resume_redis")
    (tmp / "shm").mkdir()
    redis = RedisServer(str(tmp))
    queue = connect(TransferQueueConfig(metadata="redis", redis_url=redis.url, run_id="inflight", storage="local"))

    def reached_the_queue(ckpt):  # a group in flight at the checkpoint has been queued since: kill now
        saved = read_async_state(ckpt)
        return bool(saved and queue.metadata.groups_held([g.group_id for g in saved.groups]))

    def gc():  # what a next run's start (or `asyncrl status --gc`) does to the killed run's files
        before = sorted(p.name for p in (tmp / "shm").iterdir())
        out = subprocess.run([sys.executable, "-m", "asyncrl.cli", "status", "--gc", "--json", "--shm-dir", f"{tmp}/shm"],
                             capture_output=True, text=True, timeout=60)
        return {"before": before, "after": sorted(p.name for p in (tmp / "shm").iterdir()),
                "report": json.loads(out.stdout)["shm_gc"] if out.returncode == 0 else out.stderr}

    try:
        res = _kill_and_resume(tmp, "queue.metadata=redis", f"queue.redis_url={redis.url}", "queue.run_id=inflight",
                               "queue.lease_timeout_s=6", "queue.shm_arena_bytes=0", f"queue.shm_dir={tmp}/shm",
                               also=reached_the_queue, between=gc)
        res["stats"] = queue.stats()
        queue.close()
        return res
    finally:
        redis.stop()


@pytest.mark.timeout(420)
def test_queued_records_at_the_checkpoint_are_trained_after_the_resume_not_regenerated(resumed):
    saved, summary = resumed["saved"], resumed["summary"]
    queued = {r.uid for r in saved.queued}
    assert queued, "the checkpoint must hold queued records for the test to mean something"
    assert summary["resumed"] and summary["steps"] == 8 and summary["drops"] == {}
    assert summary["resume"]["queued_restored"] == len(queued)
    assert [line["step"] for line in resumed["after"]] == list(range(resumed["ckpt"] + 1, 9))
    trained = [u for line in resumed["after"] for u in line["uids"]]
    assert len(trained) == len(set(trained))
    assert queued <= set(trained)  # the records themselves (their uids): put back and trained


@pytest.mark.timeout(420)
def test_samples_in_flight_at_the_checkpoint_continue_from_their_saved_tokens(resumed):
    saved, summary, ckpt = resumed["saved"], resumed["summary"], resumed["ckpt"]
    partial = {p.uid: p for g in saved.groups for p in g.partial if p.tokens > 0}
    in_flight = sum(g.group_size - len(g.finished) for g in saved.groups)
    assert partial, "the checkpoint must hold samples generating mid-way for the test to mean something"
    counts = summary["resume"]
    assert counts["in_flight"] == in_flight and counts["saved_partial"] == len(partial)
    assert summary["samples_continued"] > 0
    assert summary["samples_continued"] + summary["redone"] == in_flight  # each one continued or redone, by count
    lines = {line["uid"]: line for line in resumed["resumed"]}
    continued = [line for line in lines.values() if line["fate"] == "continued"]
    assert len(continued) == summary["samples_continued"]
    trained = {u for line in resumed["after"] for u in line["uids"]}
    for line in continued:
        p = partial[line["uid"]]
        assert line["resumed_tokens"] == p.tokens  # continued from exactly what the checkpoint had
        # its tokens from before the kill keep their versions (at most the checkpoint's); those generated
        # after the resume carry the resume's version, above every version published before the kill
        assert line["resumed_max_version"] == max(p.calls[-1].versions) <= ckpt
        assert line["min_version"] <= ckpt
        if line["response_length"] > line["resumed_tokens"]:
            assert line["max_version"] > resumed["published"]
        assert line["uid"] in trained or summary["drops"]


@pytest.mark.timeout(420)
def test_durable_queue_groups_that_reached_it_before_the_kill_are_not_generated_again(resumed_redis):
    saved, summary, stats = resumed_redis["saved"], resumed_redis["summary"], resumed_redis["stats"]
    assert not saved.queued  # the durable queue keeps its records itself
    counts, n = summary["resume"], 4
    assert saved.groups, "the checkpoint must hold groups in flight for the test to mean something"
    assert counts.get("found_in_queue", 0) > 0  # finished after the checkpoint, queued before the kill
    assert counts.get("found_in_queue", 0) + counts.get("finished_restored", 0) + counts.get("in_flight", 0) == n * len(saved.groups)
    assert summary["samples_continued"] + summary["redone"] == counts.get("in_flight", 0)
    # the final model's steps: those up to the checkpoint, then the resumed run's; nothing twice, nothing lost
    effective = [line for line in resumed_redis["before"] if line["step"] <= resumed_redis["ckpt"]] + resumed_redis["after"]
    uids = [u for line in effective for u in line["uids"]]
    assert len(uids) == len(set(uids)) == 8 * 16
    gc = resumed_redis["gc"]  # the killed run's per-record files, which its resume reads, were kept by the gc
    assert gc["before"] and gc["after"] == gc["before"], gc
    assert "may read them" in " ".join(gc["report"]["kept"].values()) and gc["report"]["removed_files"] == 0, gc
    dropped = sum(stats.dropped["trainer"].values())
    assert stats.put == len(uids) + dropped + stats.resident, (stats.put, len(uids), dropped, stats.resident)
