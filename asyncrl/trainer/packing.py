"""Long sequences without padding waste: token-budget micro-batches, packed rows, chunked log-probs.

Three pure helpers the engine's forward path uses (`engine.py`); they know nothing about ranks,
optimizers or losses:

- `token_budget_groups`: row indices of a mini-batch grouped so no micro-batch holds more than a
  budget of real tokens (`trainer.max_tokens_per_micro_batch`), rows sorted by length, greedy.
- `pack` / `Packed.unpack`: a micro-batch's sequences concatenated into one `[1, N]` row with
  position ids restarting at 0 per sequence (`trainer.packing`). Hugging Face models read the
  restarts as packed sequences and keep attention inside each one, as `trainer.attn_implementation`
  says: flash-attention's varlen kernel, flex attention's document mask (sparse blocks), or with sdpa /
  eager a dense block-diagonal causal mask, O(N^2) in the packed length (only with `use_cache=False`
  and no attention mask; checked against padded logits in tests/unit/trainer/test_packing.py and
  test_speed_switches.py); scores come back in the `[b, T]` layout, so losses and corrections never
  see the packing.
- `chunked_scores`: per-token log-prob and entropy from final hidden states, `chunk` tokens at a
  time, the LM head applied per chunk and recomputed in backward (`trainer.logit_chunk_tokens`):
  no full-vocabulary logits of a whole micro-batch ever exist. `head_scores` puts it in place of a
  model's output embeddings for one forward, so FSDP2 gathers and reduces the head's weight as usual
  (a tied head shares the embedding's weight and works the same).

    groups = token_budget_groups(lengths=[5, 300, 40, 2000], budget=2048)   # [[3], [1, 2, 0]]
    packed = pack(mb)                       # packed.input_ids [1, 2345], packed.position_ids
    lp = packed.unpack(lp_packed)           # [b, T], 0 at column 0 and padding
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch
from torch import Tensor


def token_budget_groups(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Row indices grouped so each group's lengths sum to at most `budget` (a longer row is alone).

    Rows are taken longest first and each group is filled greedily, so rows of like length share a
    micro-batch (little padding when they are padded, few groups when they are packed).

    >>> token_budget_groups([5, 300, 40, 2000], budget=2048)
    [[3], [1, 2, 0]]
    """
    if budget < 1:
        raise ValueError(f"trainer.max_tokens_per_micro_batch: must be >= 1 here, got {budget}")
    groups: list[list[int]] = []
    used = 0
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        n = int(lengths[i])
        if groups and used + n <= budget:
            groups[-1].append(i)
            used += n
        else:
            groups.append([i])
            used = n
    return groups


@dataclass
class Packed:
    """One micro-batch as a single row: `input_ids` / `position_ids` [1, N], N = its real tokens."""

    input_ids: Tensor
    position_ids: Tensor
    rows: Tensor
    """[N] long: the micro-batch row each packed token came from."""
    cols: Tensor
    """[N] long: its column in that row."""
    shape: tuple[int, int]
    """(b, T) of the micro-batch."""

    def unpack(self, packed: Tensor) -> Tensor:
        """[1, N] per-token scores -> [b, T], 0 at padding and at each row's column 0 (never scored:
        there the packed row holds the previous sequence's score of a token it did not predict)."""
        out = packed.new_zeros(self.shape).index_put((self.rows, self.cols), packed[0])
        return out * (torch.arange(self.shape[1], device=out.device) > 0)

    def to(self, device: torch.device | str) -> "Packed":
        """The same packing with its tensors on `device` (packed on the host before the micro-batch loop, so
        the loop itself never waits on the device for `nonzero`'s shape)."""
        return Packed(self.input_ids.to(device), self.position_ids.to(device), self.rows.to(device), self.cols.to(device), self.shape)

    def unpack_positions(self, packed: Tensor) -> Tensor:
        """[1, N] per-position outputs (e.g. the critic's values, not scores of a predicted token) ->
        [b, T], 0 at padding only."""
        return packed.new_zeros(self.shape).index_put((self.rows, self.cols), packed[0])


def pack(input_ids: Tensor, attention_mask: Tensor) -> Packed:
    """Concatenate each row's real tokens (right padding dropped) into one row; positions restart per row."""
    real = attention_mask.bool()
    rows, cols = real.nonzero(as_tuple=True)  # row-major: each row's tokens in order, rows one after another
    return Packed(input_ids[rows, cols].unsqueeze(0), cols.unsqueeze(0), rows, cols, tuple(input_ids.shape))


def _chunk_logits(hidden: Tensor, weight: Tensor, bias: Tensor | None, temperature: float) -> Tensor:
    return torch.nn.functional.linear(hidden, weight, bias).float() / temperature


class _ChunkedHead(torch.autograd.Function):
    """The LM head and its scores, chunk by chunk, with a backward of its own: each chunk's logits are
    recomputed in backward and its weight gradient is added into ONE buffer (`addmm_`). Autograd's own
    sum of a weight used in K chunks (what `checkpoint` per chunk gave) held three weight-sized gradients
    at once: at Qwen2.5-7B's head (152k x 3584) that was 2 GiB more than the full logits of a small
    micro-batch (`asyncrl bench trainer --shape`). At most one chunk's [chunk, V] logits (fp32) and their
    softmax live at a time, forward or backward.

    Gradients, per token with p = softmax(z), z = logits / temperature: d log p[target] / dz = onehot - p;
    d entropy / dz = -p * (z - E_p[z]); then / temperature, and through the linear map."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, temperature: float,
                chunk: int, entropy_grad: bool, entropy: bool = True) -> tuple[Tensor, Tensor]:
        n = hidden.shape[0]
        lp = hidden.new_empty(n, dtype=torch.float32)
        ent = hidden.new_zeros(n, dtype=torch.float32)
        for s in range(0, n, chunk):
            z = _chunk_logits(hidden[s : s + chunk], weight, bias, temperature)
            lse = torch.logsumexp(z, dim=-1)
            lp[s : s + chunk] = z.gather(-1, targets[s : s + chunk].unsqueeze(-1)).squeeze(-1) - lse
            if entropy:  # one more pass over the chunk's [chunk, V] logits: skipped when nothing reads it
                ent[s : s + chunk] = lse - (torch.softmax(z, dim=-1) * z).sum(dim=-1)
        ctx.save_for_backward(hidden, weight, bias, targets)
        ctx.temperature, ctx.chunk, ctx.entropy_grad = temperature, chunk, entropy_grad and entropy
        if not ctx.entropy_grad:
            ctx.mark_non_differentiable(ent)
        return lp, ent

    @staticmethod
    def backward(ctx, grad_lp: Tensor, grad_ent: Tensor | None):
        hidden, weight, bias, targets = ctx.saved_tensors
        t, chunk = ctx.temperature, ctx.chunk
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros_like(weight) if need_w else None
        grad_b = torch.zeros_like(bias) if need_b and bias is not None else None
        use_ent = ctx.entropy_grad and grad_ent is not None
        for s in range(0, hidden.shape[0], chunk):
            h = hidden[s : s + chunk]
            z = _chunk_logits(h, weight, bias, t)
            p = torch.softmax(z, dim=-1)
            g = p.mul(-grad_lp[s : s + chunk].unsqueeze(-1))  # d lp: (onehot - p) * grad_lp
            g.scatter_add_(-1, targets[s : s + chunk].unsqueeze(-1), grad_lp[s : s + chunk].unsqueeze(-1))
            if use_ent:  # d entropy: -p * (z - E_p[z]) * grad_ent
                z.sub_((p * z).sum(dim=-1, keepdim=True)).mul_(p).mul_(grad_ent[s : s + chunk].unsqueeze(-1))
                g.sub_(z)
            del z, p
            g = g.div_(t).to(weight.dtype)
            if grad_h is not None:
                grad_h[s : s + chunk] = g @ weight
            if grad_w is not None:
                grad_w.addmm_(g.t(), h)
            if grad_b is not None:
                grad_b.add_(g.sum(dim=0))
        return grad_h, grad_w, grad_b, None, None, None, None, None


def chunked_scores(hidden: Tensor, weight: Tensor, bias: Tensor | None, input_ids: Tensor, *, temperature: float,
                   chunk: int, entropy_grad: bool = True, entropy: bool = True) -> tuple[Tensor, Tensor]:
    """([B, T] log-prob, [B, T] entropy) aligned like `TrainBatch` (column t scores input_ids[:, t];
    column 0 is 0) from final hidden states [B, T, H] and the LM head's `weight` [V, H] / `bias`.

    Chunks of `chunk` positions (`_ChunkedHead`): at most one chunk's [chunk, V] logits live at a time,
    forward or backward, and the head's weight gradient is one buffer. The entropy carries a gradient
    only with `entropy_grad`; without `entropy` it is not computed (zeros).
    """
    b, t, h = hidden.shape
    flat = hidden[:, :-1].reshape(-1, h)
    targets = input_ids[:, 1:].reshape(-1)
    pad = torch.nn.functional.pad
    if flat.shape[0] == 0:
        zeros = hidden.new_zeros(b, t, dtype=torch.float32)
        return zeros, zeros.clone()
    lp, ent = _ChunkedHead.apply(flat, weight, bias, targets, temperature, max(int(chunk), 1), entropy_grad, entropy)
    return pad(lp.view(b, t - 1), (1, 0)), pad(ent.view(b, t - 1), (1, 0))


@contextmanager
def head_scores(model: torch.nn.Module, input_ids: Tensor, *, temperature: float, chunk: int,
                entropy_grad: bool, entropy: bool = True) -> Iterator[None]:
    """For one forward of `model` (an HF causal LM), its output embeddings return
    `chunked_scores` stacked as [B, T, 2] (log-prob, entropy) instead of logits: the head runs
    inside the model's forward, where FSDP2 has gathered its weight."""
    head = model.get_output_embeddings()

    def forward(hidden: Tensor) -> Tensor:
        if hidden.shape[:2] != input_ids.shape:
            raise ValueError(f"head_scores: hidden states {tuple(hidden.shape)} do not match input_ids {tuple(input_ids.shape)}")
        lp, ent = chunked_scores(hidden, head.weight, head.bias, input_ids, temperature=temperature, chunk=chunk,
                                 entropy_grad=entropy_grad, entropy=entropy)
        return torch.stack([lp, ent], dim=-1)

    head.forward = forward
    try:
        yield
    finally:
        del head.forward
