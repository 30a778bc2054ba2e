"""The rollout engine's per-token log-probs against the trainer's `compute_logprobs` on the same tokens.

This is what the importance ratio rests on: behavior log-probs from the servers and the
trainer's log-probs of the same tokens must agree when the weights are the same.
"""

import asyncio

import pytest
import torch

from asyncrl.config import AlgorithmConfig, TrainerConfig
from asyncrl.data.tiny_model import ensure_tiny_model
from asyncrl.engines.base import SamplingParams
from asyncrl.engines.torch_engine import TorchRolloutServer
from asyncrl.trainer.batch import TrainBatch
from asyncrl.trainer.engine import TrainerEngine
from asyncrl.types import Trajectory


@pytest.mark.timeout(240)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_torch_engine_logprobs_match_trainer(tmp_path, temperature):
    path = str(ensure_tiny_model(tmp_path / "models"))
    prompts = [[5 + i % 10 for i in range(n)] for n in (3, 7, 12, 5)]

    async def generate():
        server = TorchRolloutServer(path, seed=3)
        try:
            sp = SamplingParams(temperature=temperature, max_tokens=16)
            return await asyncio.gather(*(server.generate(p, sp) for p in prompts))
        finally:
            await server.close()

    outs = asyncio.run(generate())
    trajs = [
        Trajectory(uid=str(i), group_id="g", index_in_group=i, group_size=len(prompts), prompt_ids=p,
                   response_ids=o.token_ids, behavior_logprobs=o.logprobs, loss_mask=[1] * len(o.token_ids),
                   token_versions=o.versions, min_version=0, max_version=0)
        for i, (p, o) in enumerate(zip(prompts, outs))
    ]
    assert all(len(t.response_ids) > 0 for t in trajs)
    batch = TrainBatch.from_trajectories(trajs, [0.0] * len(trajs), pad_id=0)
    trainer = TrainerEngine(path, trainer=TrainerConfig(), algorithm=AlgorithmConfig(), temperature=temperature)
    try:
        lp = trainer.compute_logprobs(batch)
    finally:
        trainer.close()
    mask = batch.loss_mask.bool()
    gap = (lp[mask] - batch.old_logprobs[mask]).abs().max().item()
    print(f"torch engine vs trainer max |logprob gap| at T={temperature}: {gap:.2e}")
    assert mask.sum() == sum(len(t.response_ids) for t in trajs)
    assert gap <= 1e-4
