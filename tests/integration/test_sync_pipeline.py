"""End to end: `asyncrl train` in sync mode on the tiny model (real engine, real FSDP2 trainer), then resume."""

import json

import pytest

from asyncrl.cli import main


def _args(tmp_path, steps, *extra):
    return [
        "train",
        "configs/demo.yaml",
        "trainer.mode=sync",
        f"trainer.total_steps={steps}",
        "trainer.prompts_per_step=4",
        "trainer.eval_every=2",
        "trainer.save_every=2",
        "rollout.group_size=4",
        "data.eval_size=8",
        f"logging.run_root={tmp_path}/runs",
        "logging.run_name=e2e",
        f"logging.tracking_uri=sqlite:///{tmp_path}/mlflow.db",
        f"model.cache_dir={tmp_path}/models",
        *extra,
    ]


@pytest.mark.timeout(300)
def test_sync_run_then_resume(tmp_path):
    assert main(_args(tmp_path, 4)) == 0
    run = tmp_path / "runs" / "e2e"
    s1 = json.loads((run / "summary.json").read_text())
    assert s1["mode"] == "sync" and s1["steps"] == 4 and s1["trained_samples"] == 4 * 4 * 4
    assert [p[0] for p in s1["curve"]] == [0, 2, 4]
    assert (run / "reward_curve.png").stat().st_size > 1000
    assert (run / "config.yaml").exists() and (run / "checkpoints" / "step_000004" / "state.json").exists()
    steps = [json.loads(l)["step"] for l in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2, 3, 4]
    # staleness in sync mode is exactly 0 for every trained sample
    lines = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()[1:]]
    assert all(l["staleness/max"] == 0 for l in lines)
    assert all(0 < l["train/mismatch/ess"] <= 1 and "train/mismatch/logprob_gap_max" in l for l in lines)  # per step (docs/algorithms.md)

    # a second invocation of the same run name without resume refuses to overwrite checkpoints
    assert main(_args(tmp_path, 6)) == 2

    assert main(_args(tmp_path, 6, "resume=true")) == 0
    s2 = json.loads((run / "summary.json").read_text())
    assert s2["resumed"] and s2["steps"] == 6 and s2["trained_samples"] == 6 * 4 * 4
    assert [p[0] for p in s2["curve"]] == [0, 2, 4, 6]
    assert s2["curve"][:3] == s1["curve"]  # the curve continues, it does not restart
    steps = [json.loads(l)["step"] for l in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2, 3, 4, 5, 6]
    status = json.loads((run / "status.json").read_text())
    assert status["state"] == "finished" and status["step"] == 6
