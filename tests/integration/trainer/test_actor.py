"""The Ray shell: one TrainerWorker behind TrainerGroup runs the engine's verbs (Ray start costs ~7 s)."""

import pytest
import torch

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.slow


def test_trainer_group_one_rank_runs_the_verbs(tiny_model_path):
    from asyncrl.config import AlgorithmConfig, TrainerConfig
    from asyncrl.trainer.actor import TrainerGroup
    from asyncrl.trainer.smoke import synthetic_batch

    batch = synthetic_batch(4, vocab_size=100, seed=7)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        group = TrainerGroup(1, tiny_model_path, trainer=TrainerConfig(micro_batch_size=2, threads=1, minibatches=1), algorithm=AlgorithmConfig())
        before = group.compute_logprobs(batch)
        assert before.shape == batch.input_ids.shape and before[batch.loss_mask > 0].lt(0).all()
        metrics = group.train_step(batch.replace(old_logprobs=before * batch.loss_mask))
        assert group.step == 1
        assert metrics["tokens"] == batch.num_tokens and metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-5)
        after = group.compute_logprobs(batch)
        assert not torch.allclose(before, after)  # the step changed the weights
        params = dict(group.iter_full_params())
        assert "lm_head.weight" in params and "model.embed_tokens.weight" in params
        assert params["lm_head.weight"].shape == (100, 128)
        group.close()
    finally:
        ray.shutdown()
