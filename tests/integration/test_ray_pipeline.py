"""The pipeline with Ray placement: rollout servers as actors in a placement group, the trainer
pool as FSDP2 actor shells, weights through the CheckpointEngine into the actors."""

import json

import pytest

from asyncrl.cli import main


@pytest.mark.timeout(420)
def test_ray_placed_pipeline_trains_and_publishes(tmp_path):
    ray = pytest.importorskip("ray")
    args = [
        "train", "configs/demo.yaml", "ray.enabled=true", "ray.num_cpus=3", "trainer.mode=one_step_off",
        "trainer.total_steps=3", "trainer.prompts_per_step=4", "rollout.group_size=4", "data.eval_size=4",
        "trainer.eval_every=3", "logging.mlflow=false", "logging.progress=false",
        f"logging.run_root={tmp_path}/runs", "logging.run_name=ray", f"model.cache_dir={tmp_path}/models",
    ]
    try:
        assert main(args) == 0
    finally:
        ray.shutdown()
    run = tmp_path / "runs" / "ray"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["trained_samples"] == 3 * 16
    lines = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines() if '"version"' in l]
    assert [l["version"] for l in lines] == [1, 2, 3]  # each step published to the actors
    assert max(l["staleness/max"] for l in lines) <= 1
    status = json.loads((run / "status_final.json").read_text())
    servers = [s for f in status["fleets"].values() for s in f["servers"]]
    assert servers and all(s["version"] == 3 and s["healthy"] for s in servers)
