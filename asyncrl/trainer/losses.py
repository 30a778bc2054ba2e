"""Policy losses, loss aggregation, KL estimators and entropy: pure per-token tensor functions.

Every function works on `[B, T]` tensors aligned like `TrainBatch` (token t scored at
position t, `mask` 1 where the token is trained on). Policy losses live in the
`POLICY_LOSSES` registry, chosen by `algorithm.loss`; they return a per-token loss and
per-token statistics, never a scalar, so the engine can aggregate over the *global*
batch (`agg_loss` with explicit normalisers) and N ranks give the same step as one.

Off-policy corrections (`corrections.py`) stay outside the losses: they choose the anchor
(`proximal_logprobs`, the proximal policy of decoupled PPO / TIS / MIS, else `old_logprobs`)
and return per-token weights that the engine multiplies into `PolicyLossOutput.loss`.

    >>> lp = torch.zeros(1, 3); old = torch.zeros(1, 3); adv = torch.ones(1, 3)
    >>> out = POLICY_LOSSES["ppo_clip"](lp, old, adv)
    >>> agg_loss(out.loss, torch.ones(1, 3), "token_mean")
    tensor(-1.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch
from torch import Tensor

AGG_MODES = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum")


@dataclass
class PolicyLossOutput:
    loss: Tensor
    """[B, T] per-token loss (not yet masked)."""
    ratio: Tensor
    """[B, T] importance ratio pi / pi_old (detached)."""
    clipped: Tensor
    """[B, T] float, 1 where the clipped branch was taken (no gradient flows)."""


class PolicyLossFn(Protocol):
    def __call__(
        self,
        logprobs: Tensor,
        old_logprobs: Tensor,
        advantages: Tensor,
        *,
        clip_ratio_low: float = 0.2,
        clip_ratio_high: float = 0.2,
        proximal_logprobs: Tensor | None = None,
        **kwargs: float,
    ) -> PolicyLossOutput: ...


POLICY_LOSSES: dict[str, PolicyLossFn] = {}


def register_policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    def deco(fn: PolicyLossFn) -> PolicyLossFn:
        if name in POLICY_LOSSES:
            raise ValueError(f"policy loss {name!r} registered twice")
        POLICY_LOSSES[name] = fn
        return fn

    return deco


@register_policy_loss("ppo_clip")
def ppo_clip(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    proximal_logprobs: Tensor | None = None,
    **kwargs: float,
) -> PolicyLossOutput:
    """PPO clipped surrogate: max(-A r, -A clip(r, 1 - low, 1 + high)), r = exp(logp - anchor).

    The anchor is `proximal_logprobs` when given (decoupled PPO), else `old_logprobs`.

    >>> out = ppo_clip(torch.tensor([[0.5]]), torch.zeros(1, 1), torch.ones(1, 1))
    >>> round(out.loss.item(), 4), out.clipped.item()  # r = 1.6487 clipped to 1.2
    (-1.2, 1.0)
    """
    anchor = old_logprobs if proximal_logprobs is None else proximal_logprobs
    ratio = torch.exp(logprobs - anchor)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    loss = torch.maximum(unclipped, clipped)
    return PolicyLossOutput(loss=loss, ratio=ratio.detach(), clipped=(clipped > unclipped).float())


@register_policy_loss("vanilla_pg")
def vanilla_pg(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    proximal_logprobs: Tensor | None = None,
    **kwargs: float,
) -> PolicyLossOutput:
    """Unclipped importance-weighted policy gradient: -A exp(logp - old_logp) (on-policy: -A logp's gradient).

    >>> vanilla_pg(torch.zeros(1, 1), torch.zeros(1, 1), torch.full((1, 1), 2.0)).loss
    tensor([[-2.]])
    """
    anchor = old_logprobs if proximal_logprobs is None else proximal_logprobs
    ratio = torch.exp(logprobs - anchor)
    return PolicyLossOutput(loss=-advantages * ratio, ratio=ratio.detach(), clipped=torch.zeros_like(ratio))


def agg_loss(
    loss: Tensor,
    mask: Tensor,
    mode: str,
    *,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
) -> Tensor:
    """Reduce a [B, T] per-token loss to a scalar over the tokens where `mask` is 1.

    - `token_mean`: sum(loss * mask) / num_tokens (default: mask.sum())
    - `seq_mean_token_mean`: sum over rows of (row token mean) / num_seqs (default: B)
    - `seq_mean_token_sum`: sum over rows of (row token sum) / num_seqs (default: B)

    Pass the *global* `num_tokens` / `num_seqs` when `loss` is one micro-batch or one
    rank's shard: the per-shard results then add up to the global mean.

    >>> agg_loss(torch.tensor([[1., 3.], [5., 0.]]), torch.tensor([[1., 1.], [1., 0.]]), "seq_mean_token_mean")
    tensor(3.5000)
    """
    mask = mask.to(loss.dtype)
    if mode == "token_mean":
        denom = mask.sum() if num_tokens is None else num_tokens
        return (loss * mask).sum() / max(float(denom), 1.0)
    row_sum = (loss * mask).sum(dim=-1)
    denom = loss.shape[0] if num_seqs is None else num_seqs
    if mode == "seq_mean_token_mean":
        return (row_sum / mask.sum(dim=-1).clamp(min=1)).sum() / max(float(denom), 1.0)
    if mode == "seq_mean_token_sum":
        return row_sum.sum() / max(float(denom), 1.0)
    raise ValueError(f"algorithm.loss_agg: unknown {mode!r}, known {list(AGG_MODES)}")


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, estimator: str) -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi (Schulman's k1/k2/k3).

    k1 = logp - ref; k2 = (logp - ref)^2 / 2; k3 = exp(ref - logp) - (ref - logp) - 1 (>= 0, unbiased).

    >>> kl_penalty(torch.tensor([0.0]), torch.tensor([-1.0]), "k3")  # e^-1 + 1 - 1
    tensor([0.3679])
    """
    diff = logprobs - ref_logprobs
    if estimator == "k1":
        return diff
    if estimator == "k2":
        return 0.5 * diff**2
    if estimator == "k3":
        return torch.exp(-diff) + diff - 1.0
    raise ValueError(f"algorithm.kl_estimator: unknown {estimator!r}, known ['k1', 'k2', 'k3']")


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of softmax(logits) over the last dim: logsumexp(z) - sum(softmax(z) z).

    >>> entropy_from_logits(torch.zeros(1, 4))  # uniform over 4: log 4
    tensor([1.3863])
    """
    logits = logits.float()
    p = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (p * logits).sum(dim=-1)


def token_logprobs(logits: Tensor, input_ids: Tensor, temperature: float = 1.0) -> Tensor:
    """log softmax(logits / T) of each next token, aligned to `input_ids`: out[:, t] scores input_ids[:, t].

    `logits[:, t]` predicts token t + 1 (HF causal LM), so position 0 has no score and is 0.

    >>> token_logprobs(torch.zeros(1, 2, 4), torch.tensor([[1, 2]]))
    tensor([[ 0.0000, -1.3863]])
    """
    z = logits[:, :-1].float() / temperature
    picked = torch.gather(z, -1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    lp = picked - torch.logsumexp(z, dim=-1)
    return torch.nn.functional.pad(lp, (1, 0))
