"""Advantage estimators: sequence rewards in, one advantage per sequence out.

Pure tensor functions in a registry (`ADVANTAGES`, an `asyncrl.registry.Registry`), picked by
`algorithm.advantage`: a registered name or an import path `package.module:function`.
Every estimator takes `rewards [N]` and `group_index [N]` (long, the group each sample
belongs to, 0..G-1 in any order) plus keyword constants, and returns `[N]` float
advantages. They know nothing about tokens, models or configs: the trainer broadcasts
the sequence advantage over the response tokens (`TrainBatch.from_trajectories`).

A group of one sample carries no baseline information: every estimator gives it 0.

Reward shaping that happens before an estimator (DAPO's `overlong_penalty`, the KL penalty in
the reward with its `KLController`) lives at the end of this file: pure functions too.

    >>> r = torch.tensor([1., 0., 0., 0.]); g = torch.tensor([0, 0, 1, 1])
    >>> ADVANTAGES["rloo"](r, g)
    tensor([ 1., -1.,  0.,  0.])
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

import torch
from torch import Tensor

from asyncrl.registry import Registry


class AdvantageFn(Protocol):
    def __call__(self, rewards: Tensor, group_index: Tensor, *, norm_by_std: bool = True, eps: float = 1e-6) -> Tensor: ...


ADVANTAGES: Registry[AdvantageFn] = Registry("advantage", "algorithm.advantage")


@dataclass(frozen=True)
class AdvantageSpec:
    """What the pipeline reads of an `algorithm.advantage` beside its function (`advantage_spec`)."""

    needs_critic: bool = False
    """True: per-token advantages from a value model's values: the trainer builds the critic (`critic.*`)
    and computes them on its ranks (`trainer/critic.py`, `gae.py`), and the controller plans 0 for each
    sequence (`batching.py`). False: a sequence estimator of `ADVANTAGES`, computed by the controller."""


SEQUENCE_ADVANTAGE = AdvantageSpec()
"""The spec of every estimator in `ADVANTAGES` (and of an import path)."""

TOKEN_LEVEL_ADVANTAGES: dict[str, AdvantageSpec] = {"gae": AdvantageSpec(needs_critic=True)}
"""Valid `algorithm.advantage` names that are not sequence estimators in `ADVANTAGES`: token-level
advantages computed on the trainer ranks (`gae`, with a critic: `trainer/gae.py`). Config accepts
them too (`asyncrl.config.checks.check_registered`); `compute_advantages` does not compute them."""


def advantage_spec(name: str) -> AdvantageSpec:
    """The spec of `algorithm.advantage=name`: what the engine and the controller branch on, never the name.

    >>> advantage_spec("gae").needs_critic, advantage_spec("grpo").needs_critic
    (True, False)
    """
    return TOKEN_LEVEL_ADVANTAGES.get(name, SEQUENCE_ADVANTAGE)


def register_advantage(name: str) -> Callable[[AdvantageFn], AdvantageFn]:
    """Decorator: `@register_advantage("my_adv")` makes an estimator selectable as `algorithm.advantage=my_adv`."""
    return ADVANTAGES.register(name)


def group_index_of(group_ids: Sequence[str]) -> Tensor:
    """Map group ids (strings, any order) to a dense long index 0..G-1 in order of first appearance."""
    seen: dict[str, int] = {}
    return torch.tensor([seen.setdefault(g, len(seen)) for g in group_ids], dtype=torch.long)


def _group_stats(rewards: Tensor, group_index: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per-sample group size, group mean and unbiased group std (0 for groups of one)."""
    if rewards.dim() != 1 or group_index.shape != rewards.shape:
        raise ValueError(f"rewards {tuple(rewards.shape)} and group_index {tuple(group_index.shape)} must be equal 1-D shapes")
    r = rewards.double()
    g = group_index.long()
    num_groups = int(g.max()) + 1 if g.numel() else 0
    count = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, g, torch.ones_like(r))
    mean = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, g, r) / count.clamp(min=1)
    sq = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, g, (r - mean[g]) ** 2)
    std = (sq / (count - 1).clamp(min=1)).sqrt()
    return count[g], mean[g], std[g]


@register_advantage("grpo")
def grpo(rewards: Tensor, group_index: Tensor, *, norm_by_std: bool = True, eps: float = 1e-6) -> Tensor:
    """GRPO: (r - group mean) / (group std + eps); `norm_by_std=False` keeps r - mean (Dr. GRPO).

    >>> grpo(torch.tensor([1., 0., 1., 1.]), torch.tensor([0, 0, 1, 1]))  # std of (1, 0) = 0.7071
    tensor([ 0.7071, -0.7071,  0.0000,  0.0000])
    """
    _, mean, std = _group_stats(rewards, group_index)
    adv = rewards.double() - mean
    if norm_by_std:
        adv = adv / (std + eps)
    return adv.to(rewards.dtype if rewards.is_floating_point() else torch.float32)


@register_advantage("rloo")
def rloo(rewards: Tensor, group_index: Tensor, *, norm_by_std: bool = True, eps: float = 1e-6) -> Tensor:
    """RLOO: r_i minus the mean reward of the other samples of its group (= n/(n-1) (r_i - mean)).

    `norm_by_std` is ignored: the leave-one-out baseline is unnormalised by definition.

    >>> rloo(torch.tensor([3., 0., 0.]), torch.tensor([0, 0, 0]))
    tensor([ 3.0000, -1.5000, -1.5000])
    """
    count, mean, _ = _group_stats(rewards, group_index)
    adv = (rewards.double() - mean) * count / (count - 1).clamp(min=1)
    return adv.to(rewards.dtype if rewards.is_floating_point() else torch.float32)


@register_advantage("reinforce_pp")
def reinforce_pp(
    rewards: Tensor, group_index: Tensor, *, norm_by_std: bool = True, eps: float = 1e-6, token_counts: Tensor | None = None
) -> Tensor:
    """REINFORCE++ with a group baseline: r - group mean, then whitened over the batch.

    Without `token_counts` every sequence counts once in the batch mean and (unbiased) std.
    With `token_counts [N]` (each sequence's loss tokens) every sequence counts once per token,
    which is what verl's `compute_reinforce_plus_plus_baseline_outcome_advantage` does (its
    `masked_whiten` over the [N, T] advantage broadcast over the response tokens; unbiased
    variance, 1e-8 inside the square root); rows with no loss tokens then carry no weight.
    `norm_by_std=False` skips dividing by the std (centring only).

    >>> reinforce_pp(torch.tensor([1., 0., 1., 1.]), torch.tensor([0, 0, 1, 1]))
    tensor([ 1.2247, -1.2247,  0.0000,  0.0000])
    """
    _, mean, _ = _group_stats(rewards, group_index)
    adv = rewards.double() - mean
    w = torch.ones_like(adv) if token_counts is None else token_counts.double()
    if w.shape != adv.shape:
        raise ValueError(f"token_counts {tuple(w.shape)} must match rewards {tuple(adv.shape)}")
    n = w.sum()
    if n > 0:
        adv = adv - (w * adv).sum() / n
        if norm_by_std and n > 1:
            var = (w * adv**2).sum() / (n - 1)
            adv = adv / (var.sqrt() + eps) if token_counts is None else adv * torch.rsqrt(var + 1e-8)
    return adv.to(rewards.dtype if rewards.is_floating_point() else torch.float32)


def compute_advantages(name: str, rewards: Sequence[float], group_ids: Sequence[str], *, norm_by_std: bool = True) -> list[float]:
    """Convenience for controllers: rewards and group ids of a batch of trajectories -> advantages.

    `name` is a registered estimator or an import path; anything else is a `KeyError` naming `algorithm.advantage`."""
    adv = ADVANTAGES.get(name)(torch.tensor(list(rewards), dtype=torch.float32), group_index_of(group_ids), norm_by_std=norm_by_std)
    return adv.tolist()


# ---- reward shaping: applied to rewards before an estimator sees them ----------------------


def overlong_penalty(response_length: int, *, max_response_length: int, buffer_len: int, penalty_factor: float = 1.0) -> float:
    """DAPO's overlong reward shaping: 0 up to `max_response_length - buffer_len` tokens, then a
    linear penalty reaching `-penalty_factor` at `max_response_length` (added to the reward).

    `buffer_len` 0 turns it off. The rollout side adds it to a record's reward (`rollout/shaping.py`,
    `agent.overlong_buffer_len`, `agent.overlong_penalty_factor`).

    >>> overlong_penalty(90, max_response_length=100, buffer_len=20)  # 10 tokens into a 20-token buffer
    -0.5
    >>> overlong_penalty(80, max_response_length=100, buffer_len=20)
    0.0
    """
    if buffer_len <= 0:
        return 0.0
    if buffer_len > max_response_length:
        raise ValueError(f"overlong_penalty: buffer_len {buffer_len} exceeds the max response length {max_response_length}")
    exceed = response_length - (max_response_length - buffer_len)
    return min(-exceed / buffer_len * penalty_factor, 0.0)


def kl_in_reward(token_rewards: Tensor, kl: Tensor, mask: Tensor, beta: float) -> tuple[Tensor, float]:
    """KL penalty in the reward (verl `apply_kl_penalty`): `token_rewards - beta * kl` on the loss
    tokens (`mask` 1), and the batch's current KL (mean over the sequences with loss tokens of each
    one's token-mean KL), which feeds `KLController.update`.

    `kl [N, T]` is a per-token estimate of KL(behavior || reference) (`losses.kl_penalty` of the
    behavior and reference log-probs, no gradient). With an outcome estimator (grpo, rloo, ...) the
    sequence reward becomes the row sum: r - beta * sum_t kl_t.

    >>> kl_in_reward(torch.tensor([[0., 1.]]), torch.tensor([[0.5, 1.5]]), torch.ones(1, 2), 0.1)
    (tensor([[-0.0500,  0.8500]]), 1.0)
    """
    m = mask.to(kl.dtype)
    shaped = token_rewards - beta * kl * m
    rows = m.sum(dim=-1)
    seq_kl = (kl * m).sum(dim=-1) / rows.clamp(min=1)
    has = rows > 0
    current = float(seq_kl[has].mean()) if bool(has.any()) else 0.0
    return shaped, current


@dataclass
class KLController:
    """The weight `value` (beta) of the KL penalty in the reward, `fixed` or `adaptive` (Ziegler et
    al. 2019, verl's `AdaptiveKLController`): after each batch of `n_steps` samples,
    beta *= 1 + clip(kl / kl_target - 1, -0.2, 0.2) * n_steps / kl_horizon.
    Built by the critic (`trainer/critic.py`) from `algorithm.kl_ctrl.*` with `algorithm.use_kl_in_reward`
    (the KL in the loss is `algorithm.kl_coef`).

    Trace (adaptive, beta 0.1, target 0.1, horizon 100): kl 0.3, 10 samples -> error clipped to 0.2,
    beta 0.1 * 1.02 = 0.102; kl 0.05 -> error -0.5 clipped to -0.2, beta 0.102 * 0.98 = 0.09996.
    """

    value: float
    kind: str = "fixed"
    kl_target: float = 0.1
    kl_horizon: float = 10000.0

    def __post_init__(self) -> None:
        if self.kind not in ("fixed", "adaptive"):
            raise ValueError(f"KLController: unknown kind {self.kind!r}, known ['fixed', 'adaptive']")
        if self.kind == "adaptive" and (self.kl_target <= 0 or self.kl_horizon <= 0):
            raise ValueError(f"KLController: kl_target and kl_horizon must be > 0 when adaptive, got {self.kl_target}, {self.kl_horizon}")

    def update(self, current_kl: float, n_steps: int) -> float:
        """Adapt beta to the KL just measured over `n_steps` samples; returns the new beta."""
        if self.kind == "adaptive":
            error = min(max(current_kl / self.kl_target - 1.0, -0.2), 0.2)
            self.value *= 1.0 + error * n_steps / self.kl_horizon
        return self.value
