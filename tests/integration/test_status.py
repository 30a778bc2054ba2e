"""`asyncrl status` against real tiny runs.

One pipeline runs in a background thread with a slow trainer (records queue up) while the
tests read its status: the JSON must match the queue's own accounting. The `--watch` view must
render in a pseudo-terminal and refresh when the run it watches reports (a run the test drives). Meanwhile an `asyncrl train` subprocess starts (so the two
overlap); it is killed with SIGKILL and its status must say dead.
"""

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pexpect
import pytest

from asyncrl.config import load
from asyncrl.controller import Pipeline
from asyncrl.launch import build
from asyncrl.metrics import MetricsLogger
from asyncrl.observe.command import main as status_main
from tests.integration.test_async_modes import SlowTrainer
from tests.integration.test_first_hour import interruptible, signal_masks

TINY = ["trainer.prompts_per_step=4", "rollout.group_size=4", "data.eval_size=4", "trainer.eval_every=100",
        "trainer.save_every=0", "logging.mlflow=false", "logging.progress=false"]


class BackgroundRun:
    """A real tiny pipeline on its own event loop thread; `call` runs a coroutine on that loop."""

    def __init__(self, tmp_path, steps: int, slow_s: float) -> None:
        cfg = load("configs/demo.yaml", [*TINY, "trainer.mode=fully_async", "trainer.max_staleness=2", f"trainer.total_steps={steps}"])
        self.parts = build(cfg)
        self.parts.trainer = SlowTrainer(self.parts.trainer, slow_s)
        self.run_dir = tmp_path / "run"
        self.run_dir.mkdir()
        self.metrics = MetricsLogger(cfg.logging, self.run_dir, {})
        self.pipeline = Pipeline(cfg, self.parts, self.run_dir, self.metrics)
        self.loop = asyncio.new_event_loop()
        self.summary = None
        self.thread = threading.Thread(target=self._main, daemon=True)
        self.thread.start()

    def _main(self) -> None:
        async def go():
            try:
                return await self.pipeline.run()
            finally:
                await self.parts.close()

        self.summary = self.loop.run_until_complete(go())
        self.metrics.close()

    def call(self, coro_fn):
        return asyncio.run_coroutine_threadsafe(coro_fn(), self.loop).result(timeout=60)

    def queue_stats(self):
        return self.call(self.pipeline.queue.client.stats)


@pytest.fixture(scope="module")
def victim(tmp_path_factory):
    """`asyncrl train` in a subprocess, started first so that it builds while the other tests run,
    and killed with SIGKILL as soon as its pipeline has reported once (it then stops taking CPU)."""
    root = tmp_path_factory.mktemp("runs")
    cmd = [sys.executable, "-m", "asyncrl.cli", "train", *TINY, "trainer.total_steps=1000",
           f"logging.run_root={root}", "logging.run_name=victim"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    path = root / "victim" / "status.json"

    def kill_once_reported():
        while proc.poll() is None:
            if path.exists() and "schema_version" in path.read_text():
                os.kill(proc.pid, signal.SIGKILL)
                break
            time.sleep(0.1)
        proc.wait()

    killer = threading.Thread(target=kill_once_reported, daemon=True)
    killer.start()
    yield proc, killer, root / "victim"
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    from checkpoint_engine.backends.shm import sweep_dead

    sweep_dead()  # the weight segments of the process this fixture killed (a new run's sender sweeps them too)


@pytest.fixture(scope="module")
def run(tmp_path_factory, victim):
    r = BackgroundRun(tmp_path_factory.mktemp("pipeline"), steps=5, slow_s=0.8)
    yield r
    r.thread.join(timeout=120)


def _status_json(capsys, *args) -> dict:
    assert status_main(list(args) + ["--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _wait_for(pred, timeout_s: float, what: str):
    t0 = time.time()
    while time.time() - t0 < timeout_s:
        out = pred()
        if out:
            return out
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


@pytest.mark.timeout(180)
def test_json_matches_the_queue_accounting_of_a_running_pipeline(run, capsys):
    path = run.run_dir / "status.json"
    _wait_for(path.exists, 90, "the first status snapshot")
    for _ in range(40):  # until the slow trainer lets records queue up
        before, t0 = run.queue_stats(), time.time()
        _wait_for(lambda: json.loads(path.read_text())["time"] > t0, 10, "a snapshot newer than the reference stats")
        snap = _status_json(capsys, "--run", str(run.run_dir))
        after = run.queue_stats()
        if snap["queue"]["ready"] > 0:
            break
        time.sleep(0.3)
    q, raw = snap["queue"], snap["queue"]["stats"]
    assert snap["schema_version"] == 1 and snap["state"] == "running" and snap["liveness"]["alive"]
    assert q["ready"] > 0, "a slow trainer should leave records waiting in the queue"
    # the figures shown are exactly the queue's own accounting at the snapshot's instant ...
    assert (q["ready"], q["leased"], q["waiting"]) == tuple(raw["depth"]["trainer"][k] for k in ("ready", "leased", "waiting"))
    assert (q["capacity"], q["resident"], q["complete_groups"], q["put"]) == (raw["capacity"], raw["resident"], raw["complete_groups"], raw["put"])
    assert q["acked"] == raw["acked"]["trainer"] and q["capacity"] == run.pipeline.cfg.queue.capacity
    assert snap["staleness"]["queue"] == {k: v for k, v in sorted(raw["staleness"]["trainer"].items(), key=lambda kv: int(kv[0])) if v}
    assert q["ready"] + q["leased"] + q["waiting"] == q["resident"]  # one consumer group
    # ... which the queue itself reported between the two stats taken around it
    assert before.put <= q["put"] <= after.put and before.acked["trainer"] <= q["acked"] <= after.acked["trainer"]
    delivered = lambda s: sum(s.staleness.get("trainer", {}).values())
    assert delivered(before) <= sum(snap["staleness"]["queue"].values()) <= delivered(after)
    assert max(int(k) for k in snap["staleness"]["queue"]) <= 2  # eta
    assert snap["fleets"]["main"]["servers"][0]["healthy"] and snap["rates"]["produced_per_s"] > 0


@pytest.mark.timeout(120)
def test_watch_view_renders_and_refreshes_in_a_pseudo_terminal(tmp_path):
    """The run the view watches is this test: it writes each snapshot (the real `SnapshotBuilder`
    over a stand-in pipeline, `tests/unit/observe/fake.py`) when it chooses, so a refresh is
    awaited for a change the test made, not for a background run's timing on a loaded machine."""
    from asyncrl.observe.reporter import write_json
    from asyncrl.observe.snapshot import SnapshotBuilder
    from asyncrl.run_state import PipelineSource
    from tests.unit.observe.fake import fake_pipeline

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    p = fake_pipeline(run_dir)
    builder = SnapshotBuilder(PipelineSource(p))

    def report(step: int) -> None:
        p.step = step
        write_json(run_dir / "status.json", asyncio.run(builder.build()))

    report(3)
    child = pexpect.spawn(sys.executable, ["-m", "asyncrl.cli", "status", "--run", str(run_dir), "--watch", "--interval", "0.2"],
                          dimensions=(45, 130), encoding="utf-8", timeout=60, cwd=os.getcwd(),
                          env=dict(os.environ, COLUMNS="130", LINES="45",  # under pytest rich would assume 80 columns
                                   PYTHONFAULTHANDLER="1"),  # a stuck view dumps its threads on SIGABRT (below)
                          preexec_fn=interruptible)
    try:
        for field in ("trainer", "3/300", "ready", "leased", "acked", "complete_groups", "staleness", "last batch",
                      "server-0", "in_flight", "tokens/s", "healthy", "drops", "heartbeats"):
            child.expect_exact(field)
        report(4)  # the run moves on: the next frames show it
        child.expect_exact("4/300")
    except pexpect.TIMEOUT:
        child.kill(signal.SIGABRT)
        child.expect(pexpect.EOF, timeout=10)
        pytest.fail(f"the view did not show the new snapshot within 60 s; its threads:\n{child.before[-6000:]}")
    child.sendintr()  # Ctrl-C in the terminal
    try:
        child.expect(pexpect.EOF, timeout=60)
    except pexpect.TIMEOUT:
        masks = signal_masks(child.pid)
        child.kill(signal.SIGABRT)
        child.expect(pexpect.EOF, timeout=10)
        pytest.fail(f"the view did not stop on Ctrl-C ({masks}); its threads:\n{child.before[-6000:]}")
    child.close()
    assert "Traceback" not in (child.before or "") and child.exitstatus == 0


@pytest.mark.timeout(150)
def test_finished_run_shows_its_end_state(run, capsys):
    run.thread.join(timeout=120)
    assert run.summary is not None
    snap = _status_json(capsys, "--run", str(run.run_dir))
    assert snap["state"] == "finished" and snap["liveness"]["status"] == "finished" and not snap["liveness"]["alive"]
    assert snap["trainer"]["step"] == 5
    assert snap["staleness"]["trained"] == run.summary["staleness_hist"]


@pytest.mark.timeout(150)
def test_killed_run_reads_as_dead(victim):
    proc, killer, run_dir = victim
    killer.join(timeout=120)
    assert proc.returncode == -signal.SIGKILL, "the training subprocess should have reported, then been killed"
    out = subprocess.run([sys.executable, "-m", "asyncrl.cli", "status", "--run", str(run_dir), "--json"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    snap = json.loads(out.stdout)
    assert snap["state"] == "running"  # its last word ...
    assert snap["liveness"]["status"] == "dead" and not snap["liveness"]["alive"]  # ... and what status makes of it
    assert "no heartbeat" in snap["liveness"]["detail"] and str(proc.pid) in snap["liveness"]["detail"]
    text = subprocess.run([sys.executable, "-m", "asyncrl.cli", "status", "--root", str(run_dir.parent)],
                          capture_output=True, text=True, timeout=60)
    assert text.returncode == 0 and "dead (no heartbeat" in text.stdout and "Traceback" not in text.stderr
