"""Policy losses of verl's `core_algos.py` beyond PPO's clip: `clip_cov`, `kl_cov` (Cui et al. 2025, "The Entropy
Mechanism of RL for Reasoning LMs") and `reinforce` (verl's bypass-mode REINFORCE), registered in `POLICY_LOSSES`.

Job: the per-token loss of each, equal to verl's own on verl's inputs (values and gradients;
`tests/unit/trainer/test_peer_equivalence.py`). Boundary: as `losses.py`, per-token terms of one micro-batch,
aggregated by the engine; this module holds the math only, `losses.py` registers `ENTRIES` (no import cycle). `clip_cov` and `kl_cov` pick tokens by the covariance of advantage and log-prob over
the micro-batch's loss tokens, as verl does over its micro-batch; `clip_cov` draws which of the candidate
tokens lose their gradient with `torch.randperm` (verl's draw, from torch's global generator).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:  # losses.py registers these (ENTRIES): importing it here would be a cycle
    from asyncrl.trainer.losses import LossInputs

Terms = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
"""(per-token loss, detached ratio, clipped): `losses.py` makes them a `PolicyLossOutput`."""


def check_setting(ok: bool, field: str, msg: str) -> None:
    if not ok:
        raise ValueError(f"{field} {msg}")


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """verl's `masked_mean` over all elements (its 1e-8 included)."""
    return (torch.where(mask.bool(), x, 0.0) * mask).sum() / (mask.sum() + 1e-8)


@dataclass(frozen=True)
class ClipCovSettings:
    """`clip_cov`'s constants (verl: `actor_rollout_ref.actor.policy_loss.clip_cov_*`); its PPO clip range is the
    shared `algorithm.clip_ratio_low` / `_high`."""

    clip_cov_ratio: float = 0.0002
    """Fraction of the micro-batch's loss tokens (at least one) whose gradient is cut, drawn among those with covariance in (clip_cov_lb, clip_cov_ub) that PPO's clip left alone."""
    clip_cov_lb: float = 1.0
    """Lower bound (exclusive) of the covariance (A - mean A)(logp - mean logp) of a candidate token."""
    clip_cov_ub: float = 5.0
    """Upper bound (exclusive) of a candidate token's covariance."""

    def __post_init__(self) -> None:
        check_setting(self.clip_cov_ratio > 0, "clip_cov_ratio", f"must be > 0, got {self.clip_cov_ratio}")
        check_setting(self.clip_cov_lb < self.clip_cov_ub, "clip_cov_lb", f"must be < clip_cov_ub ({self.clip_cov_ub}), got {self.clip_cov_lb}")


def clip_cov(x: LossInputs, s: ClipCovSettings) -> Terms:
    """Clip-Cov: PPO's clipped surrogate (no dual clip, ratio not clamped: verl's), with the gradient of a few
    high-covariance tokens cut (their loss is 0; counted in `clipped`)."""
    mask, adv, logp = x.mask, x.advantages, x.logprobs
    ratio = torch.exp(x.log_ratio)
    pg1 = -adv * ratio
    pg2 = -adv * torch.clamp(ratio, 1 - x.clip_ratio_low, 1 + x.clip_ratio_high)
    clip_by_origin = (pg2 > pg1) & (mask > 0)
    cov = (adv - _masked_mean(adv, mask)) * (logp - _masked_mean(logp.detach(), mask))
    cov[mask == 0] = -torch.inf
    cov[clip_by_origin] = -torch.inf
    clip_num = max(int(s.clip_cov_ratio * mask.sum().item()), 1)
    idx = torch.nonzero((cov < s.clip_cov_ub) & (cov > s.clip_cov_lb) & (mask > 0))
    if len(idx) > 0:
        idx = idx[torch.randperm(len(idx))[: min(clip_num, len(idx))]]
    corr = torch.ones_like(adv)
    corr[idx[:, 0], idx[:, 1]] = 0
    loss = torch.maximum(pg1, pg2) * corr
    return loss, ratio.detach(), (corr == 0).to(loss.dtype)


@dataclass(frozen=True)
class KLCovSettings:
    """`kl_cov`'s constants (verl: `actor_rollout_ref.actor.policy_loss.kl_cov_ratio`, `ppo_kl_coef`)."""

    kl_cov_ratio: float = 0.0002
    """Fraction of the micro-batch's loss tokens (at least one) of largest covariance that get the KL penalty."""
    ppo_kl_coef: float = 1.0
    """Weight of the absolute log ratio added to those tokens' loss."""

    def __post_init__(self) -> None:
        check_setting(self.kl_cov_ratio > 0, "kl_cov_ratio", f"must be > 0, got {self.kl_cov_ratio}")
        check_setting(self.ppo_kl_coef >= 0, "ppo_kl_coef", f"must be >= 0, got {self.ppo_kl_coef}")


def kl_cov(x: LossInputs, s: KLCovSettings) -> Terms:
    """KL-Cov: the unclipped surrogate -A r, plus ppo_kl_coef |log r| on the top kl_cov_ratio of loss tokens by
    covariance of A and logp (those are marked in `clipped`)."""
    adv, logp = x.advantages, x.logprobs
    ratio = torch.exp(x.log_ratio)
    loss = -adv * ratio
    with_kl = loss + s.ppo_kl_coef * x.log_ratio.abs()
    valid = x.mask > 0
    valid_idx = torch.nonzero(valid.reshape(-1), as_tuple=True)[0]
    a, lp = adv[valid].detach().reshape(-1), logp[valid].detach().reshape(-1)
    picked = torch.zeros_like(valid)
    if len(a):
        cov = (a - a.mean()) * (lp - lp.mean())
        top = valid_idx[torch.topk(cov, max(1, int(len(cov) * s.kl_cov_ratio)), largest=True).indices]
        picked.view(-1)[top] = True
    return torch.where(picked, with_kl, loss), ratio.detach(), picked.to(loss.dtype)


def reinforce(x: LossInputs, s: object) -> Terms:
    """REINFORCE: -A logp (verl's `compute_policy_loss_reinforce`). With an off-policy correction the IS weight
    multiplies it (verl's bypass mode with `loss_type=reinforce`: w from pi_theta / pi_behav, detached)."""
    ratio = torch.exp(x.log_ratio.clamp(-20.0, 20.0)).detach()
    return -x.advantages * x.logprobs, ratio, torch.zeros_like(ratio)


ENTRIES: dict[str, tuple[Callable[..., Terms], type | None]] = {
    "clip_cov": (clip_cov, ClipCovSettings),
    "kl_cov": (kl_cov, KLCovSettings),
    "reinforce": (reinforce, None),
}
"""name -> (function, settings dataclass or None: no settings); `losses.py` registers them."""
