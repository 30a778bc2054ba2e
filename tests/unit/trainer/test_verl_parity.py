"""Where asyncrl's losses meet verl's reference implementation (hand-computed values each; docs/verl.md):
GSPO aggregates per sequence whatever `algorithm.loss_agg` says, PPO clamps the log-ratio to [-20, 20]
before its exp, and Dr. GRPO's `seq_mean_token_sum_norm` is verl's divided by N, the sequences with
loss tokens (asyncrl keeps the mean over sequences, as the Dr. GRPO paper writes it)."""

from __future__ import annotations

import math

import pytest
import torch

from asyncrl.config import AlgorithmConfig, TrainerConfig
from asyncrl.trainer.losses import POLICY_LOSSES, LossInputs, PPOClipSettings, agg_loss


@pytest.mark.timeout(10)
def test_gspo_aggregates_seq_mean_token_mean_whatever_loss_agg_says():
    # row 0: one loss token, A = 2; row 1: three loss tokens, A = 1; on-policy (ratio 1, no clip): loss_t = -A
    lp = torch.zeros(2, 3, requires_grad=True)
    mask = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    adv = torch.tensor([[2.0, 2.0, 2.0], [1.0, 1.0, 1.0]]) * mask
    entry = POLICY_LOSSES["gspo"]
    assert entry.level == "sequence"
    for mode in ("token_mean", "seq_mean_token_sum", "seq_mean_token_mean"):
        assert entry.agg(mode) == "seq_mean_token_mean"
    assert POLICY_LOSSES["ppo_clip"].agg("token_mean") == "token_mean"
    out = entry(LossInputs.of(lp, torch.zeros(2, 3), adv, mask))
    loss = agg_loss(out.loss, mask, entry.agg("token_mean"))
    # sequence means -2 and -1, mean over the 2 sequences: -1.5 (token_mean would give (-2 - 3) / 4 = -1.25)
    assert loss.item() == pytest.approx(-1.5)
    loss.backward()
    # d/dlogp_t: -A s / (row tokens * rows): row 0: -2 / (1 * 2) = -1; row 1: -1 / (3 * 2) = -1/6 each
    assert lp.grad[0].tolist() == pytest.approx([-1.0, 0.0, 0.0]) and lp.grad[1].tolist() == pytest.approx([-1 / 6] * 3)


@pytest.mark.timeout(120)
def test_gspo_engine_step_ignores_token_mean(tiny_model_path):
    from asyncrl.trainer.engine import TrainerEngine
    from asyncrl.trainer.synthetic import synthetic_batch

    batch = synthetic_batch(4, vocab_size=100, seed=5)  # loss tokens per row: 5, 3, 3, 4
    a = torch.tensor([1.0, -2.0, 0.5, 3.0])
    batch = batch.replace(advantages=a[:, None] * batch.loss_mask)
    alg = AlgorithmConfig(loss="gspo", loss_agg="token_mean", correction="none")
    engine = TrainerEngine(tiny_model_path, trainer=TrainerConfig(micro_batch_size=2, total_steps=4, minibatches=1), algorithm=alg)
    try:
        m = engine.train_step(batch.replace(old_logprobs=engine.compute_logprobs(batch) * batch.loss_mask))
    finally:
        engine.close()
    # on-policy: s = 1 inside the clip, loss_t = -A of its row: the mean over rows of -A = -(1 - 2 + 0.5 + 3) / 4
    assert batch.loss_mask.sum(dim=-1).tolist() == [5.0, 3.0, 3.0, 4.0]
    assert m["pg_loss"] == pytest.approx(-0.625, abs=1e-4)  # token_mean would be -(5 - 6 + 1.5 + 12) / 15 = -0.8333


@pytest.mark.timeout(10)
@pytest.mark.parametrize("log_ratio, adv, want", [
    (100.0, 1.0, -1.2),              # r = e^20 (clamped), A > 0: the clip's -A (1 + 0.2)
    (100.0, -1.0, 3.0),              # A < 0: -A r = e^20 bounded by dual clip at c |A| = 3
    (-100.0, 1.0, -math.exp(-20)),   # r = e^-20: -A r, the pessimistic (larger) term
    (-100.0, -1.0, 0.8),             # A < 0, r below 1 - 0.2: -A (1 - 0.2)
])
def test_ppo_log_ratio_is_clamped_to_20_before_exp(log_ratio, adv, want):
    lp = torch.tensor([[log_ratio]], requires_grad=True)
    out = POLICY_LOSSES["ppo_clip"](LossInputs.of(lp, torch.zeros(1, 1), torch.tensor([[adv]]), torch.ones(1, 1)))
    loss = agg_loss(out.loss, torch.ones(1, 1), "token_mean")
    loss.backward()
    assert loss.item() == pytest.approx(want, rel=1e-5, abs=1e-12) and math.isfinite(loss.item())
    assert lp.grad.item() == 0.0  # beyond the clamp: no gradient, never nan (which skipped the mini-batch)
    assert out.ratio.item() == pytest.approx(math.exp(math.copysign(20.0, log_ratio)), rel=1e-5)
    off = POLICY_LOSSES["ppo_clip"](LossInputs.of(lp.detach(), torch.zeros(1, 1), torch.tensor([[adv]]), torch.ones(1, 1)),
                                    PPOClipSettings(clip_ratio_c=0.0))
    assert math.isfinite(off.loss.item())  # without dual clip: e^20 |A| at most, still finite


@pytest.mark.timeout(10)
def test_dr_grpo_norm_is_verls_divided_by_the_sequences_with_loss_tokens():
    loss = torch.tensor([[1.0, 2.0, 0.0], [3.0, 0.0, 0.0], [4.0, 4.0, 4.0], [9.0, 9.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])  # row 3: no loss tokens
    norm_len = 4
    ours = agg_loss(loss, mask, "seq_mean_token_sum_norm", norm_len=norm_len)
    verl = (loss * mask).sum() / norm_len  # verl's agg_loss: torch.sum(seq_losses) / loss_scale_factor
    # row sums 3, 3, 12: verl 18 / 4 = 4.5; asyncrl (3/4 + 3/4 + 12/4) / 3 = 1.5; N = 3 sequences with loss tokens
    assert verl.item() == pytest.approx(4.5) and ours.item() == pytest.approx(1.5)
    assert (verl / ours).item() == pytest.approx(3.0)
