"""Off-policy corrections: hand-computed weights, reduction to plain PPO, statistics, and the engine path."""

import math

import pytest
import torch

from asyncrl.config import AlgorithmConfig, ConfigError
from asyncrl.trainer.batch import TrainBatch
from asyncrl.trainer.corrections import CORRECTIONS, Corrector, interpolate_proximal, stat_max, stat_metrics, stat_sums
from asyncrl.trainer.losses import POLICY_LOSSES, LossInputs, agg_loss
from asyncrl.types import Trajectory

# one row, rho = pi_prox / pi_behav = [0.4, 1.0, 1.5, 3.0]; pi_theta / pi_prox = [1, 1.2, 1, 1]
BEHAV = torch.log(torch.tensor([[0.5, 0.5, 0.2, 0.1]]))
PROX = torch.log(torch.tensor([[0.2, 0.5, 0.3, 0.3]]))
CUR = torch.log(torch.tensor([[0.2, 0.6, 0.3, 0.3]]))
ADV = torch.tensor([[1.0, 1.0, -1.0, 1.0]])
MASK = torch.ones(1, 4)
# PPO around pi_prox with clip 0.1: max(-A r, -A clip(r)) = [-1, -1.1 (clipped 1.2 -> 1.1), 1, -1]
PPO_AROUND_PROX = torch.tensor([[-1.0, -1.1, 1.0, -1.0]])


def corrected(name, **alg):
    corrector = Corrector(AlgorithmConfig(correction=name, **alg))
    out = corrector(CUR, BEHAV, MASK, proximal_logprobs=PROX)
    x = LossInputs.of(CUR, BEHAV, ADV, MASK, clip_ratio_low=0.1, clip_ratio_high=0.1, proximal_logprobs=out.proximal_logprobs)
    loss = POLICY_LOSSES["ppo_clip"](x)
    return out, loss.loss * out.weight


def close(a, b):
    return torch.allclose(a, torch.tensor(b, dtype=torch.float32).reshape(a.shape), atol=1e-5)


def test_none_and_bypass_anchor_on_behavior_with_unit_weight():
    for name in ("none", "bypass"):
        out, loss = corrected(name)
        assert out.proximal_logprobs is None and close(out.weight, [1, 1, 1, 1])
        # ratio pi_theta / pi_behav = [0.4, 1.2, 1.5, 3.0] clipped to [0.9, 1.1]: max(-A r, -A clip r)
        assert close(loss, [-0.4, -1.1, 1.5, -1.1])


def test_decoupled_ppo_weights_by_rho_and_drops_tokens_above_cap():
    out, loss = corrected("decoupled_ppo", is_cap=2.0)
    assert close(out.ratio, [0.4, 1.0, 1.5, 3.0])
    assert close(out.weight, [0.4, 1.0, 1.5, 0.0]) and close(out.masked, [0, 0, 0, 1])
    assert close(loss, [-0.4, -1.1, 1.5, 0.0])
    out, loss = corrected("decoupled_ppo", is_cap=0.0)  # uncapped
    assert close(loss, [-0.4, -1.1, 1.5, -3.0]) and out.masked.sum() == 0


def test_tis_truncates_rho_at_cap():
    out, loss = corrected("tis", is_cap=2.0)
    assert close(out.weight, [0.4, 1.0, 1.5, 2.0]) and close(out.clipped, [0, 0, 0, 1])
    assert close(loss, [-0.4, -1.1, 1.5, -2.0]) and out.masked.sum() == 0


def test_mis_token_level_masks_tokens_outside_bounds():
    out, loss = corrected("mis", mis_low=0.5, mis_high=2.0)
    assert close(out.weight, [0.0, 1.0, 1.5, 0.0]) and close(out.masked, [1, 0, 0, 1])
    assert close(loss, [0.0, -1.1, 1.5, 0.0])


def test_mis_sequence_level_uses_geometric_mean_over_loss_tokens():
    # row 0: rho = [0.4, 1, 1.5, 3], geometric mean 1.8 ** 0.25 = 1.15829 -> kept, every token weighted by it
    # row 1: rho = [2.5, 2.5, 2.5] on its 3 loss tokens -> dropped (averaging over 4 columns would give 1.99, kept)
    behav = torch.cat([BEHAV, torch.log(torch.tensor([[0.2, 0.2, 0.2, 0.5]]))])
    prox = torch.cat([PROX, torch.log(torch.tensor([[0.5, 0.5, 0.5, 0.005]]))])
    mask = torch.tensor([[1.0, 1, 1, 1], [1, 1, 1, 0]])
    corrector = Corrector(AlgorithmConfig(correction="mis", mis_level="sequence", mis_low=0.5, mis_high=2.0))
    out = corrector(prox, behav, mask, proximal_logprobs=prox)
    g = 1.8**0.25
    assert close(out.weight, [g, g, g, g, 0, 0, 0, 0])
    assert close(out.masked, [0, 0, 0, 0, 1, 1, 1, 0])
    metrics = stat_metrics(stat_sums(out, mask).tolist(), float(stat_max(out, mask)), float(mask.sum()))
    assert metrics["correction/masked_frac"] == pytest.approx(3 / 7)


def test_statistics_on_a_known_case():
    out, _ = corrected("tis", is_cap=2.0)
    m = stat_metrics(stat_sums(out, MASK).tolist(), float(stat_max(out, MASK)), 4.0)
    # rho = [0.4, 1, 1.5, 3]: sum 5.9, sum of squares 12.41; k3 = rho - 1 - log rho
    assert m["correction/ess"] == pytest.approx(5.9**2 / (4 * 12.41), rel=1e-5)
    assert m["correction/is_weight_mean"] == pytest.approx(5.9 / 4, rel=1e-5)
    assert m["correction/is_weight_max"] == pytest.approx(3.0, rel=1e-5)
    assert m["correction/weight_mean"] == pytest.approx((0.4 + 1 + 1.5 + 2) / 4, rel=1e-5)
    assert m["correction/clip_frac"] == 0.25 and m["correction/masked_frac"] == 0.0
    kl = sum(r - 1 - math.log(r) for r in (0.4, 1.0, 1.5, 3.0)) / 4
    assert m["correction/behav_prox_kl"] == pytest.approx(kl, rel=1e-5)
    out, _ = corrected("mis", mis_low=0.5, mis_high=2.0)
    assert stat_metrics(stat_sums(out, MASK).tolist(), 3.0, 4.0)["correction/masked_frac"] == 0.5


def test_interpolation_moves_stale_tokens_to_current_policy_only():
    behav, cur = torch.full((1, 4), -2.0), torch.full((1, 4), -1.0)
    versions = torch.tensor([[3, 5, -1, 4]])
    assert close(interpolate_proximal(cur, behav, versions, 5), [-1.0, -2.0, -2.0, -1.0])
    corrector = Corrector(AlgorithmConfig(correction="tis", proximal="interpolate", is_cap=2.0))
    out = corrector(cur, behav, torch.ones(1, 4), token_versions=versions, version=5)
    assert close(out.weight, [2.0, 1.0, 1.0, 2.0]) and close(out.clipped, [1, 0, 0, 1])  # e^1 = 2.718 truncated to 2


@pytest.mark.parametrize("name", sorted(CORRECTIONS))
@pytest.mark.parametrize("proximal", ["recompute", "interpolate"])
def test_equal_policies_reduce_to_plain_ppo(name, proximal):
    torch.manual_seed(0)
    behav = -torch.rand(3, 5) * 3
    adv, mask = torch.randn(3, 5), (torch.rand(3, 5) > 0.2).float()
    versions = torch.randint(0, 4, (3, 5))

    def loss_and_grad(corrector):
        lp = behav.clone().requires_grad_(True)
        kw = {}
        if corrector is not None:
            out = corrector(lp, behav, mask, proximal_logprobs=behav.clone(), token_versions=versions, version=4)
            kw, weight = dict(proximal_logprobs=out.proximal_logprobs), out.weight
        else:
            weight = torch.ones_like(behav)
        per_tok = POLICY_LOSSES["ppo_clip"](LossInputs.of(lp, behav, adv, mask, **kw)).loss * weight
        loss = agg_loss(per_tok, mask, "token_mean")
        loss.backward()
        return loss.detach(), lp.grad

    plain_loss, plain_grad = loss_and_grad(None)
    loss, grad = loss_and_grad(Corrector(AlgorithmConfig(correction=name, proximal=proximal)))
    assert torch.allclose(loss, plain_loss, atol=1e-6) and torch.allclose(grad, plain_grad, atol=1e-6)
    assert plain_grad.abs().sum() > 0


def test_config_validation_names_the_key():
    with pytest.raises(ConfigError, match="algorithm.correction"):
        AlgorithmConfig(correction="vtrace")
    with pytest.raises(ConfigError, match="algorithm.is_cap"):
        AlgorithmConfig(correction="tis", is_cap=0.0)
    with pytest.raises(ConfigError, match="algorithm.mis_high"):
        AlgorithmConfig(mis_high=0.9)
    with pytest.raises(ValueError, match="proximal_logprobs"):
        Corrector(AlgorithmConfig(correction="tis"))(CUR, BEHAV, MASK)


def test_from_trajectories_fills_token_versions():
    t = Trajectory(
        uid="a", group_id="g", index_in_group=0, group_size=1, prompt_ids=[5, 6], response_ids=[7, 8, 9],
        behavior_logprobs=[-0.1, 0.0, -0.3], loss_mask=[1, 0, 1], token_versions=[2, -1, 3], min_version=2, max_version=3,
    )  # fmt: skip
    b = TrainBatch.from_trajectories([t], advantages=[1.0], pad_id=0)
    assert b.token_versions.tolist() == [[-1, -1, 2, -1, 3]] and b.token_versions.dtype == torch.long
    assert b.proximal_logprobs is None and b[0:1].token_versions.shape == (1, 5)


def test_engine_decoupled_ppo_recompute_reports_is_weights(tiny_model_path):
    from asyncrl.config import TrainerConfig
    from asyncrl.trainer.engine import TrainerEngine
    from asyncrl.trainer.synthetic import synthetic_batch

    batch = synthetic_batch(6, vocab_size=100, seed=4)
    alg = AlgorithmConfig(correction="decoupled_ppo", proximal="recompute", is_cap=0.0)
    engine = TrainerEngine(tiny_model_path, trainer=TrainerConfig(micro_batch_size=3, lr=1e-3, total_steps=10, minibatches=1), algorithm=alg)
    try:
        fresh = engine.train_step(batch.replace(old_logprobs=engine.compute_logprobs(batch) * batch.loss_mask))
        # stale behavior: pi_behav = pi_prox * e^delta on loss tokens, so rho = e^-delta exactly
        delta = torch.where(torch.arange(batch.input_ids.shape[1]) % 2 == 0, 0.5, -0.25).expand_as(batch.loss_mask) * batch.loss_mask
        stale = batch.replace(old_logprobs=(engine.compute_logprobs(batch) + delta) * batch.loss_mask)
        recomputed = engine.train_step(stale)
        engine.corrector = Corrector(AlgorithmConfig(correction="decoupled_ppo", proximal="interpolate", is_cap=0.0))
        stale = batch.replace(old_logprobs=(engine.compute_logprobs(batch) + delta) * batch.loss_mask)
        interpolated = engine.train_step(stale.replace(token_versions=torch.where(batch.loss_mask > 0, engine.step - 1, -1)))
        on_policy = engine.train_step(stale.replace(token_versions=torch.where(batch.loss_mask > 0, engine.step, -1)))
    finally:
        engine.close()
    assert fresh["correction/ess"] == pytest.approx(1.0, abs=1e-6) and fresh["correction/behav_prox_kl"] < 1e-6
    assert fresh["correction/is_weight_mean"] == pytest.approx(1.0, abs=1e-5)
    rho = torch.exp(-delta)[batch.loss_mask > 0]
    for m in (recomputed, interpolated):
        assert m["correction/is_weight_mean"] == pytest.approx(rho.mean().item(), rel=1e-4)
        assert m["correction/is_weight_max"] == pytest.approx(math.exp(0.25), rel=1e-4)
        assert m["correction/ess"] == pytest.approx((rho.sum() ** 2 / (len(rho) * (rho**2).sum())).item(), rel=1e-4)
        assert m["correction/ess"] < 0.99 and m["correction/behav_prox_kl"] > 1e-3
    assert on_policy["correction/ess"] == 1.0 and on_policy["correction/is_weight_mean"] == pytest.approx(1.0)
