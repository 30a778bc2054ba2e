"""Faults in the live pipeline with Ray: rollout servers that die or hang mid-run.

Real Ray actors in their own processes; the faults are real signals to their processes: SIGKILL
(a crash) and SIGSTOP (a hung process that keeps its sockets open and never answers). The run
must finish every step, train no sample twice, and end with every server healthy at the last
version. A dead trainer rank and a dead controller are covered by `asyncrl bench chaos` and
`tests/integration/test_resume_redis.py`.
"""

import asyncio
import json
import os
import signal
import threading
import time

import pytest

from asyncrl.config import load
from asyncrl.controller import Pipeline
from asyncrl.launch import build
from asyncrl.metrics import MetricsLogger

STEPS = 400
"""An upper bound: once both faults are recovered the injector ends the run a few steps later
(it lowers `trainer.total_steps`, which the train loop reads each step)."""


def _pid(server) -> int:
    import ray

    return ray.get(server.handle.pid.remote(), timeout=30)


def _inject(holder: dict, log: list, stop: threading.Event) -> None:
    """Kill one server after step 2; once it is back, stop (hang) another."""

    def wait_for(cond, timeout=240):
        t0 = time.time()
        while not cond():
            if stop.is_set() or time.time() - t0 > timeout:
                raise TimeoutError(f"fault injector: condition not met; injected so far {log}")
            time.sleep(0.1)

    wait_for(lambda: "p" in holder and holder["p"].step >= 2)
    p = holder["p"]
    victim = p.parts.fleets.router.servers[0]
    pid = _pid(victim)
    os.kill(pid, signal.SIGKILL)
    log.append(("kill", victim.name, pid))
    wait_for(lambda: p.parts.fleets.restarts >= 1 and len(p.parts.fleets.router.servers) == 2)
    victim = p.parts.fleets.router.servers[-1]
    pid = _pid(victim)
    os.kill(pid, signal.SIGSTOP)
    log.append(("hang", victim.name, pid))
    wait_for(lambda: p.parts.fleets.restarts >= 2 and len(p.parts.fleets.router.servers) == 2)
    p.cfg.trainer.total_steps = p.step + 3
    log.append(("end", "", p.cfg.trainer.total_steps))


@pytest.mark.timeout(600)
def test_server_killed_and_server_hung_mid_run_the_run_goes_on(tmp_path):
    ray = pytest.importorskip("ray")
    cfg = load("configs/demo.yaml", [
        "ray.enabled=true", "ray.num_cpus=4", "rollout.num_servers=2", "trainer.mode=fully_async",
        f"trainer.total_steps={STEPS}", "trainer.prompts_per_step=4", "rollout.group_size=4", "data.eval_size=4",
        "trainer.eval_every=100", "trainer.save_every=0", "logging.mlflow=false", "logging.progress=false",
        "rollout.health_timeout_s=3", "rollout.health_interval_s=1", "weights.timeout_s=5",
        f"queue.shm_dir={tmp_path}", f"model.cache_dir={tmp_path}/models",
    ])
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    metrics = MetricsLogger(cfg.logging, run_dir, {})
    holder, log, stop = {}, [], threading.Event()
    injector = threading.Thread(target=lambda: _guard(_inject, holder, log, stop), daemon=True)
    stopped = []
    try:
        parts = build(cfg)

        async def go():
            try:
                p = Pipeline(cfg, parts, run_dir, metrics)
                holder["p"] = p
                injector.start()
                return await p.run(), p
            finally:
                await parts.close()

        summary, pipeline = asyncio.run(go())
    finally:
        stop.set()
        injector.join(timeout=30)
        for kind, _, pid in log:
            if kind == "hang":
                stopped.append(pid)
                try:  # the fleet killed it; make sure nothing is left stopped
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        metrics.close()
        ray.shutdown()

    assert [k for k, *_ in log] == ["kill", "hang", "end"], (f"faults injected: {log}, injector error: {holder.get('error')}; steps {summary['steps']}, "
                                                     f"restarts {pipeline.parts.fleets.restarts}, routed {len(pipeline.parts.fleets.router.servers)}, "
                                                     f"fleet error {pipeline.parts.fleets._error!r}")
    steps = log[2][2]
    assert summary["steps"] == steps and summary["trained_samples"] == steps * 16
    audit = [json.loads(l) for l in (run_dir / "trained_uids.jsonl").read_text().splitlines()]
    uids = [u for line in audit for u in line["uids"]]
    assert len(uids) == len(set(uids)) == steps * 16, "a sample was trained twice"
    status = json.loads((run_dir / "status_final.json").read_text())
    fleets = status["fleets"]
    servers = [s for f in fleets.values() if isinstance(f, dict) and "servers" in f for s in f["servers"]]
    assert len(servers) == 2 and all(s["healthy"] and s["version"] == steps for s in servers), servers
    assert pipeline.parts.fleets.restarts >= 2  # the killed one and the hung one were both replaced
    hung_name = log[1][1]
    found = pipeline.parts.fleets.probe_failures + int(hung_name in pipeline.parts.fleets.evicted)
    assert found >= 1, "the hung server was found by neither a probe nor a publish"


def _guard(fn, holder, log, stop):
    try:
        fn(holder, log, stop)
    except BaseException as e:  # reported by the test's first assertion
        holder["error"] = repr(e)
