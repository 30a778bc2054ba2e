"""The issue-14 losses against hand computations (tiny tensors, the numbers worked out in the comments):
dual-clip PPO, GSPO, CISPO, clamped k3, KL in the reward and its controller, Dr. GRPO's aggregation,
sequence means that skip rows without loss tokens, token-weighted REINFORCE++, DAPO overlong shaping;
then one real FSDP2 step with each new loss through `TrainerEngine.train_step`."""

import math

import pytest
import torch

from asyncrl.config import AlgorithmConfig, ConfigError, TrainerConfig
from asyncrl.trainer.advantages import ADVANTAGES, KLController, kl_in_reward, overlong_penalty
from asyncrl.trainer.losses import POLICY_LOSSES, GSPOSettings, LossInputs, PPOClipSettings, agg_loss, kl_penalty

L = math.log


def close(t, expected, abs=1e-6):
    """A 2-D tensor equals the hand-computed rows (pytest.approx takes no nested lists)."""
    return torch.allclose(t.detach().double(), torch.tensor(expected, dtype=torch.float64), atol=abs, rtol=0)


def inputs(lp, adv, mask=None, **clip):
    """`LossInputs` around a behaviour policy of log-prob 0 (so ratio = exp(lp)), every token trained on by default."""
    return LossInputs.of(lp, torch.zeros_like(lp), adv, torch.ones_like(lp) if mask is None else mask, **clip)


# ---- dual-clip PPO ----------------------------------------------------------------------------


@pytest.mark.timeout(10)
def test_dual_clip_bounds_negative_advantage_loss_by_c_abs_a():
    # tokens: ratios 4, 2, 4, 0.5 (old logp 0); advantages -1, -1, +1, -1; clip 0.2, c = 3
    lp = torch.tensor([[L(4.0), L(2.0), L(4.0), L(0.5)]], requires_grad=True)
    adv = torch.tensor([[-1.0, -1.0, 1.0, -1.0]])
    out = POLICY_LOSSES["ppo_clip"](inputs(lp, adv), PPOClipSettings(clip_ratio_c=3.0))
    # t0: max(4, 1.2) = 4 > c|A| = 3 -> 3 (dual clip);  t1: max(2, 1.2) = 2 < 3 -> 2 (unclipped)
    # t2: A > 0: max(-4, -1.2) = -1.2 (PPO clip);       t3: max(0.5, 0.8) = 0.8 (PPO clip, below 3)
    assert close(out.loss, [[3.0, 2.0, -1.2, 0.8]])
    assert out.dual_clipped.tolist() == [[1.0, 0.0, 0.0, 0.0]]
    assert out.clipped.tolist() == [[1.0, 0.0, 1.0, 1.0]]  # dual-clipped tokens count as clipped
    out.loss.sum().backward()
    # only t1 carries a gradient: d(-A r)/dlogp = -A r = 2
    assert close(lp.grad, [[0.0, 2.0, 0.0, 0.0]])
    off = POLICY_LOSSES["ppo_clip"](inputs(lp.detach(), adv), PPOClipSettings(clip_ratio_c=0.0))
    assert off.loss[0, 0].item() == pytest.approx(4.0) and off.dual_clipped.sum() == 0  # 0 = off: plain PPO
    with pytest.raises(ValueError, match=r"^algorithm\.loss_args\.clip_ratio_c: must be > 1"):
        PPOClipSettings(clip_ratio_c=0.9)
    with pytest.raises(ConfigError, match=r"^algorithm\.clip_ratio_c: must be > 1"):  # the older key: named as set
        AlgorithmConfig(clip_ratio_c=1.0)
    with pytest.raises(ConfigError, match=r"^algorithm\.loss_args\.clip_ratio_c: must be > 1"):
        AlgorithmConfig(loss_args={"clip_ratio_c": 1.0})


# ---- GSPO ---------------------------------------------------------------------------------------


@pytest.mark.timeout(10)
def test_gspo_sequence_ratio_and_token_level_gradient():
    # row 0: token ratios 2 and 8 on loss tokens, a third token masked out: s = (2 * 8)^(1/2) = 4
    lp = torch.tensor([[L(2.0), L(8.0), L(100.0)]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    adv = torch.ones(1, 3)
    wide = GSPOSettings(seq_clip_ratio_low=0.5, seq_clip_ratio_high=5.0)  # range 0.5..6: s = 4 is not clipped
    out = POLICY_LOSSES["gspo"](inputs(lp, adv, mask), wide)
    assert out.ratio[0, :2].tolist() == pytest.approx([4.0, 4.0])  # every token carries the sequence ratio
    assert out.loss[0, :2].tolist() == pytest.approx([-4.0, -4.0]) and out.clipped[0, :2].sum() == 0
    agg_loss(out.loss, mask, "seq_mean_token_mean").backward()
    # loss = mean_t(-A s_t), d s_t / d logp_t = s: each loss token gets -A s / 2 = -2, whatever its own
    # ratio (token-level PPO would give -A r_t / 2 = -1 and -4); the masked token gets nothing
    assert close(lp.grad, [[-2.0, -2.0, 0.0]])


@pytest.mark.timeout(10)
def test_gspo_clips_whole_sequences_with_its_own_small_range():
    lp = torch.tensor([[L(2.0), L(8.0)], [L(1.0002), L(1.0002)]], requires_grad=True)
    mask = torch.ones(2, 2)
    adv = torch.tensor([[1.0, 1.0], [1.0, 1.0]])
    out = POLICY_LOSSES["gspo"](inputs(lp, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.2))
    # defaults 3e-4 / 4e-4 (the token clip_ratio_* are ignored): row 0 s = 4 -> clipped to 1.0004, no gradient;
    # row 1 s = 1.0002 is inside [0.9997, 1.0004]: unclipped, loss -1.0002
    assert close(out.loss, [[-1.0004, -1.0004], [-1.0002, -1.0002]], abs=1e-6)
    assert out.clipped.tolist() == [[1.0, 1.0], [0.0, 0.0]]
    out.loss.sum().backward()
    assert lp.grad[0].tolist() == [0.0, 0.0] and lp.grad[1].tolist() == pytest.approx([-1.0002, -1.0002], abs=1e-6)
    huge = POLICY_LOSSES["gspo"](inputs(torch.full((1, 2), 50.0), -torch.ones(1, 2)))
    assert huge.ratio[0, 0].item() == pytest.approx(math.exp(10.0), rel=1e-5)  # log s clamped at 10: finite


# ---- CISPO --------------------------------------------------------------------------------------


@pytest.mark.timeout(10)
def test_cispo_detached_clipped_weight_times_advantage_times_logp():
    # ratios 2, 0.5, 1.1 (old logp 0); A = 1, -1, 2; clip 0.2 -> weights w = 1.2, 0.8, 1.1
    lp = torch.tensor([[L(2.0), L(0.5), L(1.1)]], requires_grad=True)
    adv = torch.tensor([[1.0, -1.0, 2.0]])
    out = POLICY_LOSSES["cispo"](inputs(lp, adv, clip_ratio_low=0.2, clip_ratio_high=0.2))
    # loss = -w A logp: -1.2 * 1 * log 2 = -0.83178; -0.8 * -1 * log 0.5 = -0.55452; -1.1 * 2 * log 1.1 = -0.20968
    assert close(out.loss, [[-1.2 * L(2.0), 0.8 * L(0.5), -2.2 * L(1.1)]], abs=1e-6)
    assert out.loss[0, 0].item() == pytest.approx(-0.83178, abs=1e-5)
    assert out.clipped.tolist() == [[1.0, 1.0, 0.0]] and close(out.ratio, [[2.0, 0.5, 1.1]])
    out.loss.sum().backward()
    # gradient -w A, through logp only (w detached), and clipped tokens keep theirs (PPO would give 0 for t0)
    assert close(lp.grad, [[-1.2, 0.8, -2.2]], abs=1e-6)


# ---- clamped k3 -----------------------------------------------------------------------------------


@pytest.mark.timeout(10)
@pytest.mark.parametrize("gap", [-30.0, -100.0, 30.0, 100.0])
def test_k3_is_finite_with_finite_gradient_at_large_gaps(gap):
    lp = torch.tensor([gap], requires_grad=True)  # logp - ref = gap (ref = 0)
    kl = kl_penalty(lp, torch.zeros(1), "k3")
    kl.sum().backward()
    # gap -30: ref - logp = 30 clamped to 20, e^20 - 21 = 4.85e8 clamped to 10 (was 1.07e13); gap +30: e^-20 + 19 -> 10
    assert kl.item() == 10.0 and torch.isfinite(lp.grad).all()


@pytest.mark.timeout(10)
def test_k3_unchanged_inside_the_clamp():
    lp = torch.tensor([-1.0, 0.5], requires_grad=True)
    kl = kl_penalty(lp, torch.zeros(2), "k3")
    # gap -1: e^1 - 1 - 1 = 0.71828; gap 0.5: e^-0.5 + 0.5 - 1 = 0.10653
    assert kl.tolist() == pytest.approx([math.e - 2.0, math.exp(-0.5) - 0.5], abs=1e-6)
    kl.sum().backward()
    # d/dlogp (e^{-d} + d - 1) = 1 - e^{-d}: 1 - e = -1.71828, 1 - e^-0.5 = 0.39347
    assert lp.grad.tolist() == pytest.approx([1.0 - math.e, 1.0 - math.exp(-0.5)], abs=1e-6)


# ---- KL in the reward ------------------------------------------------------------------------------


@pytest.mark.timeout(10)
def test_kl_in_reward_penalises_loss_tokens_and_reports_the_batch_kl():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 0.0]])
    kl = torch.tensor([[0.2, 0.4, 9.0], [1.0, 1.0, 1.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    shaped, current = kl_in_reward(rewards, kl, mask, beta=0.5)
    # row 0: 0 - 0.5 * 0.2 = -0.1, 0 - 0.5 * 0.4 = -0.2, masked token keeps 1; row 1 has no loss tokens
    assert close(shaped, [[-0.1, -0.2, 1.0], [0.0, 0.0, 0.0]])
    assert current == pytest.approx(0.3)  # row 0's token mean (0.2 + 0.4) / 2; row 1 does not count


@pytest.mark.timeout(10)
def test_kl_controllers_fixed_and_adaptive_update_rule():
    fixed = KLController(0.1)
    assert fixed.update(5.0, 10) == 0.1
    ctl = KLController(0.1, kind="adaptive", kl_target=0.1, kl_horizon=100)
    # kl 0.3: error 0.3/0.1 - 1 = 2 clipped to 0.2; beta *= 1 + 0.2 * 10/100 = 1.02 -> 0.102
    assert ctl.update(0.3, 10) == pytest.approx(0.102)
    # kl 0.05: error -0.5 clipped to -0.2; beta *= 0.98 -> 0.09996
    assert ctl.update(0.05, 10) == pytest.approx(0.09996)
    # kl 0.11: error 0.1 (inside the clip); beta *= 1 + 0.1 * 50/100 = 1.05 -> 0.104958
    assert ctl.update(0.11, 50) == pytest.approx(0.09996 * 1.05)
    with pytest.raises(ValueError, match="unknown kind"):
        KLController(0.1, kind="pid")
    with pytest.raises(ValueError, match="kl_horizon"):
        KLController(0.1, kind="adaptive", kl_horizon=0)


# ---- aggregation -----------------------------------------------------------------------------------


@pytest.mark.timeout(10)
def test_seq_means_skip_rows_without_loss_tokens_and_dr_grpo_norm():
    loss = torch.tensor([[1.0, 3.0, 9.0], [5.0, 0.0, 0.0], [7.0, 7.0, 7.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])  # row 2: no loss tokens
    # row means 2 and 5 over the 2 rows with tokens (not 3): 3.5; row sums 4 and 5: 4.5
    assert agg_loss(loss, mask, "seq_mean_token_mean").item() == pytest.approx(3.5)
    assert agg_loss(loss, mask, "seq_mean_token_sum").item() == pytest.approx(4.5)
    # Dr. GRPO: (4 / 4 + 5 / 4) / 2 = 1.125
    assert agg_loss(loss, mask, "seq_mean_token_sum_norm", norm_len=4).item() == pytest.approx(1.125)
    # global normalisers: two shards with num_seqs = 2 add up to the full result
    parts = sum(agg_loss(loss[i : i + 2], mask[i : i + 2], "seq_mean_token_sum_norm", num_seqs=2.0, norm_len=4) for i in (0, 2))
    assert parts.item() == pytest.approx(1.125)
    with pytest.raises(ValueError, match="algorithm.loss_agg_norm_len"):
        agg_loss(loss, mask, "seq_mean_token_sum_norm")
    with pytest.raises(ConfigError, match="algorithm.loss_agg_norm_len"):
        AlgorithmConfig(loss_agg="seq_mean_token_sum_norm")


# ---- REINFORCE++ and overlong shaping ---------------------------------------------------------------


@pytest.mark.timeout(10)
def test_reinforce_pp_token_weighted_whitening_matches_masked_whiten():
    r, g = torch.tensor([1.0, 0.0, 2.0, 2.0]), torch.tensor([0, 0, 1, 1])
    counts = torch.tensor([3.0, 1.0, 2.0, 0.0])
    adv = ADVANTAGES["reinforce_pp"](r, g, token_counts=counts)
    # centred: 0.5, -0.5, 0, 0; token-weighted mean (1.5 - 0.5) / 6 = 1/6 -> 1/3, -2/3, -1/6, -1/6
    # unbiased variance (3/9 + 4/9 + 2/36) / 5 = 1/6 -> times sqrt(6)
    assert adv.tolist() == pytest.approx([x * math.sqrt(6) for x in (1 / 3, -2 / 3, -1 / 6, -1 / 6)], abs=1e-5)
    # verl: broadcast over tokens, masked_whiten over the response mask
    mask = (torch.arange(3)[None, :] < counts[:, None]).double()
    tok = torch.tensor([0.5, -0.5, 0.0, 0.0], dtype=torch.float64)[:, None] * mask
    n = mask.sum()
    mean = (tok * mask).sum() / n
    var = (((tok - mean) ** 2) * mask).sum() / n * n / (n - 1)
    ref = ((tok - mean) * torch.rsqrt(var + 1e-8))[:, 0]
    assert adv[:3].tolist() == pytest.approx(ref[:3].tolist(), abs=1e-6)
    # without counts every sequence counts once (the default path of the controller)
    per_seq = ADVANTAGES["reinforce_pp"](r, g)
    assert per_seq.tolist() == pytest.approx([0.5 / math.sqrt(1 / 6), -0.5 / math.sqrt(1 / 6), 0.0, 0.0], abs=1e-5)


@pytest.mark.timeout(10)
def test_overlong_penalty_is_linear_inside_the_buffer():
    kw = dict(max_response_length=100, buffer_len=20, penalty_factor=0.5)
    # expected length 80: 80 -> 0; 95 -> -(15 / 20) * 0.5 = -0.375; 100 -> -0.5
    assert [overlong_penalty(n, **kw) for n in (10, 80, 95, 100)] == pytest.approx([0.0, 0.0, -0.375, -0.5])
    assert overlong_penalty(100, max_response_length=100, buffer_len=0) == 0.0
    with pytest.raises(ValueError, match="buffer_len"):
        overlong_penalty(10, max_response_length=8, buffer_len=16)


# ---- one real step through the engine ------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_each_new_loss_takes_a_finite_step_that_moves_the_weights(tiny_model_path):
    from asyncrl.trainer.engine import TrainerEngine
    from asyncrl.trainer.synthetic import synthetic_batch

    batch = synthetic_batch(6, vocab_size=100, seed=4)
    empty = batch.loss_mask.clone()
    empty[5] = 0.0  # a row with no loss tokens: must not count as a sequence
    sign = torch.tensor([1.0, -1.0] * 3)[:, None]
    batch = batch.replace(loss_mask=empty, advantages=sign * empty)
    cases = [
        dict(loss="gspo", loss_agg="seq_mean_token_mean"),
        dict(loss="cispo", clip_ratio_low=0.9, clip_ratio_high=0.3),
        dict(loss="ppo_clip", clip_ratio_c=3.0, loss_agg="seq_mean_token_sum_norm", loss_agg_norm_len=16),
    ]
    for alg in cases:
        trainer = TrainerConfig(micro_batch_size=4, lr=1e-3, total_steps=10)
        engine = TrainerEngine(tiny_model_path, trainer=trainer, algorithm=AlgorithmConfig(correction="none", **alg))
        try:  # on-policy: ratio 1, so GSPO's tiny clip range does not bind on the first step
            batch = batch.replace(old_logprobs=engine.compute_logprobs(batch) * empty)
            before = {k: v.clone() for k, v in engine.iter_full_params()}
            m = engine.train_step(batch)
            after = dict(engine.iter_full_params())
        finally:
            engine.close()
        assert math.isfinite(m["loss"]) and m["grad_norm"] > 0, alg
        assert m["seqs"] == 5, alg  # 6 rows, one without loss tokens
        assert max((after[k] - before[k]).abs().max().item() for k in before) > 0, alg
