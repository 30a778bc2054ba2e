"""An FSDP2 trainer step on CUDA (nccl process group of one rank), bf16 compute with fp32 masters:
the step moves the weights, the log-probs of positive-advantage tokens rise, and the published
full tensors come off the GPU in the model dtype."""

from __future__ import annotations

from tests.gpu import GPU

import torch


pytestmark = GPU

def test_fsdp2_step_on_cuda(tiny_model):
    from asyncrl.config import AlgorithmConfig, TrainerConfig
    from asyncrl.trainer.engine import TrainerEngine
    from asyncrl.trainer.synthetic import synthetic_batch

    engine = TrainerEngine(str(tiny_model), trainer=TrainerConfig(device="cuda", micro_batch_size=4, minibatches=1, lr=1e-3),
                           algorithm=AlgorithmConfig(entropy_target=0.0), dtype="bfloat16")
    try:
        assert engine.device.type == "cuda"
        batch = synthetic_batch(8, vocab_size=engine.model.config.vocab_size, seed=2)
        before = engine.compute_logprobs(batch)
        metrics = engine.train_step(batch.replace(old_logprobs=before * batch.loss_mask))
        after = engine.compute_logprobs(batch)
        assert metrics["grad_norm"] > 0 and abs(metrics["ratio_mean"] - 1) < 1e-2
        pos = (batch.advantages > 0) & (batch.loss_mask > 0)
        assert (after - before)[pos].mean() > 0
        params = dict(engine.iter_full_params(device="cuda"))
        assert all(t.is_cuda and t.dtype == torch.bfloat16 for t in params.values())
    finally:
        engine.close()
