"""Per-row token sampling and stopping rules for the torch rollout engine.

Job: from last-position logits `[B, V]` and each row's temperature / top-k / top-p and one
uniform number, pick a token per row and report its log-prob as `base.py` defines it:
log-softmax of `logits / temperature` at the token, before top-k / top-p filtering (raw
log-softmax for greedy rows, temperature 0).
Boundary: no model, no KV cache, no threads; plain tensor functions.
Why inverse-CDF with one pre-drawn uniform per token: each request draws its uniforms from its
own `torch.Generator` when it is admitted (`draw_uniforms`), so the tokens of a request depend
on its seed and its own logits only, never on which requests share the batch, and a step stays
vectorized (no Python loop over rows, one generator call per request instead of one per token).

Stopping (`model_eos_ids`, `StopRule`): a model's EOS ids are the union of its
`generation_config.json` `eos_token_id` (an int or a list), its config's and its tokenizer's
(a ChatML `<|im_end|>` in the generation config must stop a base model whose tokenizer EOS is
`<|endoftext|>`). Stop strings are matched on the decoded tail of the response after each token
(`skip_special_tokens=True`, as vLLM does); the token that completes a string is kept, with its
log-prob, so ids and log-probs stay exactly what was sampled.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(model_path: str | os.PathLike) -> Any | None:
    """The HF tokenizer saved in `model_path`, or None when the folder has no tokenizer files."""
    if not any((Path(model_path) / name).exists() for name in TOKENIZER_FILES):
        return None
    from asyncrl.hf_imports import auto_tokenizer

    return auto_tokenizer(model_path)


def _ids(value: Any) -> set[int]:
    if value is None:
        return set()
    return {int(value)} if isinstance(value, int) else {int(v) for v in value}


def model_eos_ids(generation_eos: Any, config_eos: Any, tokenizer: Any | None) -> frozenset[int]:
    """Every id that ends a response: generation config, model config and tokenizer EOS together."""
    ids = _ids(generation_eos) | _ids(config_eos)
    if tokenizer is not None:
        ids |= _ids(tokenizer.eos_token_id)
    return frozenset(ids)


def folder_eos_ids(model_path: str | os.PathLike) -> frozenset[int]:
    """`model_eos_ids` read off a model folder (`generation_config.json`, `config.json`, tokenizer),
    for engines that do not load the HF model themselves (vLLM)."""
    import json

    def eos_of(name: str) -> Any:
        f = Path(model_path) / name
        return json.loads(f.read_text()).get("eos_token_id") if f.exists() else None

    return model_eos_ids(eos_of("generation_config.json"), eos_of("config.json"), load_tokenizer(model_path))


class StopRule:
    """`token in rule` (asked by the engine right after `token` was appended to `tokens`): True
    when it is a stop id, or when its text completes one of `strings` in the decoded response.

    Only the last `window` tokens are decoded (enough for the longest string even at one byte per
    token), so a step costs O(longest string), not O(response). A string never matches across the
    prompt boundary (as in vLLM: stop strings are searched in generated text only).

        rule = StopRule({2}, ["\n\n"], tokens, tok.decode)
    """

    def __init__(self, ids: Iterable[int], strings: list[str], tokens: list[int],
                 decode: Callable[[list[int]], str]) -> None:
        self.ids = frozenset(ids)
        self.strings = list(strings)
        self.tokens = tokens
        """The request's own token list (the engine appends to it)."""
        self.decode = decode
        self.window = 4 * max((len(x.encode()) for x in self.strings), default=0) + 2

    def __contains__(self, token: object) -> bool:
        if token in self.ids:
            return True
        if not self.strings:
            return False
        tail = self.decode(self.tokens[-self.window:])
        return any(x in tail for x in self.strings)


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
