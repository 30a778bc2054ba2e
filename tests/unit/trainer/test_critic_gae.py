"""GAE and the critic: hand-computed GAE, whitening and value loss; the critic on a real FSDP2 rank
(learns returns, checkpointed and resumed, KL in the reward with an adaptive beta)."""

import pytest
import torch

from asyncrl.config import AlgorithmConfig, ConfigError, CriticConfig, KLCtrlConfig, TrainerConfig
from asyncrl.trainer.gae import gae_advantages, token_rewards, value_loss, whiten, whiten_sums


def test_gae_by_hand_skips_tool_tokens():
    # one row: policy, policy, tool token (mask 0: skipped), policy; reward 1 on the last policy token
    mask = torch.tensor([[1.0, 1.0, 0.0, 1.0]])
    r = token_rewards(torch.tensor([1.0]), mask)
    v = torch.tensor([[0.2, 0.4, 9.9, 0.6]])
    adv, ret = gae_advantages(r, v, mask, gamma=0.9, lam=0.8)
    # t=3: d = 1 - 0.6 = 0.4; t=1: d = 0.9*0.6 - 0.4 = 0.14, A = 0.14 + 0.72*0.4 = 0.428;
    # t=0: d = 0.9*0.4 - 0.2 = 0.16, A = 0.16 + 0.72*0.428 = 0.46816
    assert r.tolist() == [[0.0, 0.0, 0.0, 1.0]]
    assert adv[0].tolist() == pytest.approx([0.46816, 0.428, 0.0, 0.4], abs=1e-6)
    assert ret[0].tolist() == pytest.approx([0.66816, 0.828, 0.0, 1.0], abs=1e-6)


def test_gae_lambda_one_gamma_one_is_return_minus_value():
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0, 0.0]])
    v = torch.tensor([[0.0, 0.1, -0.3, 0.5, 0.0]])
    adv, ret = gae_advantages(token_rewards(torch.tensor([2.0]), mask), v, mask, gamma=1.0, lam=1.0)
    assert adv[0, 1:4].tolist() == pytest.approx([1.9, 2.3, 1.5])
    assert ret[0, 1:4].tolist() == pytest.approx([2.0, 2.0, 2.0]) and adv[0, 0] == 0 and adv[0, 4] == 0


def test_whitening_over_parts_equals_whitening_of_the_whole():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(3, 5, generator=g), torch.randn(2, 4, generator=g)
    ma, mb = (torch.rand(3, 5, generator=g) > 0.3).float(), (torch.rand(2, 4, generator=g) > 0.3).float()
    sums = whiten_sums(a, ma) + whiten_sums(b, mb)
    wa, wb = whiten(a, ma, sums), whiten(b, mb, sums)
    whole = torch.cat([a[ma > 0], b[mb > 0]])
    expect = (whole - whole.mean()) / (whole.var(unbiased=True) + 1e-8).sqrt()
    assert torch.allclose(torch.cat([wa[ma > 0], wb[mb > 0]]), expect, atol=1e-6)
    assert wa[ma == 0].abs().sum() == 0


def test_value_loss_clips_around_the_old_value():
    v_old, ret = torch.tensor([0.0, 0.0, 0.0]), torch.tensor([1.0, 1.0, -1.0])
    vpred = torch.tensor([0.3, 2.0, 1.0])
    loss, clipped = value_loss(vpred, v_old, ret, cliprange=0.5)
    # 0: inside the clip -> 0.5*(0.7)^2; 1: unclipped (2-1)^2=1 > clipped (0.5-1)^2 -> 0.5;
    # 2: unclipped (1+1)^2=4, clipped (0.5+1)^2=2.25 -> max 4 -> 2.0 (clip does not bind)
    assert loss.tolist() == pytest.approx([0.245, 0.5, 2.0])
    # 3: a prediction moved past the clip away from its target: the clipped (smaller-move) term is larger
    loss2, clipped2 = value_loss(torch.tensor([-2.0]), torch.tensor([0.0]), torch.tensor([1.0]), cliprange=0.5)
    assert loss2.item() == pytest.approx(0.5 * 9.0) and clipped.sum() == 0 and clipped2.item() == 0.0
    loss3, clipped3 = value_loss(torch.tensor([1.4]), torch.tensor([0.0]), torch.tensor([1.2]), cliprange=0.5)
    assert loss3.item() == pytest.approx(0.5 * 0.7**2) and clipped3.item() == 1.0


def test_kl_in_reward_needs_gae():
    with pytest.raises(ConfigError, match="algorithm.use_kl_in_reward"):
        AlgorithmConfig(use_kl_in_reward=True)
    with pytest.raises(ConfigError, match="algorithm.kl_ctrl.type"):
        KLCtrlConfig(type="pid")
    with pytest.raises(ConfigError, match="critic.cliprange_value"):
        CriticConfig(cliprange_value=-1)


def _batch(n, seed):
    from asyncrl.trainer.synthetic import synthetic_batch

    b = synthetic_batch(n, vocab_size=100, seed=seed)
    scores = torch.tensor([1.0, 0.0] * (n // 2))
    return b.replace(token_rewards=token_rewards(scores, b.loss_mask), advantages=torch.zeros_like(b.loss_mask))


@pytest.mark.timeout(240)
def test_critic_learns_returns_and_resumes(tiny_model_path, tmp_path):
    from asyncrl.trainer.engine import TrainerEngine

    trainer = TrainerConfig(micro_batch_size=8, lr=1e-4, total_steps=20, minibatches=1)
    alg = AlgorithmConfig(advantage="gae", lam=1.0, use_kl_in_reward=True, entropy_coef=0.0,
                          kl_ctrl=KLCtrlConfig(type="adaptive", kl_coef=0.01, target_kl=1e-6, horizon=10.0))
    batch = _batch(8, seed=4)
    engine = TrainerEngine(tiny_model_path, trainer=trainer, algorithm=alg, critic=CriticConfig(lr=1e-3, cliprange_value=0.0))
    try:
        losses, betas = [], []
        for _ in range(5):
            m = engine.train_step(batch.replace(old_logprobs=engine.compute_logprobs(batch) * batch.loss_mask))
            losses.append(m["critic/vf_loss"])
            betas.append(m["reward/kl_coef"])
        assert {"critic/vf_clipfrac", "critic/grad_norm", "critic/values_mean", "critic/advantages_mean", "reward/kl"} <= set(m)
        assert losses[-1] < 0.5 * losses[0], losses  # the value head fits the (fixed) returns
        parts, _ = engine.critic.prepare([engine._with_fixed_logprobs(batch)])
        adv = parts[0].advantages[batch.loss_mask > 0]
        assert abs(adv.mean().item()) < 1e-5 and adv.std().item() == pytest.approx(1.0, abs=1e-4)  # whitened over the batch
        assert parts[0].advantages[batch.loss_mask == 0].abs().sum() == 0
        assert betas[1] < betas[0] < betas[4]  # adaptive: step 0 has KL 0 (the policy is the reference), later KL > target
        engine.save(str(tmp_path / "ckpt"))
        values = engine.critic.values(batch).cpu()
        beta = engine.critic.kl_ctl.value
    finally:
        engine.close()
    fresh = TrainerEngine(tiny_model_path, trainer=trainer, algorithm=alg, critic=CriticConfig(lr=3e-3))
    try:
        before = fresh.critic.values(batch).cpu()
        fresh.load(str(tmp_path / "ckpt"))
        after = fresh.critic.values(batch).cpu()
        assert not torch.allclose(before, values, atol=1e-3)  # a fresh value head differs ...
        assert torch.allclose(after, values, atol=1e-6)  # ... the resumed one is the saved one
        assert fresh.critic.kl_ctl.value == beta and fresh.step == 5
        fresh.critic.trainer.packing = True  # packed rows (restarting positions) give the same values
        assert torch.allclose(fresh.critic.values(batch).cpu(), after, atol=1e-5)
    finally:
        fresh.close()


@pytest.mark.timeout(120)
def test_dual_clip_fraction_is_logged(tiny_model_path):
    """`clip_frac_lower` (verl's pg_clipfrac_lower): the share of loss tokens where dual clip bound."""
    from asyncrl.trainer.engine import TrainerEngine
    from asyncrl.trainer.synthetic import synthetic_batch

    batch = synthetic_batch(4, vocab_size=100, seed=5)
    sign = torch.tensor([1.0, -1.0, 1.0, -1.0])[:, None]
    engine = TrainerEngine(tiny_model_path, trainer=TrainerConfig(micro_batch_size=4, total_steps=2, minibatches=1),
                           algorithm=AlgorithmConfig(correction="none", entropy_coef=0.0, clip_ratio_c=3.0))
    try:
        old = (engine.compute_logprobs(batch) - 2.0) * batch.loss_mask  # ratio e^2 = 7.4 > c everywhere
        m = engine.train_step(batch.replace(old_logprobs=old, advantages=sign * batch.loss_mask))
    finally:
        engine.close()
    negative = float((batch.loss_mask * (sign < 0)).sum()) / batch.num_tokens
    assert m["clip_frac_lower"] == pytest.approx(negative, abs=1e-6) and 0 < negative < 1
    assert m["clip_frac"] == pytest.approx(1.0)
