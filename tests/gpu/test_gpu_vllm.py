"""The vLLM GPU engine (multiprocess AsyncLLM, the GPU path): generate, a weight update through
the weight plane into the engine's worker (it receives the buckets itself), the prefix cache
dropped with it, and its log-probs against the trainer's on the same tokens."""

from __future__ import annotations

from tests.gpu import GPU

import asyncio

import pytest
import torch

LONG_PROMPT = [1] + [10 + (7 * 2 + j) % 90 for j in range(40)] * 4


pytestmark = GPU

def test_vllm_gpu_generate_update_cache_and_logprobs(tiny_model, tiny_model_b):
    pytest.importorskip("vllm")
    from safetensors.torch import load_file

    from asyncrl.config import AlgorithmConfig, TrainerConfig
    from asyncrl.engines.base import SamplingParams
    from asyncrl.rollout.host import ServerHost
    from asyncrl.engines.vllm_engine import VLLMRolloutServer
    from asyncrl.trainer.batch import TrainBatch
    from asyncrl.trainer.engine import TrainerEngine
    from asyncrl.types import Trajectory
    from tests.integration.fleet.weights import weight_source

    async def go():
        server = VLLMRolloutServer(tiny_model, dtype="float32", seed=0, gpu_memory_utilization=0.2)
        host = ServerHost(server, name="gpu-0", agent=None, eval_agent=None, plane=None)
        trainer, _, cfg = weight_source(list(load_file(str(tiny_model_b / "model.safetensors")).items()))
        await host.join_weights(cfg, trainer.endpoints, "keep")
        sp = SamplingParams(max_tokens=32, seed=0)
        before = await server.generate(LONG_PROMPT, sp)  # caches the prompt's KV
        out = await trainer.publish(1, ["gpu-0"])
        after = await server.generate(LONG_PROMPT, sp)
        await host.close()
        trainer.impl.close()
        return before, after, out, server.version

    before, after, out, version = asyncio.run(go())
    assert out["completed"] == ["gpu-0"] and version == 1 and set(after.versions) == {1}

    engine = TrainerEngine(str(tiny_model_b), trainer=TrainerConfig(device="cuda"), algorithm=AlgorithmConfig())
    try:
        t = Trajectory("u", "g", 0, 1, LONG_PROMPT, after.token_ids, after.logprobs, [1] * len(after.token_ids),
                       after.versions, 1, 1)
        batch = TrainBatch.from_trajectories([t], [0.0], pad_id=0)
        lp = engine.compute_logprobs(batch)[0, len(LONG_PROMPT):len(LONG_PROMPT) + len(after.token_ids)]
        gap = (lp - torch.tensor(after.logprobs)).abs().max().item()
        assert gap < 1e-3, gap  # the new weights, not the cached KV of the old ones
    finally:
        engine.close()
    assert before.token_ids != after.token_ids or before.logprobs != after.logprobs
