"""One trainer step's metrics: a mini-batch's sums over its micro-batches (`MiniBatchSums`) and the merge
rule over mini-batches (`merge_minibatch_metrics`).

Tensors and metric dicts; no models. The sums stay on the device while the micro-batches run (no host
sync in the loop) and are reduced over the ranks once per mini-batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from asyncrl.trainer.corrections import CorrectionOutput, age_metrics, age_sums, stat_max, stat_metrics, stat_sums


@dataclass
class MiniBatchSums:
    """sums [15]: loss, pg_loss, kl, entropy, clipped, ratio, dual-clipped (loss-token sums), the correction's
    `stat_sums`, then rollout_probs_diff's sum and count; extremes [4]: max ratio, -min ratio, max IS weight,
    max rollout_probs_diff; by_age [eta + 2, 3]: `age_sums`."""

    sums: Tensor
    extremes: Tensor
    by_age: Tensor

    @classmethod
    def zeros(cls, eta: int, device: torch.device) -> "MiniBatchSums":
        return cls(torch.zeros(15, dtype=torch.float64, device=device), torch.full((4,), -math.inf, dtype=torch.float64, device=device),
                   torch.zeros(eta + 2, 3, dtype=torch.float64, device=device))

    @torch.no_grad()
    def add(self, *, loss: Tensor, pg_loss: Tensor, per_token: Tensor, ratio: Tensor, corr: CorrectionOutput, mask: Tensor,
            ages: Tensor | None, eta: int, diff: tuple[Tensor, Tensor, Tensor]) -> None:
        """One micro-batch: `per_token` [5, b, T] is kl, entropy, clipped, ratio, dual-clipped; `diff` is
        `mismatch.rollout_probs_diff`'s (sum, count, max). Masked, never indexed by the mask: nothing waits for a
        count from the device."""
        self.sums[:13] += torch.cat([torch.stack([loss, pg_loss]).double(), (per_token.double() * mask).sum(dim=(1, 2)), stat_sums(corr, mask)])
        self.sums[13:] += torch.stack([diff[0], diff[1]])
        if ages is not None:
            self.by_age += age_sums(corr, mask, ages, eta)
        live, r = mask > 0, ratio.double()
        r_max, r_min = r.masked_fill(~live, -math.inf).max(), r.masked_fill(~live, math.inf).min()
        self.extremes = torch.maximum(self.extremes, torch.stack([r_max, -r_min, stat_max(corr, mask), diff[2]]))

    def metrics(self, world: int, num_tokens: float, num_seqs: float, entropy: bool) -> dict[str, float]:
        """The mini-batch's metrics (see `TrainerEngine.forward_backward`), reduced over the ranks first (with
        `world` > 1 a collective every rank calls); `entropy`: the entropy was computed."""
        if world > 1:
            dist.all_reduce(self.sums)
            dist.all_reduce(self.extremes, op=dist.ReduceOp.MAX)
            dist.all_reduce(self.by_age)
        s, e = self.sums.tolist(), self.extremes.tolist()
        per_token = 1.0 / max(num_tokens, 1.0)
        diff = {"rollout_probs_diff_mean": s[13] / s[14], "rollout_probs_diff_max": e[3], "rollout_probs_diff_tokens": s[14]} if s[14] else {}
        return {
            "loss": s[0], "pg_loss": s[1], "kl": s[2] * per_token, **({"entropy": s[3] * per_token} if entropy else {}),
            "clip_frac": s[4] * per_token, "ratio_mean": s[5] * per_token, "clip_frac_lower": s[6] * per_token,
            "ratio_max": e[0] if num_tokens else 0.0, "ratio_min": -e[1] if num_tokens else 0.0,
            "tokens": num_tokens, "seqs": num_seqs, **stat_metrics(s[7:13], e[2], num_tokens), **age_metrics(self.by_age), **diff,
        }  # fmt: skip


def merge_minibatch_metrics(parts: list[dict[str, float]]) -> dict[str, float]:
    """One trainer step's metrics from its mini-batches' (means; sums for counts; extremes kept).

    >>> merge_minibatch_metrics([{"loss": 1.0, "tokens": 4, "ratio_max": 1.5}, {"loss": 3.0, "tokens": 6, "ratio_max": 1.2}])
    {'loss': 2.0, 'tokens': 10, 'ratio_max': 1.5}
    """
    out: dict[str, float] = {}
    for key in dict.fromkeys(k for p in parts for k in p):  # a key some mini-batches lack (a token age none of theirs has) merges over the others
        vals = [p[key] for p in parts if key in p]
        if key in ("tokens", "seqs") or key.endswith(("/tokens", "_tokens")):
            out[key] = sum(vals)
        elif key.endswith("_max"):
            out[key] = max(vals)
        elif key.endswith("_min"):
            out[key] = min(vals)
        else:
            out[key] = sum(vals) / len(vals)
    return out
