"""Per-row token sampling for the torch rollout engine.

Job: from last-position logits `[B, V]` and each row's temperature / top-k / top-p and one
uniform number, pick a token per row and report its log-prob as `base.py` defines it:
log-softmax of `logits / temperature` at the token, before top-k / top-p filtering (raw
log-softmax for greedy rows, temperature 0).
Boundary: no model, no KV cache, no threads; plain tensor functions.
Why inverse-CDF with one pre-drawn uniform per token: each request draws its uniforms from its
own `torch.Generator` when it is admitted (`draw_uniforms`), so the tokens of a request depend
on its seed and its own logits only, never on which requests share the batch, and a step stays
vectorized (no Python loop over rows, one generator call per request instead of one per token).
"""

from __future__ import annotations

import torch


def draw_uniforms(seed: int, n: int) -> list[float]:
    """The `n` uniforms in [0, 1) a request with this seed consumes, one per generated token."""
    gen = torch.Generator(device="cpu")
    gen.manual_seed(seed)
    return torch.rand(n, generator=gen, dtype=torch.float64).tolist()


def _inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Index j per row with cdf[j-1] <= u * total < cdf[j]; zero-mass entries are never picked."""
    cdf = probs.cumsum(-1)
    target = (uniforms * cdf[:, -1]).unsqueeze(1)
    idx = torch.searchsorted(cdf, target, right=True).squeeze(1)
    return idx.clamp_(max=probs.shape[-1] - 1)


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    uniforms: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row; returns `(tokens [B] long, logprobs [B] float32)`.

    `temperature` [B] (0 = greedy), `top_k` [B] long (-1 = off), `top_p` [B] in (0, 1],
    `uniforms` [B] float64 in [0, 1). Filtering order is top-k then top-p on the renormalized
    top-k mass (as in HF and vLLM); the top-1 token always survives, so top_k=1 is greedy.
    """
    logits = logits.float()
    batch, vocab = logits.shape
    greedy = temperature <= 0
    temp = torch.where(greedy, torch.ones_like(temperature), temperature).to(logits.dtype)
    logp = torch.log_softmax(logits / temp.unsqueeze(1), dim=-1)
    tokens = logits.argmax(-1)

    k = torch.where(top_k < 0, torch.full_like(top_k, vocab), top_k)
    filtered = ~greedy & ((k < vocab) | (top_p < 1))
    plain = ~greedy & ~filtered

    if bool(plain.any()):
        rows = plain.nonzero().squeeze(1)
        probs = logp[rows].double().exp()
        tokens[rows] = _inverse_cdf(probs, uniforms[rows].double())

    if bool(filtered.any()):
        rows = filtered.nonzero().squeeze(1)
        sorted_logp, order = logp[rows].sort(dim=-1, descending=True, stable=True)
        probs = sorted_logp.double().exp()
        rank = torch.arange(vocab, device=logits.device)
        probs = probs * (rank.unsqueeze(0) < k[rows].unsqueeze(1))
        probs = probs / probs.sum(-1, keepdim=True)
        mass_before = probs.cumsum(-1) - probs
        probs = probs * (mass_before < top_p[rows].double().unsqueeze(1))
        idx = _inverse_cdf(probs, uniforms[rows].double())
        tokens[rows] = order.gather(1, idx.unsqueeze(1)).squeeze(1)

    return tokens, logp.gather(1, tokens.unsqueeze(1)).squeeze(1)
