"""GAE and the critic's loss: pure tensor functions, token-level (`algorithm.advantage=gae`).

Unlike the outcome estimators in `advantages.py` (one advantage per sequence, computed by the
controller from rewards alone), GAE needs the critic's per-token values, so it runs on each
trainer rank over that rank's rows (`critic.py`); only the whitening statistics are summed
over the ranks.

Layout as in `TrainBatch`: column t holds token t and everything scored for it; `mask` is the
loss mask (1 at tokens the policy generated). Tokens with mask 0 inside a response (tool
output, environment text) are skipped by the recursion as verl's multi-turn GAE does: the
next value and the running advantage carry over them unchanged, so a turn's advantage sees
the value after the tool output. The sequence reward sits on the last policy token.

    >>> r = torch.tensor([[0., 0., 1.]]); v = torch.tensor([[0.5, 0.5, 0.5]]); m = torch.ones(1, 3)
    >>> adv, ret = gae_advantages(r, v, m, gamma=1.0, lam=1.0)
    >>> adv.tolist(), ret.tolist()
    ([[0.5, 0.5, 0.5]], [[1.0, 1.0, 1.0]])
"""

from __future__ import annotations

import torch
from torch import Tensor


def token_rewards(scores: Tensor, mask: Tensor) -> Tensor:
    """[B, T] rewards: each row's sequence score `scores [B]` on its last policy token (0 elsewhere;
    a row without policy tokens gets none).

    >>> token_rewards(torch.tensor([2., 3.]), torch.tensor([[0., 1., 1., 0.], [0., 0., 0., 0.]])).tolist()
    [[0.0, 0.0, 2.0, 0.0], [0.0, 0.0, 0.0, 0.0]]
    """
    width = mask.shape[1]
    cols = torch.arange(width, device=mask.device).expand_as(mask)
    last = torch.where(mask > 0, cols, -1).max(dim=1).values
    out = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    has = last >= 0
    out[has.nonzero(as_tuple=True)[0], last[has]] = scores.to(out.dtype).to(mask.device)[has]
    return out


def gae_advantages(rewards: Tensor, values: Tensor, mask: Tensor, *, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016) over the policy tokens of each row.

    delta_t = r_t + gamma * V_next - V_t;  A_t = delta_t + gamma * lam * A_next;  returns_t = A_t + V_t,
    where "next" is the next token with mask 1 (V and A are 0 after the last one). Returns
    `(advantages, returns)`, both [B, T] float32 and 0 where mask is 0. Not whitened (`whiten`).
    """
    if not (rewards.shape == values.shape == mask.shape):
        raise ValueError(f"gae: rewards {tuple(rewards.shape)}, values {tuple(values.shape)}, mask {tuple(mask.shape)} must match")
    r, v, m = rewards.double(), values.double(), mask > 0
    next_value = torch.zeros(r.shape[0], dtype=torch.float64, device=r.device)
    next_adv = torch.zeros_like(next_value)
    adv = torch.zeros_like(r)
    for t in range(r.shape[1] - 1, -1, -1):
        here = m[:, t]
        delta = r[:, t] + gamma * next_value - v[:, t]
        a = delta + gamma * lam * next_adv
        adv[:, t] = torch.where(here, a, 0.0)
        next_adv = torch.where(here, a, next_adv)
        next_value = torch.where(here, v[:, t], next_value)
    returns = torch.where(m, adv + v, 0.0)
    return adv.float(), returns.float()


def whiten_sums(x: Tensor, mask: Tensor) -> Tensor:
    """float64 [count, sum, sum of squares] of `x` over mask 1: what the ranks all-reduce before `whiten`."""
    m = (mask > 0).double()
    xd = x.double() * m
    return torch.stack([m.sum(), xd.sum(), (xd * x.double()).sum()])


def whiten(x: Tensor, mask: Tensor, sums: Tensor, eps: float = 1e-8) -> Tensor:
    """(x - mean) / sqrt(var + eps) over the masked tokens of the whole batch (`sums`: `whiten_sums`,
    summed over the ranks), 0 where mask is 0; unbiased variance as verl's `masked_whiten`.

    >>> x = torch.tensor([[1., 3., 9.]]); m = torch.tensor([[1., 1., 0.]])
    >>> whiten(x, m, whiten_sums(x, m)).tolist()  # mean 2, unbiased var 2
    [[-0.7071067690849304, 0.7071067690849304, 0.0]]
    """
    n, s, sq = sums.tolist()
    if n < 1:
        return torch.zeros_like(x)
    mean = s / n
    var = (sq - n * mean * mean) / (n - 1) if n > 1 else 0.0
    out = (x.double() - mean) / (max(var, 0.0) + eps) ** 0.5
    return (out * (mask > 0)).to(x.dtype)


def value_loss(vpreds: Tensor, old_values: Tensor, returns: Tensor, cliprange: float) -> tuple[Tensor, Tensor]:
    """PPO's clipped value loss per token: 0.5 * max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2),
    and whether the clipped term was the larger (the clip fraction). `cliprange` 0: unclipped.
    Aggregate over the loss tokens like the policy loss (`losses.agg_loss`).

    >>> loss, clipped = value_loss(torch.tensor([2.0]), torch.tensor([0.0]), torch.tensor([1.0]), 0.5)
    >>> loss.tolist(), clipped.tolist()  # unclipped (2-1)^2 = 1; clipped to 0.5: (0.5-1)^2 = 0.25
    ([0.5], [0.0])
    """
    unclipped = (vpreds - returns) ** 2
    if cliprange <= 0:
        return 0.5 * unclipped, torch.zeros_like(unclipped)
    clipped_pred = old_values + (vpreds - old_values).clamp(-cliprange, cliprange)
    clipped = (clipped_pred - returns) ** 2
    return 0.5 * torch.maximum(unclipped, clipped), (clipped > unclipped).float()
