"""Policy losses, loss aggregation, KL estimators and entropy: pure per-token tensor functions.

Every function works on `[B, T]` tensors aligned like `TrainBatch` (token t scored at
position t, `mask` 1 where the token is trained on). Policy losses live in the
`POLICY_LOSSES` registry, chosen by `algorithm.loss` (`ppo_clip` with dual clip, `vanilla_pg`,
`gspo`, `cispo`); every one is called with the same keywords (clip ranges, the proximal anchor,
`mask`, `clip_ratio_c`, `gspo_clip_ratio_*`) and takes the ones it uses. They return a per-token loss and
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

from asyncrl.registry import Registry

AGG_MODES = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm")


@dataclass
class PolicyLossOutput:
    loss: Tensor
    """[B, T] per-token loss (not yet masked)."""
    ratio: Tensor
    """[B, T] importance ratio pi / pi_old (detached)."""
    clipped: Tensor
    """[B, T] float, 1 where a clip bound was hit (PPO / GSPO: no gradient flows; CISPO: the IS weight is capped)."""
    dual_clipped: Tensor | None = None
    """[B, T] float, 1 where dual clip bound a negative-advantage token (`ppo_clip` only; also counted in `clipped`)."""


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
        mask: Tensor | None = None,
        **kwargs: float,
    ) -> PolicyLossOutput: ...


POLICY_LOSSES: Registry[PolicyLossFn] = Registry("policy loss", "algorithm.loss", import_paths=False)
"""`import_paths=False` while the engine looks losses up by registered name only (`POLICY_LOSSES[name]`)."""


def register_policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator: `@register_policy_loss("my_loss")` makes a loss selectable as `algorithm.loss=my_loss`."""
    return POLICY_LOSSES.register(name)


@register_policy_loss("ppo_clip")
def ppo_clip(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    proximal_logprobs: Tensor | None = None,
    clip_ratio_c: float | None = 3.0,
    **kwargs: float,
) -> PolicyLossOutput:
    """PPO clipped surrogate: max(-A r, -A clip(r, 1 - low, 1 + high)), r = exp(logp - anchor),
    with dual clip (Ye et al. 2019, verl's `clip_ratio_c`): for A < 0 the loss is at most c |A|.

    The anchor is `proximal_logprobs` when given (decoupled PPO), else `old_logprobs`. Without
    dual clip a token with A < 0 whose ratio has grown large (a stale, now likely token) gets an
    unbounded loss and gradient; with it, past r = c the loss is the constant c |A| (no gradient,
    counted in `clipped` and `dual_clipped`). `clip_ratio_c` 0 or None turns it off; else it must be > 1.

    >>> out = ppo_clip(torch.tensor([[0.5]]), torch.zeros(1, 1), torch.ones(1, 1))
    >>> round(out.loss.item(), 4), out.clipped.item()  # r = 1.6487 clipped to 1.2
    (-1.2, 1.0)
    >>> ppo_clip(torch.tensor([[2.0]]), torch.zeros(1, 1), -torch.ones(1, 1)).loss  # r = 7.39 > c = 3: loss 3 |A|
    tensor([[3.]])
    """
    anchor = old_logprobs if proximal_logprobs is None else proximal_logprobs
    ratio = torch.exp(logprobs - anchor)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    loss = torch.maximum(unclipped, clipped)
    took_clip = clipped > unclipped
    dual = torch.zeros_like(took_clip)
    if clip_ratio_c:
        if clip_ratio_c <= 1.0:
            raise ValueError(f"algorithm.clip_ratio_c: must be > 1 (or 0 = off), got {clip_ratio_c}")
        bound = -advantages * clip_ratio_c
        dual = (advantages < 0) & (loss > bound)
        loss = torch.where(dual, bound, loss)
    return PolicyLossOutput(
        loss=loss, ratio=ratio.detach(), clipped=(took_clip | dual).float(), dual_clipped=dual.float()
    )


def _masked_row_mean(x: Tensor, mask: Tensor | None, name: str) -> Tensor:
    """[B] mean of x over each row's loss tokens (0 for a row without any)."""
    if mask is None:
        raise ValueError(f"policy loss {name}: needs the loss mask (`mask=`) to average over each sequence's loss tokens")
    m = mask.to(x.dtype)
    return (x * m).sum(dim=-1) / m.sum(dim=-1).clamp(min=1)


@register_policy_loss("gspo")
def gspo(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    proximal_logprobs: Tensor | None = None,
    mask: Tensor | None = None,
    gspo_clip_ratio_low: float = 3e-4,
    gspo_clip_ratio_high: float = 4e-4,
    **kwargs: float,
) -> PolicyLossOutput:
    """GSPO (Zheng et al. 2025): PPO clip on the sequence ratio s = exp(mean over the row's loss
    tokens of (logp - anchor)), the geometric mean of its token ratios.

    Token t carries s_t = sg(s) * exp(logp_t - sg(logp_t)): its value is s, its gradient flows
    through its own log-prob only (grad of s_t = s * grad logp_t), as in the paper. The clip range
    is GSPO's own, far smaller than PPO's (`algorithm.gspo_clip_ratio_low` / `_high`; the token
    `clip_ratio_*` are ignored); when it clips, the whole sequence is clipped. `mask` is required.
    The paper aggregates per sequence: use it with `loss_agg=seq_mean_token_mean`. The log of s is
    clamped at 10 (verl) so a very stale sequence gives a large, finite ratio.

    >>> lp = torch.log(torch.tensor([[1.0, 4.0]]))  # token ratios 1 and 4: s = sqrt(4) = 2
    >>> out = gspo(lp, torch.zeros(1, 2), torch.ones(1, 2), mask=torch.ones(1, 2))
    >>> out.ratio, out.loss  # clipped to 1 + 4e-4
    (tensor([[2., 2.]]), tensor([[-1.0004, -1.0004]]))
    """
    anchor = old_logprobs if proximal_logprobs is None else proximal_logprobs
    log_s = _masked_row_mean(logprobs - anchor, mask, "gspo").detach().unsqueeze(-1)
    log_s_t = torch.clamp(logprobs - logprobs.detach() + log_s, max=10.0)
    ratio = torch.exp(log_s_t)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - gspo_clip_ratio_low, 1.0 + gspo_clip_ratio_high)
    loss = torch.maximum(unclipped, clipped)
    return PolicyLossOutput(loss=loss, ratio=ratio.detach(), clipped=(clipped > unclipped).float())


@register_policy_loss("cispo")
def cispo(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    proximal_logprobs: Tensor | None = None,
    **kwargs: float,
) -> PolicyLossOutput:
    """CISPO (MiniMax-M1): -sg(clip(r, 1 - low, 1 + high)) * A * logp, r = exp(logp - anchor).

    Unlike PPO's clip, no token loses its gradient: a clipped token still moves by its capped IS
    weight (`clipped` marks where the cap bound; `algorithm.clip_ratio_low` / `_high` set it; the
    paper leaves the lower bound loose, e.g. `clip_ratio_low` near 1). The loss value is not a
    surrogate of the return (it is -w A logp); its gradient is the capped IS policy gradient.

    >>> lp = torch.log(torch.tensor([[2.0]]))  # r = 2, capped at 1.2: loss = -1.2 * 1 * log 2
    >>> round(cispo(lp, torch.zeros(1, 1), torch.ones(1, 1)).loss.item(), 4)
    -0.8318
    """
    anchor = old_logprobs if proximal_logprobs is None else proximal_logprobs
    ratio = torch.exp(logprobs - anchor).detach()
    weight = torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    loss = -weight * advantages * logprobs
    return PolicyLossOutput(loss=loss, ratio=ratio, clipped=(weight != ratio).float())


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
    norm_len: float | None = None,
) -> Tensor:
    """Reduce a [B, T] per-token loss to a scalar over the tokens where `mask` is 1.

    - `token_mean`: sum(loss * mask) / num_tokens (default: mask.sum())
    - `seq_mean_token_mean`: sum over rows of (row token mean) / num_seqs
    - `seq_mean_token_sum`: sum over rows of (row token sum) / num_seqs
    - `seq_mean_token_sum_norm` (Dr. GRPO): sum over rows of (row token sum / norm_len) / num_seqs,
      `norm_len` a constant (`algorithm.loss_agg_norm_len`, e.g. the max response length), so a
      token weighs the same in a short and a long response.

    `num_seqs` counts the rows with at least one loss token (default: so counted here): a row
    whose tokens are all masked (a tool-only response, stale tokens dropped) adds nothing and
    must not dilute the mean. Pass the *global* `num_tokens` / `num_seqs` when `loss` is one
    micro-batch or one rank's shard: the per-shard results then add up to the global mean.

    >>> agg_loss(torch.tensor([[1., 3.], [5., 0.]]), torch.tensor([[1., 1.], [1., 0.]]), "seq_mean_token_mean")
    tensor(3.5000)
    """
    mask = mask.to(loss.dtype)
    if mode == "token_mean":
        denom = mask.sum() if num_tokens is None else num_tokens
        return (loss * mask).sum() / max(float(denom), 1.0)
    row_tokens = mask.sum(dim=-1)
    row_sum = (loss * mask).sum(dim=-1)
    denom = max(float((row_tokens > 0).sum() if num_seqs is None else num_seqs), 1.0)
    if mode == "seq_mean_token_mean":
        return (row_sum / row_tokens.clamp(min=1)).sum() / denom
    if mode == "seq_mean_token_sum":
        return row_sum.sum() / denom
    if mode == "seq_mean_token_sum_norm":
        if not norm_len or norm_len <= 0:
            raise ValueError(f"algorithm.loss_agg_norm_len: must be > 0 with loss_agg seq_mean_token_sum_norm, got {norm_len}")
        return row_sum.sum() / float(norm_len) / denom
    raise ValueError(f"algorithm.loss_agg: unknown {mode!r}, known {list(AGG_MODES)}")


KL_CLAMP_LOG_RATIO = 20.0
KL_CLAMP_VALUE = 10.0


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, estimator: str) -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi (Schulman's k1/k2/k3).

    k1 = logp - ref; k2 = (logp - ref)^2 / 2; k3 = exp(ref - logp) - (ref - logp) - 1 (>= 0,
    unbiased; verl's `low_var_kl`). k3 is clamped as the references do: the log-ratio to
    [-20, 20] before the exp and the value to [-10, 10], so a token the reference finds far less
    likely (ref - logp = 30 gives e^30 = 1e13 unclamped) costs at most 10 with a zero gradient,
    never inf / nan.

    >>> kl_penalty(torch.tensor([0.0]), torch.tensor([-1.0]), "k3")  # e^-1 + 1 - 1
    tensor([0.3679])
    >>> kl_penalty(torch.tensor([0.0]), torch.tensor([100.0]), "k3")
    tensor([10.])
    """
    diff = logprobs - ref_logprobs
    if estimator == "k1":
        return diff
    if estimator == "k2":
        return 0.5 * diff**2
    if estimator == "k3":
        log_ratio = torch.clamp(-diff, -KL_CLAMP_LOG_RATIO, KL_CLAMP_LOG_RATIO)
        return torch.clamp(torch.exp(log_ratio) - log_ratio - 1.0, -KL_CLAMP_VALUE, KL_CLAMP_VALUE)
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
