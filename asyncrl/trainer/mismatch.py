"""What a trainer step shows about training-inference mismatch: the `mismatch/*` metrics and verl's `rollout_probs_diff_*`.

Job: say, per trainer step, how far apart the two log-probs an off-policy correction compares are, and
what the correction did about it, so a user sees why a correction matters for their run. The anchor is
the policy the correction divides by pi_behav (`Corrector`): pi_prox with a decoupled correction
(`decoupled_ppo`, `tis`, `mis`, verl's and AReaL's in `form=decoupled`), pi_theta of the training forward
(detached) with `none`, `bypass` or `form=bypass`. Over the step's loss tokens (stale-masked ones are no
longer loss tokens), with log rho = log pi_anchor - log pi_behav and w the correction's weight:

| metric | definition |
|---|---|
| `mismatch/logprob_gap_mean`, `_max` | mean, max over loss tokens of abs(log rho) (unclamped) |
| `mismatch/k3_seq_mean`, `_max` | mean, max over sequences of the sequence's mean over its loss tokens of rho - 1 - log rho (log rho clamped at +-20): verl's `seq_mean_k3`, an estimate of KL(pi_behav, pi_anchor) per token |
| `mismatch/token_masked_share` | share of loss tokens the correction dropped (w = 0) |
| `mismatch/token_truncated_share` | share of loss tokens whose weight the correction capped |
| `mismatch/seq_masked_share` | share of sequences with at least one dropped loss token (a sequence-level rejection drops them all) |
| `mismatch/ess` | (sum w)^2 / (N sum w^2) over the N loss tokens, in [0, 1]: 1 all weights equal, 0 none left |

A sequence is a row with a loss token (`train/seqs`' count). Rows are never split across micro-batches,
mini-batches or ranks, so per-row figures are whole where they are computed; every figure leaves as a sum
or a maximum (`MismatchStats`) and is reduced once per step, over every mini-batch and rank (SUM, MAX):
exact, unlike a mean of the mini-batches' means. With no loss token every figure is 0.

Boundary: pure tensors of one micro-batch plus that one reduction; what the correction is and how its
weights are made are `corrections.py`'s, the metric names' meaning for users is docs/algorithms.md's.

    stats = MismatchStats(device)
    for mb in micro_batches: stats.add(corrector(...), mb.loss_mask)
    metrics.update(stats.metrics(world))     # collective when world > 1: every rank calls it
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from asyncrl.trainer.corrections import LOG_RATIO_LIMIT, CorrectionOutput

if TYPE_CHECKING:
    from asyncrl.trainer.batch import TrainBatch

SUMS = ("tokens", "gap", "masked", "truncated", "weight", "weight_sq", "seqs", "k3_seq", "masked_seqs")
"""What `mismatch_sums` adds up, in its order."""
MAXIMA = ("gap", "k3_seq")
"""What `mismatch_sums` keeps the largest of (-inf where there is none)."""


def mismatch_sums(out: CorrectionOutput, mask: Tensor) -> tuple[Tensor, Tensor]:
    """(float64 [9] sums in `SUMS`' order, float64 [2] maxima in `MAXIMA`'s) of one micro-batch's loss tokens.

    >>> from asyncrl.config import AlgorithmConfig
    >>> from asyncrl.trainer.corrections import Corrector
    >>> out = Corrector(AlgorithmConfig())(torch.zeros(1, 2), torch.tensor([[0.0, -0.5]]), torch.ones(1, 2), proximal_logprobs=torch.zeros(1, 2))
    >>> [round(x, 4) for x in mismatch_sums(out, torch.ones(1, 2))[0].tolist()[:2]]
    [2.0, 0.5]
    """
    m = mask.double()
    live = m > 0
    w, d = out.weight.double(), out.log_ratio.double()
    per_tok = torch.stack([m, d.abs(), out.masked.double(), out.clipped.double(), w, w * w]) * m
    row_tokens = m.sum(dim=-1)
    rows = row_tokens > 0
    safe = d.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)  # in float64: a gap of 1e-7 keeps its k3 of 5e-15
    # masked, never indexed by a mask: nothing waits for a count from the device (rows without a loss token: 0 / -inf)
    k3_row = ((torch.expm1(safe) - safe) * m).sum(dim=-1) / row_tokens.clamp(min=1)
    masked_rows = ((out.masked.double() * m).sum(dim=-1) > 0) & rows
    per_row = torch.stack([rows.sum(), (k3_row * rows).sum(), masked_rows.sum()]).double()
    sums = torch.cat([per_tok.sum(dim=(1, 2)), per_row])
    maxima = torch.stack([d.abs().masked_fill(~live, -math.inf).max(), k3_row.masked_fill(~rows, -math.inf).max()])
    return sums, maxima


def mismatch_metrics(sums: list[float], maxima: list[float]) -> dict[str, float]:
    """`mismatch/*` from `mismatch_sums`' sums and maxima reduced over a whole step (see the module's table).

    >>> mismatch_metrics([4.0, 0.4, 1.0, 0.0, 3.0, 3.0, 2.0, 0.02, 1.0], [0.3, 0.015])["mismatch/ess"]
    0.75
    """
    s = dict(zip(SUMS, sums))
    n, seqs = s["tokens"], s["seqs"]
    per_tok, per_seq = 1.0 / max(n, 1.0), 1.0 / max(seqs, 1.0)
    return {
        "mismatch/logprob_gap_mean": s["gap"] * per_tok,
        "mismatch/logprob_gap_max": maxima[0] if n else 0.0,
        "mismatch/k3_seq_mean": s["k3_seq"] * per_seq,
        "mismatch/k3_seq_max": maxima[1] if seqs else 0.0,
        "mismatch/token_masked_share": s["masked"] * per_tok,
        "mismatch/token_truncated_share": s["truncated"] * per_tok,
        "mismatch/seq_masked_share": s["masked_seqs"] * per_seq,
        "mismatch/ess": min(s["weight"] ** 2 / (n * s["weight_sq"]), 1.0) if n and s["weight_sq"] > 0 else 0.0,  # <= 1 but for rounding
    }


class MismatchStats:
    """One trainer step's `mismatch_sums`, added micro-batch by micro-batch, reduced once at the step's end."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.sums = torch.zeros(len(SUMS), dtype=torch.float64, device=device)
        self.maxima = torch.full((len(MAXIMA),), -math.inf, dtype=torch.float64, device=device)

    @torch.no_grad()
    def add(self, out: CorrectionOutput, mask: Tensor) -> None:
        sums, maxima = mismatch_sums(out, mask)
        self.sums += sums.to(self.sums.device)
        self.maxima = torch.maximum(self.maxima, maxima.to(self.maxima.device))

    def metrics(self, world: int = 1) -> dict[str, float]:
        """`mismatch_metrics` over every rank's micro-batches: with `world` > 1 a collective every rank calls."""
        if world > 1:
            import torch.distributed as dist

            dist.all_reduce(self.sums)
            dist.all_reduce(self.maxima, op=dist.ReduceOp.MAX)
        return mismatch_metrics(self.sums.tolist(), self.maxima.tolist())


def rollout_probs_diff(mb: TrainBatch, logprobs: Tensor, first: bool, version: int) -> tuple[Tensor, Tensor, Tensor]:
    """(sum, count, max) of abs(exp(behavior) - exp(trainer)) over `mb`'s loss tokens sampled at `version`, scored with the
    proximal log-probs or, without them, the first mini-batch's forward (`first`; see `TrainerEngine.forward_backward`);
    zeros (max -inf) when there are none or no log-probs of that version."""
    zero = torch.zeros((), dtype=torch.float64, device=logprobs.device)
    none = torch.full((), -math.inf, dtype=torch.float64, device=logprobs.device)
    ref = mb.proximal_logprobs if mb.proximal_logprobs is not None else (logprobs.detach() if first else None)
    if ref is None or mb.token_versions is None:
        return zero, zero, none
    fresh = (mb.loss_mask > 0) & (mb.token_versions == version)
    d = (mb.old_logprobs.exp() - ref.to(logprobs.device).exp()).abs().double()  # masked, not indexed: no host sync
    return d.where(fresh, 0.0).sum(), fresh.sum().double(), d.masked_fill(~fresh, -math.inf).max()
