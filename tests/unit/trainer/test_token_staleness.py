"""Token-level staleness (`trainer.staleness_level=token`) on a real FSDP2 rank: tokens generated
under a version older than eta leave the loss and carry no gradient; the fresh ones train as usual."""

import torch

from asyncrl.config import AlgorithmConfig, TrainerConfig
from asyncrl.trainer.engine import TrainerEngine
from asyncrl.trainer.synthetic import synthetic_batch

VOCAB = 100
STEP, ETA = 5, 1


def _engine(path, level):
    trainer = TrainerConfig(micro_batch_size=4, lr=3e-3, total_steps=10, minibatches=1, max_staleness=ETA, staleness_level=level)
    engine = TrainerEngine(path, trainer=trainer, algorithm=AlgorithmConfig(entropy_target=0.0))
    engine.step = STEP  # the version the batch is trained at
    return engine


def _batch():
    """Responses whose first policy tokens were generated at version 0 (age 5 > eta) and the rest at 4 (age 1)."""
    b = synthetic_batch(8, vocab_size=VOCAB, seed=4)
    live = b.loss_mask > 0
    first = live & (live.cumsum(dim=1) <= 2)  # the first two policy tokens of every row
    versions = torch.where(live, torch.where(first, 0, STEP - ETA), -1)
    return b.replace(token_versions=versions, old_logprobs=b.old_logprobs * b.loss_mask), first


def _step(path, level, batch):
    engine = _engine(path, level)
    try:
        metrics = engine.train_step(batch)
        return {k: v.clone() for k, v in engine.iter_full_params()}, metrics
    finally:
        engine.close()


def test_stale_tokens_carry_no_gradient(tiny_model_path):
    batch, stale = _batch()
    assert stale.any() and ((batch.loss_mask > 0) & ~stale).any()
    masked, m = _step(tiny_model_path, "token", batch)
    assert m["stale_token_fraction"] == stale.sum().item() / (batch.loss_mask > 0).sum().item()
    assert m["tokens"] == ((batch.loss_mask > 0) & ~stale).sum().item()  # normalised over the fresh tokens only
    assert m["token_staleness_mean"] > ETA
    fresh = ((batch.loss_mask > 0) & ~stale).sum().item()
    assert m["correction/age_1/tokens"] == fresh and "correction/age_gt1/tokens" not in m  # masked: not in the loss

    # the same step with those tokens' loss mask zeroed by hand, at group level: the same weights
    by_hand, _ = _step(tiny_model_path, "group", batch.replace(loss_mask=batch.loss_mask.masked_fill(stale, 0.0)))
    # what the stale tokens say (behavior log-probs, advantages) does not move the weights
    junk = batch.replace(old_logprobs=torch.where(stale, -20.0, batch.old_logprobs), advantages=torch.where(stale, 50.0, batch.advantages))
    junk_step, _ = _step(tiny_model_path, "token", junk)
    # and at group level the stale tokens do count (the check above could not pass by accident)
    unmasked, mg = _step(tiny_model_path, "group", batch)
    assert mg["stale_token_fraction"] == m["stale_token_fraction"] and mg["tokens"] == (batch.loss_mask > 0).sum().item()
    assert mg["correction/age_gt1/tokens"] == stale.sum().item() and mg["correction/age_1/tokens"] == fresh
    for name, w in masked.items():
        assert torch.allclose(w, by_hand[name], atol=1e-6), name
        assert torch.allclose(w, junk_step[name], atol=1e-6), name
    assert any(not torch.allclose(w, unmasked[name], atol=1e-6) for name, w in masked.items())


def test_minibatch_metrics_merge_keys_some_minibatches_lack():
    from asyncrl.trainer.step_metrics import merge_minibatch_metrics

    got = merge_minibatch_metrics([{"tokens": 4, "correction/age_1/tokens": 4, "correction/age_1/is_weight_mean": 1.0},
                                   {"tokens": 6, "correction/age_1/tokens": 2, "correction/age_1/is_weight_mean": 0.5,
                                    "correction/age_2/tokens": 4, "correction/age_2/is_weight_mean": 2.0}])
    assert got == {"tokens": 10, "correction/age_1/tokens": 6, "correction/age_1/is_weight_mean": 0.75,
                   "correction/age_2/tokens": 4, "correction/age_2/is_weight_mean": 2.0}
