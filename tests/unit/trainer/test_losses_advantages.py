"""Advantage estimators, policy losses, aggregation, KL and entropy against hand-computed values."""

import math

import pytest
import torch

from asyncrl.trainer.advantages import ADVANTAGES, compute_advantages, group_index_of
from asyncrl.trainer.setup import lr_factor
from asyncrl.trainer.losses import POLICY_LOSSES, LossInputs, agg_loss, entropy_from_logits, kl_penalty, token_logprobs


def test_grpo_normalises_within_groups():
    r = torch.tensor([1.0, 0.0, 0.0, 3.0, 1.0, 2.0])
    g = torch.tensor([0, 0, 0, 1, 1, 1])
    adv = ADVANTAGES["grpo"](r, g, eps=0.0)
    # group 0: mean 1/3, unbiased std sqrt(1/3); group 1: mean 2, std 1
    s0 = math.sqrt(1 / 3)
    expect = torch.tensor([(2 / 3) / s0, -(1 / 3) / s0, -(1 / 3) / s0, 1.0, -1.0, 0.0])
    assert torch.allclose(adv, expect, atol=1e-6)
    no_std = ADVANTAGES["grpo"](r, g, norm_by_std=False)
    assert torch.allclose(no_std, torch.tensor([2 / 3, -1 / 3, -1 / 3, 1.0, -1.0, 0.0]), atol=1e-6)


def test_grpo_constant_group_and_singleton_give_zero():
    adv = ADVANTAGES["grpo"](torch.tensor([1.0, 1.0, 5.0]), torch.tensor([0, 0, 1]))
    assert torch.equal(adv, torch.zeros(3))


def test_rloo_leave_one_out_baseline():
    r = torch.tensor([4.0, 1.0, 1.0, 2.0, 7.0])
    g = torch.tensor([1, 1, 1, 0, 2])  # groups in any order; group 0 and 2 are singletons
    adv = ADVANTAGES["rloo"](r, g)
    assert torch.allclose(adv, torch.tensor([4 - 1.0, 1 - 2.5, 1 - 2.5, 0.0, 0.0]))


def test_reinforce_pp_is_whitened_group_centred():
    adv = ADVANTAGES["reinforce_pp"](torch.tensor([1.0, 0.0, 2.0, 2.0]), torch.tensor([0, 0, 1, 1]))
    centred = torch.tensor([0.5, -0.5, 0.0, 0.0])
    assert torch.allclose(adv, centred / centred.std(), atol=1e-5)


def test_compute_advantages_maps_string_group_ids():
    assert group_index_of(["b", "a", "b", "c"]).tolist() == [0, 1, 0, 2]
    adv = compute_advantages("rloo", [1.0, 3.0, 0.0], ["x", "y", "x"])
    assert adv == pytest.approx([1.0, 0.0, -1.0])
    with pytest.raises(KeyError, match="algorithm.advantage"):
        compute_advantages("nope", [1.0], ["x"])


def test_ppo_clip_pessimistic_branches():
    lp = torch.log(torch.tensor([[1.5, 1.5, 0.5, 0.5, 1.1]]))
    old = torch.zeros(1, 5)
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0, 2.0]])
    out = POLICY_LOSSES["ppo_clip"](LossInputs.of(lp, old, adv, torch.ones(1, 5), clip_ratio_low=0.2, clip_ratio_high=0.3))
    # A>0, r=1.5 > 1.3 -> clipped at 1.3; A<0, r=1.5 -> unclipped 1.5 (pessimistic);
    # A>0, r=0.5 -> unclipped -0.5; A<0, r=0.5 < 0.8 -> clipped 0.8; inside the range -> -A r
    assert torch.allclose(out.loss, torch.tensor([[-1.3, 1.5, -0.5, 0.8, -2.2]]), atol=1e-6)
    assert out.clipped.tolist() == [[1.0, 0.0, 0.0, 1.0, 0.0]]
    assert torch.allclose(out.ratio, torch.tensor([[1.5, 1.5, 0.5, 0.5, 1.1]]), atol=1e-6)


def test_ppo_clip_gradient_vanishes_when_clipped_and_uses_proximal_anchor():
    lp = torch.tensor([[math.log(1.5), 0.0]], requires_grad=True)
    out = POLICY_LOSSES["ppo_clip"](LossInputs.of(lp, torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2)))
    out.loss.sum().backward()
    assert lp.grad.tolist() == [[0.0, -1.0]]
    prox = POLICY_LOSSES["ppo_clip"](LossInputs.of(torch.zeros(1, 1), torch.full((1, 1), -5.0), torch.ones(1, 1), torch.ones(1, 1),
                                                  proximal_logprobs=torch.zeros(1, 1)))
    assert prox.ratio.item() == pytest.approx(1.0)


def test_agg_modes_by_hand():
    loss = torch.tensor([[1.0, 3.0, 9.0], [5.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert agg_loss(loss, mask, "token_mean").item() == pytest.approx(9 / 3)
    assert agg_loss(loss, mask, "seq_mean_token_mean").item() == pytest.approx((2 + 5) / 2)
    assert agg_loss(loss, mask, "seq_mean_token_sum").item() == pytest.approx((4 + 5) / 2)
    with pytest.raises(ValueError, match="algorithm.loss_agg"):
        agg_loss(loss, mask, "mean")


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"])
def test_agg_over_shards_with_global_normalisers_equals_global(mode):
    g = torch.Generator().manual_seed(0)
    loss = torch.randn(5, 4, generator=g)
    mask = (torch.rand(5, 4, generator=g) > 0.3).float()
    full = agg_loss(loss, mask, mode)
    norm = dict(num_tokens=float(mask.sum()), num_seqs=5.0)
    parts = sum(agg_loss(loss[i : i + 2], mask[i : i + 2], mode, **norm) for i in range(0, 5, 2))
    assert parts.item() == pytest.approx(full.item(), abs=1e-6)


def test_kl_estimators():
    lp, ref = torch.tensor([0.0, -1.0]), torch.tensor([-1.0, -1.0])
    assert kl_penalty(lp, ref, "k1").tolist() == [1.0, 0.0]
    assert kl_penalty(lp, ref, "k2").tolist() == [0.5, 0.0]
    assert torch.allclose(kl_penalty(lp, ref, "k3"), torch.tensor([math.exp(-1) + 1 - 1, 0.0]))
    with pytest.raises(ValueError, match="kl_estimator"):
        kl_penalty(lp, ref, "k4")


def test_entropy_and_token_logprobs_alignment():
    assert entropy_from_logits(torch.tensor([[0.0, 0.0], [100.0, 0.0]])).tolist() == pytest.approx([math.log(2), 0.0], abs=1e-6)
    logits = torch.randn(2, 3, 5)
    ids = torch.tensor([[1, 4, 2], [0, 3, 3]])
    lp = token_logprobs(logits, ids, temperature=0.5)
    ref = torch.log_softmax(logits / 0.5, dim=-1)
    assert lp[:, 0].tolist() == [0.0, 0.0]
    assert lp[0, 1].item() == pytest.approx(ref[0, 0, 4].item(), abs=1e-6)
    assert lp[1, 2].item() == pytest.approx(ref[1, 1, 3].item(), abs=1e-6)


def test_lr_schedule_warmup_then_cosine():
    f = lambda s, sched: lr_factor(s, warmup=2, total=6, schedule=sched, min_ratio=0.1)  # noqa: E731
    assert [f(s, "constant") for s in range(4)] == [0.5, 1.0, 1.0, 1.0]
    assert f(2, "cosine") == pytest.approx(1.0)
    assert f(4, "cosine") == pytest.approx(0.1 + 0.9 * 0.5)
    assert f(6, "cosine") == pytest.approx(0.1)
    assert f(50, "cosine") == pytest.approx(0.1)


def test_config_accepts_exactly_the_registered_names():
    from asyncrl.config import AlgorithmConfig, ConfigError

    for name in ADVANTAGES:
        assert AlgorithmConfig(advantage=name).advantage == name
    for name in POLICY_LOSSES:
        assert AlgorithmConfig(loss=name).loss == name
    with pytest.raises(ConfigError, match="algorithm.advantage"):
        AlgorithmConfig(advantage="nope")
    with pytest.raises(ConfigError, match="algorithm.loss"):
        AlgorithmConfig(loss="dpo")


def test_docstring_examples_hold():
    import doctest

    from asyncrl.trainer import advantages, losses

    for module in (advantages, losses):
        result = doctest.testmod(module, extraglobs={"torch": torch})
        assert result.attempted > 0 and result.failed == 0, module.__name__
