"""A policy loss added from outside asyncrl: one function and its settings dataclass, defined here and nowhere
else, selected by config overrides, its one constant checked at load (errors name the key) and used by the
engine's loss path (a real FSDP2 step on the tiny model). Then the advantage's spec, read instead of its name."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

from asyncrl.config import ConfigError, TrainerConfig, load
from asyncrl.trainer.losses import POLICY_LOSSES, LossInputs, PolicyLossOutput, agg_loss, check_setting, clamped_ratio, register_policy_loss


@dataclass(frozen=True)
class ScaledSettings:
    scale: float = 1.0
    """Multiplies the advantage of every token."""

    def __post_init__(self) -> None:
        check_setting(self.scale > 0, "scale", f"must be > 0, got {self.scale}")


@register_policy_loss("test_scaled_pg", settings=ScaledSettings)
def scaled_pg(x: LossInputs, s: ScaledSettings) -> PolicyLossOutput:
    """-scale * A * r: the unclipped policy gradient with the advantage scaled."""
    ratio = clamped_ratio(x.log_ratio)
    return PolicyLossOutput(loss=-s.scale * x.advantages * ratio, ratio=ratio.detach(), clipped=torch.zeros_like(ratio))


@pytest.mark.timeout(30)
def test_the_constant_is_selected_by_override_and_checked_at_load():
    cfg = load(None, ["algorithm.loss=test_scaled_pg", "algorithm.loss_args.scale=2.5"])
    assert cfg.algorithm.loss_args == {"scale": 2.5} and cfg.algorithm.loss_settings() == ScaledSettings(scale=2.5)
    assert load(None, ["algorithm.loss=test_scaled_pg", "algorithm.loss_args.scale=3"]).algorithm.loss_settings().scale == 3.0
    assert load(None, ["algorithm.loss=test_scaled_pg"]).algorithm.loss_settings() == ScaledSettings()  # the default
    bad = {"algorithm.loss_args.scale=-1": r"^algorithm\.loss_args\.scale: must be > 0, got -1",
           "algorithm.loss_args.scale=big": r"^algorithm\.loss_args\.scale: must be a float, got 'big'",
           "algorithm.loss_args.scael=2": r"^algorithm\.loss_args\.scael: not a setting of policy loss 'test_scaled_pg' \(its settings: \['scale'\]\)"}
    for override, message in bad.items():
        with pytest.raises(ConfigError, match=message):
            load(None, ["algorithm.loss=test_scaled_pg", override])
    with pytest.raises(ConfigError, match=r"^algorithm\.loss_args\.scale: not a setting of policy loss 'ppo_clip'"):
        load(None, ["algorithm.loss_args.scale=2"])  # the default loss has no such setting


@pytest.mark.timeout(10)
def test_the_entry_uses_the_constant_by_hand():
    lp = torch.log(torch.tensor([[2.0, 0.5, 1.0]])).requires_grad_(True)
    adv, mask = torch.tensor([[1.0, -1.0, 3.0]]), torch.tensor([[1.0, 1.0, 0.0]])
    entry = POLICY_LOSSES["test_scaled_pg"]
    assert entry.agg("token_mean") == "token_mean" and entry.level == "token"
    out = entry(LossInputs.of(lp, torch.zeros(1, 3), adv, mask), entry.make_settings({"scale": 2.0}))
    # -2 A r: -2 * 1 * 2 = -4, -2 * -1 * 0.5 = 1, (masked) -6; token mean over 2 loss tokens: -1.5
    loss = agg_loss(out.loss, mask, "token_mean")
    assert loss.item() == pytest.approx(-1.5)
    loss.backward()  # d/dlogp (-2 A r) / 2 = -A r: -2, 0.5, 0 (masked)
    assert lp.grad[0].tolist() == pytest.approx([-2.0, 0.5, 0.0])


@pytest.mark.timeout(120)
def test_the_engine_step_uses_the_constant(tiny_model_path):
    from asyncrl.trainer.engine import TrainerEngine
    from asyncrl.trainer.synthetic import synthetic_batch

    cfg = load(None, ["algorithm.loss=test_scaled_pg", "algorithm.loss_args.scale=2.5", "algorithm.correction=none"])
    batch = synthetic_batch(4, vocab_size=100, seed=5)
    batch = batch.replace(advantages=torch.tensor([1.0, -2.0, 0.5, 3.0])[:, None] * batch.loss_mask)
    engine = TrainerEngine(tiny_model_path, trainer=TrainerConfig(micro_batch_size=2, lr=1e-3, total_steps=4, minibatches=1), algorithm=cfg.algorithm)
    try:
        assert engine.loss_settings == ScaledSettings(scale=2.5)
        m = engine.train_step(batch.replace(old_logprobs=engine.compute_logprobs(batch) * batch.loss_mask))
    finally:
        engine.close()
    # on-policy: r = 1, so the token-mean policy loss is -2.5 * (sum of A over loss tokens) / loss tokens
    mask = batch.loss_mask
    want = -2.5 * (batch.advantages * mask).sum().item() / mask.sum().item()
    assert m["pg_loss"] == pytest.approx(want, abs=1e-4) and abs(want) > 0.1


# ---- the advantage's spec ------------------------------------------------------------------------------


def _groups(n=6):
    from asyncrl.trajectory_queue import trajectory_sample
    from asyncrl.types import Trajectory
    from transfer_queue.storage.local import LocalStorage

    plane, rng = LocalStorage(inline_max_bytes=0), random.Random(0)
    trajs = [Trajectory(uid=f"u{i}", group_id=f"g{i // 3}", index_in_group=i % 3, group_size=3, prompt_ids=[1, 2],
                        response_ids=[3, 4], behavior_logprobs=[-0.5, -0.5], loss_mask=[1, 1], token_versions=[0, 0],
                        min_version=0, max_version=0, reward=float(rng.random() > 0.5) + i) for i in range(n)]
    return [[trajectory_sample(plane, t) for t in trajs[i:i + 3]] for i in range(0, n, 3)]


@pytest.mark.timeout(30)
def test_the_controller_reads_needs_critic_not_the_name(monkeypatch):
    from asyncrl.batching import PlanBuilder
    from asyncrl.config import AlgorithmConfig
    from asyncrl.trainer.advantages import TOKEN_LEVEL_ADVANTAGES, AdvantageSpec, advantage_spec

    assert advantage_spec("gae").needs_critic and not advantage_spec("grpo").needs_critic
    sequence, _ = PlanBuilder(AlgorithmConfig(), pad_id=0)(_groups())
    assert any(r.advantage != 0 for r in sequence.rows)  # grpo: computed by the controller
    monkeypatch.setitem(TOKEN_LEVEL_ADVANTAGES, "test_token_level", AdvantageSpec(needs_critic=True))
    for name in ("gae", "test_token_level"):  # computed on the ranks from the critic's values: 0 in the plan
        plan, _ = PlanBuilder(AlgorithmConfig(advantage=name), pad_id=0)(_groups())
        assert [r.advantage for r in plan.rows] == [0.0] * 6
