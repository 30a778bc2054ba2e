"""The pipeline with Ray placement: two FSDP2 trainer ranks and two rollout servers, each an actor in
its own process. Trajectories are written by the servers' hosts and read by the ranks; weights go
from rank 0 to the servers' receivers. This process, the controller, must see metadata only: it
reads no trajectory tensor from any data plane, receives no weight byte, and builds no `Sender`
or `Receiver` (the design before this one fetched every batch here and ran the weight plane here)."""

import asyncio
import json

import pytest

from asyncrl.config import load
from asyncrl.controller import Pipeline
from asyncrl.launch import build
from asyncrl.metrics import MetricsLogger


@pytest.mark.timeout(420)
def test_ray_pipeline_keeps_tensors_and_weights_out_of_the_controller(tmp_path, monkeypatch):
    ray = pytest.importorskip("ray")
    import checkpoint_engine.receiver
    import checkpoint_engine.sender
    from asyncrl.rollout.remote_server import RemoteServer
    from checkpoint_engine import Receiver
    from transfer_queue import StoragePlane

    built = []
    for cls in (checkpoint_engine.sender.Sender, checkpoint_engine.receiver.Receiver):
        init = cls.__init__
        monkeypatch.setattr(cls, "__init__", lambda self, *a, _init=init, **k: (built.append(type(self).__name__), _init(self, *a, **k))[1])
    read0, weights0, records0 = StoragePlane.delivered_bytes, Receiver.delivered_bytes, RemoteServer.delivered_record_bytes

    cfg = load("configs/demo.yaml", [
        "ray.enabled=true", "ray.num_cpus=4", "trainer.num_ranks=2", "rollout.num_servers=2", "trainer.mode=one_step_off",
        "trainer.total_steps=3", "trainer.prompts_per_step=4", "rollout.group_size=4", "data.eval_size=4",
        "trainer.eval_every=3", "logging.mlflow=false", "logging.progress=false", f"queue.shm_dir={tmp_path}",
        f"model.cache_dir={tmp_path}/models",
    ])
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    metrics = MetricsLogger(cfg.logging, run_dir, {})
    try:
        parts = build(cfg)

        async def go():
            try:
                p = Pipeline(cfg, parts, run_dir, metrics)
                return await p.run(), p
            finally:
                await parts.close()

        summary, pipeline = asyncio.run(go())
    finally:
        metrics.close()
        ray.shutdown()

    assert summary["steps"] == 3 and summary["trained_samples"] == 3 * 16
    lines = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines() if '"version"' in l]
    assert [l["version"] for l in lines] == [1, 2, 3]  # each step published to the actors
    assert max(l["staleness/max"] for l in lines) <= 1
    assert all(l["train/read_bytes"] > 0 for l in lines)  # the ranks read the tensors themselves
    status = json.loads((run_dir / "status_final.json").read_text())
    servers = [s for f in status["fleets"].values() for s in f["servers"]]
    assert len(servers) == 2 and all(s["version"] == 3 and s["healthy"] for s in servers)

    assert built == [], f"the controller built {built}"
    assert StoragePlane.delivered_bytes == read0, "the controller read trajectory tensors"
    assert Receiver.delivered_bytes == weights0, "the controller received weights"
    q = pipeline.queue
    assert q.records >= 3 * 16 and q.records % 4 == 0 and q.inline_tensor_bytes == 0
    per_record = (RemoteServer.delivered_record_bytes - records0) / q.records  # as the records came over the wire
    assert 300 < per_record <= 2048, per_record
    assert not list(tmp_path.glob("tq-*")), "the servers' arenas were removed at the end"


@pytest.mark.timeout(720)
def test_demo_with_two_trainer_ranks_on_ray_learns(tmp_path):
    """The default job, its trainer split over two FSDP2 rank actors, learns: held-out reward from
    about 0.02 to 0.5, where the run stops (0.7 is reached too, later: the figures below; 0.5 keeps
    the suite short). Why not the demo's 0.8: this tiny policy sits on plateaus
    (one digit position wrong: 0.72-0.77) until the adaptive entropy bonus has grown, and how long it
    stays there depends on the async schedule. Measured on this 2-core machine (0.5 s per step):
    before the admission pace, 0.8 at steps 50, 60 and 165 and once not within 300 steps (best
    0.77); with it, 0.75 from step 90 to 200 in one run. Every run reached 0.7 (by step 90 with the pace)."""
    ray = pytest.importorskip("ray")
    from asyncrl.cli import main

    args = ["train", "ray.enabled=true", "trainer.num_ranks=2", "trainer.target_reward=0.5",
            "logging.mlflow=false", "logging.progress=false", f"logging.run_root={tmp_path}/runs", "logging.run_name=r2",
            f"queue.shm_dir={tmp_path}", f"model.cache_dir={tmp_path}/models"]
    try:
        assert main(args) == 0
    finally:
        ray.shutdown()
    summary = json.loads((tmp_path / "runs" / "r2" / "summary.json").read_text())
    assert summary["reward_step0"] < 0.2 and summary["best_eval_reward"] >= 0.5, summary["curve"]
    assert summary["steps"] < 300  # stopped at the target
