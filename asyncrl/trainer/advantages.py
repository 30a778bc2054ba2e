"""Advantage estimators: sequence rewards in, one advantage per sequence out.

Pure tensor functions in a registry (`ADVANTAGES`), picked by `algorithm.advantage`.
Every estimator takes `rewards [N]` and `group_index [N]` (long, the group each sample
belongs to, 0..G-1 in any order) plus keyword constants, and returns `[N]` float
advantages. They know nothing about tokens, models or configs: the trainer broadcasts
the sequence advantage over the response tokens (`TrainBatch.from_trajectories`).

A group of one sample carries no baseline information: every estimator gives it 0.

    >>> r = torch.tensor([1., 0., 0., 0.]); g = torch.tensor([0, 0, 1, 1])
    >>> ADVANTAGES["rloo"](r, g)
    tensor([ 1., -1.,  0.,  0.])
"""

from __future__ import annotations

from typing import Callable, Protocol, Sequence

import torch
from torch import Tensor


class AdvantageFn(Protocol):
    def __call__(self, rewards: Tensor, group_index: Tensor, *, norm_by_std: bool = True, eps: float = 1e-6) -> Tensor: ...


ADVANTAGES: dict[str, AdvantageFn] = {}


def register_advantage(name: str) -> Callable[[AdvantageFn], AdvantageFn]:
    def deco(fn: AdvantageFn) -> AdvantageFn:
        if name in ADVANTAGES:
            raise ValueError(f"advantage {name!r} registered twice")
        ADVANTAGES[name] = fn
        return fn

    return deco


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
def reinforce_pp(rewards: Tensor, group_index: Tensor, *, norm_by_std: bool = True, eps: float = 1e-6) -> Tensor:
    """REINFORCE++ with a group baseline: r - group mean, then whitened over the whole batch.

    `norm_by_std=False` skips dividing by the batch std (centring only).

    >>> reinforce_pp(torch.tensor([1., 0., 1., 1.]), torch.tensor([0, 0, 1, 1]))
    tensor([ 1.2247, -1.2247,  0.0000,  0.0000])
    """
    _, mean, _ = _group_stats(rewards, group_index)
    adv = rewards.double() - mean
    adv = adv - adv.mean()
    if norm_by_std and adv.numel() > 1:
        adv = adv / (adv.std() + eps)
    return adv.to(rewards.dtype if rewards.is_floating_point() else torch.float32)


def compute_advantages(name: str, rewards: Sequence[float], group_ids: Sequence[str], *, norm_by_std: bool = True) -> list[float]:
    """Convenience for controllers: rewards and group ids of a batch of trajectories -> advantages."""
    if name not in ADVANTAGES:
        raise KeyError(f"algorithm.advantage: unknown {name!r}, known {sorted(ADVANTAGES)}")
    adv = ADVANTAGES[name](torch.tensor(list(rewards), dtype=torch.float32), group_index_of(group_ids), norm_by_std=norm_by_std)
    return adv.tolist()
