"""The GSM8K recipe as written (vLLM on GPU, FSDP2 on CUDA, one GPU shared through CUDA IPC) on a
tiny local model and a handful of GSM8K-style rows, for 3 steps."""

from __future__ import annotations

from tests.gpu import GPU

import json

import pytest


pytestmark = GPU

def test_gsm8k_recipe_runs_three_steps(tiny_model, tmp_path):
    pytest.importorskip("vllm")
    import ray

    from asyncrl.cli import main

    rows = [{"question": f"What is {a} plus {b}?", "answer": f"{a} + {b} = {a + b}\n#### {a + b}"} for a in range(6) for b in range(6)]
    data = tmp_path / "gsm8k.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = ["train", "configs/gsm8k_qwen2.5_0.5b.yaml", f"model.path={tiny_model}", f"data.train_path={data}", "model.dtype=float32",
            "data.eval_size=4", "rollout.max_tokens=32", "trainer.total_steps=3", "trainer.prompts_per_step=4",
            "rollout.group_size=4", "trainer.micro_batch_size=8", "trainer.eval_every=3", "logging.mlflow=false",
            "logging.progress=false", f"logging.run_root={tmp_path}/runs", "logging.run_name=gsm8k"]
    try:
        assert main(args) == 0
    finally:
        ray.shutdown()
    summary = json.loads((tmp_path / "runs" / "gsm8k" / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["trained_samples"] == 3 * 16
    status = json.loads((tmp_path / "runs" / "gsm8k" / "status_final.json").read_text())
    assert all(s["version"] == 3 for f in status["fleets"].values() for s in f["servers"])
