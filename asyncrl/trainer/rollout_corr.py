"""The rollout-correction family of verl (`verl/trainer/ppo/rollout_corr_helper.py`) and AReaL (IcePop, M2PO)
as registered corrections: per-token weights from log rho, each equal to the peer's own on the peer's inputs
(`tests/unit/trainer/test_peer_equivalence.py`, numbers made by running the peers' code).

Job: the weight (truncated IS) and the keep mask (rejection sampling, RS) of each method, with their
bounds as settings (`algorithm.correction_args.<field>`). Boundary: pure tensors of one micro-batch, rows
are sequences (packing is undone before a correction sees them); the anchor, pi_prox and the statistics
belong to `corrections.Corrector`.

| `algorithm.correction` | peer | weight w on a loss token |
|---|---|---|
| `token_tis` | verl Token-TIS (`rollout_is=token`) | min(rho_t, threshold) |
| `seq_tis` | verl Seq-TIS (`rollout_is=sequence`) | min(exp(clamp(sum_t log rho_t, +-20)), threshold) |
| `seq_mis` | verl Seq-MIS (`decoupled_seq_is_rs`) | seq_tis's weight, 0 unless low <= exp(-sum log rho) <= high |
| `icepop` | verl IcePop (`rollout_is_threshold="low_high"`), AReaL token ratio mask | rho_t if low <= rho_t <= high else 0 |
| `geo_rs` | verl Geo-RS (`rollout_rs=seq_mean_k1`) | 0 unless low <= exp(-mean log rho) <= high; else 1 (or `tis`'s weight) |
| `k3_rs` | verl K3-RS (`rollout_rs=seq_mean_k3`) | 0 unless mean(rho - 1 - log rho) <= threshold; else 1 (or `tis`'s weight) |
| `m2po` | AReaL M2PO (`actor.m2_threshold`) | 1, or 0 for the tokens of largest (log rho)^2 until the rest average below m2_threshold |

Each entry with a `form` setting exists in both of verl's forms: `decoupled` (rho = pi_prox / pi_behav, the
PPO anchor pi_prox) and `bypass` (rho = pi_theta / pi_behav, anchor pi_behav: pair it with `algorithm.loss=reinforce`
for verl's `bypass_pg_*`, or use a rejection-only entry with `ppo_clip`, whose ratio already is the IS weight).
verl's k1 is -log rho: its bands bound pi_behav / pi (symmetric defaults make that the same as bounding rho).
Masked tokens get w = 0 and stay in the loss normaliser (asyncrl's rule: a mask shrinks the step); verl and
AReaL's M2PO drop them from it, so per-token terms and gradients are equal, a `token_mean` loss differs by
the ratio of kept to all loss tokens.

    out = Corrector(AlgorithmConfig(correction="geo_rs", correction_args={"low": 0.99, "high": 1.01}))(logp, behav, mask, proximal_logprobs=prox)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor


SAFETY_BOUND = 20.0
"""verl's clamp of a log ratio (or a sequence's sum of them) before exp."""
FORMS = ("decoupled", "bypass")
TIS_LEVELS = ("none", "token", "sequence")


def _check(ok: bool, field: str, msg: str) -> None:
    if not ok:
        raise ValueError(f"algorithm.correction_args.{field}: {msg}")


def _check_form(form: str) -> None:
    _check(form in FORMS, "form", f"must be one of {list(FORMS)}, got {form!r}")


def _check_band(low: float, high: float) -> None:
    _check(0 < low <= high, "low", f"must be > 0 and <= high ({high}), got {low}")


def _zeros(x: Tensor) -> Tensor:
    return torch.zeros_like(x)


def token_is(log_ratio: Tensor, mask: Tensor) -> Tensor:
    """verl's raw token IS weight: exp(clamp(log rho, +-20)), 0 off the mask."""
    return torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)) * mask


def seq_is(log_ratio: Tensor, mask: Tensor) -> Tensor:
    """verl's raw sequence IS weight: exp(clamp(sum of the row's log rho, +-20)) on each loss token."""
    log_sum = (log_ratio * mask).sum(dim=-1, keepdim=True).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    return torch.exp(log_sum).expand_as(log_ratio) * mask


def _masked_mean_rows(values: Tensor, mask: Tensor) -> Tensor:
    """[B, 1] verl's `masked_mean(values, mask, axis=-1)` (its 1e-8 included)."""
    return ((torch.where(mask.bool(), values, 0.0) * mask).sum(dim=-1) / (mask.sum(dim=-1) + 1e-8)).unsqueeze(-1)


def _k1_keep(stat: Tensor, low: float, high: float) -> Tensor:
    return (stat >= math.log(low)) & (stat <= math.log(high))


def _truncated(raw: Tensor, threshold: float, mask: Tensor) -> tuple[Tensor, Tensor]:
    return raw.clamp(max=threshold), (raw > threshold).to(raw.dtype) * mask


def _with_keep(weight: Tensor, clipped: Tensor, keep: Tensor, mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    keep = keep.expand_as(weight)
    return torch.where(keep, weight, 0.0), clipped * keep, (~keep).to(weight.dtype) * mask


@dataclass(frozen=True)
class TISSettings:
    """`token_tis` / `seq_tis`: verl's truncated IS (`rollout_is_threshold` as a float)."""

    threshold: float = 2.0
    """Upper bound of the IS weight (verl: `rollout_is_threshold`; typical 1.5-5 per token, 2-10 per sequence)."""
    form: str = "decoupled"
    """`decoupled` (rho = pi_prox / pi_behav) or `bypass` (rho = pi_theta / pi_behav, anchor pi_behav; verl: `bypass_mode`)."""

    def __post_init__(self) -> None:
        _check(self.threshold > 0, "threshold", f"must be > 0, got {self.threshold}")
        _check_form(self.form)


def token_tis(ratio: Tensor, mask: Tensor, *, log_ratio: Tensor, settings: TISSettings) -> tuple[Tensor, Tensor, Tensor]:
    """verl Token-TIS: w = min(rho_t, threshold)."""
    weight, clipped = _truncated(token_is(log_ratio, mask), settings.threshold, mask)
    return weight, clipped, _zeros(weight)


def seq_tis(ratio: Tensor, mask: Tensor, *, log_ratio: Tensor, settings: TISSettings) -> tuple[Tensor, Tensor, Tensor]:
    """verl Seq-TIS: w = min(prod_t rho_t, threshold) on every token of the sequence (log of the product clamped at +-20)."""
    weight, clipped = _truncated(seq_is(log_ratio, mask), settings.threshold, mask)
    return weight, clipped, _zeros(weight)


@dataclass(frozen=True)
class SeqMISSettings:
    """`seq_mis`: verl's Seq-MIS (`rollout_is=sequence` + `rollout_rs=seq_sum_k1`)."""

    threshold: float = 2.0
    """Upper bound of the sequence IS weight (verl: `rollout_is_threshold`)."""
    low: float = 0.5
    """A sequence is kept only if low <= exp(-sum log rho) (verl: the lower part of `rollout_rs_threshold`, "0.5_2.0")."""
    high: float = 2.0
    """... and exp(-sum log rho) <= high (verl: the upper part of `rollout_rs_threshold`)."""
    form: str = "decoupled"
    """`decoupled` or `bypass` (as `token_tis`'s)."""

    def __post_init__(self) -> None:
        _check(self.threshold > 0, "threshold", f"must be > 0, got {self.threshold}")
        _check_band(self.low, self.high)
        _check_form(self.form)


def seq_mis(ratio: Tensor, mask: Tensor, *, log_ratio: Tensor, settings: SeqMISSettings) -> tuple[Tensor, Tensor, Tensor]:
    """verl Seq-MIS: Seq-TIS's weight, the whole sequence dropped when its product ratio leaves [low, high]."""
    weight, clipped = _truncated(seq_is(log_ratio, mask), settings.threshold, mask)
    k1_sum = (-log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND) * mask).sum(dim=-1, keepdim=True)
    return _with_keep(weight, clipped, _k1_keep(k1_sum, settings.low, settings.high), mask)


@dataclass(frozen=True)
class IcePopSettings:
    """`icepop`: a token's IS weight kept inside a band, zeroed outside (verl: `rollout_is=token`,
    `rollout_is_threshold="low_high"`; AReaL: `rejection_sampling` level token, metric ratio, action mask)."""

    low: float = 0.5
    """Tokens with rho below this get weight 0."""
    high: float = 5.0
    """Tokens with rho above this get weight 0."""
    form: str = "decoupled"
    """`decoupled` or `bypass` (as `token_tis`'s)."""

    def __post_init__(self) -> None:
        _check_band(self.low, self.high)
        _check_form(self.form)


def icepop(ratio: Tensor, mask: Tensor, *, log_ratio: Tensor, settings: IcePopSettings) -> tuple[Tensor, Tensor, Tensor]:
    """IcePop: w = rho_t inside [low, high], else 0."""
    raw = token_is(log_ratio, mask)
    keep = (raw >= settings.low) & (raw <= settings.high)
    return torch.where(keep, raw, 0.0), _zeros(raw), (~keep).to(raw.dtype) * mask


def _tis_part(tis: str, threshold: float, log_ratio: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    if tis == "none":
        return mask.clone(), _zeros(mask)
    return _truncated((token_is if tis == "token" else seq_is)(log_ratio, mask), threshold, mask)


@dataclass(frozen=True)
class GeoRSSettings:
    """`geo_rs`: verl's geometric-mean rejection (`rollout_rs=seq_mean_k1`), optionally with verl's TIS."""

    low: float = 0.999
    """A sequence is kept only if low <= exp(-mean log rho) (verl: `rollout_rs_threshold` "0.999_1.001")."""
    high: float = 1.001
    """... and exp(-mean log rho) <= high."""
    tis: str = "none"
    """`none` (w = 1 on kept tokens), `token` or `sequence`: verl's `rollout_is` beside the rejection (its `*_geo_rs_*_tis` presets)."""
    tis_threshold: float = 2.0
    """With `tis`: the IS weight's upper bound (verl: `rollout_is_threshold`)."""
    form: str = "decoupled"
    """`decoupled` or `bypass` (as `token_tis`'s)."""

    def __post_init__(self) -> None:
        _check_band(self.low, self.high)
        _check(self.tis in TIS_LEVELS, "tis", f"must be one of {list(TIS_LEVELS)}, got {self.tis!r}")
        _check(self.tis_threshold > 0, "tis_threshold", f"must be > 0, got {self.tis_threshold}")
        _check_form(self.form)


def geo_rs(ratio: Tensor, mask: Tensor, *, log_ratio: Tensor, settings: GeoRSSettings) -> tuple[Tensor, Tensor, Tensor]:
    """Geo-RS: drop sequences whose geometric-mean ratio leaves the band."""
    weight, clipped = _tis_part(settings.tis, settings.tis_threshold, log_ratio, mask)
    stat = _masked_mean_rows(-log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND), mask)
    return _with_keep(weight, clipped, _k1_keep(stat, settings.low, settings.high), mask)


@dataclass(frozen=True)
class K3RSSettings:
    """`k3_rs`: verl's K3 rejection (`rollout_rs=seq_mean_k3`), optionally with verl's TIS."""

    threshold: float = 0.01
    """A sequence is kept only if the mean over its tokens of rho - 1 - log rho is at most this (verl: `rollout_rs_threshold`)."""
    tis: str = "none"
    """As `geo_rs`'s `tis` (verl's `*_k3_rs_*_tis` presets)."""
    tis_threshold: float = 2.0
    """With `tis`: the IS weight's upper bound."""
    form: str = "decoupled"
    """`decoupled` or `bypass` (as `token_tis`'s)."""

    def __post_init__(self) -> None:
        _check(self.threshold > 0, "threshold", f"must be > 0, got {self.threshold}")
        _check(self.tis in TIS_LEVELS, "tis", f"must be one of {list(TIS_LEVELS)}, got {self.tis!r}")
        _check(self.tis_threshold > 0, "tis_threshold", f"must be > 0, got {self.tis_threshold}")
        _check_form(self.form)


def k3_rs(ratio: Tensor, mask: Tensor, *, log_ratio: Tensor, settings: K3RSSettings) -> tuple[Tensor, Tensor, Tensor]:
    """K3-RS: drop sequences whose mean k3 divergence exceeds the threshold."""
    weight, clipped = _tis_part(settings.tis, settings.tis_threshold, log_ratio, mask)
    safe = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    stat = _masked_mean_rows(torch.exp(safe) - 1.0 - safe, mask)
    return _with_keep(weight, clipped, stat <= settings.threshold, mask)


@dataclass(frozen=True)
class M2POSettings:
    """`m2po`: AReaL's second-moment mask (decoupled form only: it compares pi_behav with pi_prox)."""

    m2_threshold: float = 0.04
    """The micro-batch's loss tokens of largest (log pi_behav - log pi_prox)^2 are dropped, largest first, until the
    rest average below this (AReaL: `actor.m2_threshold`; at least one token is kept)."""

    def __post_init__(self) -> None:
        _check(self.m2_threshold > 0, "m2_threshold", f"must be > 0, got {self.m2_threshold}")


def m2po(ratio: Tensor, mask: Tensor, *, log_ratio: Tensor, settings: M2POSettings) -> tuple[Tensor, Tensor, Tensor]:
    """M2PO: w = 1, 0 on the tokens AReaL's `_apply_m2po_masking` drops (its sort and suffix means, over the micro-batch)."""
    live = mask.reshape(-1) > 0
    m2 = (log_ratio * log_ratio).reshape(-1)[live]
    keep = torch.zeros_like(live)
    if m2.numel():
        sorted_m2, order = torch.sort(m2, descending=True)
        suffix_mean = sorted_m2.flip(0).cumsum(0).flip(0) / torch.arange(m2.numel(), 0, -1, device=m2.device, dtype=m2.dtype)
        below = torch.where(suffix_mean < settings.m2_threshold)[0]
        n_drop = int(below[0]) if len(below) else m2.numel() - 1
        kept_sorted = torch.ones_like(sorted_m2, dtype=torch.bool)
        kept_sorted[:n_drop] = False
        keep[live] = kept_sorted[torch.argsort(order)]
    keep = keep.view_as(mask)
    return keep.to(mask.dtype), _zeros(mask), (~keep).to(mask.dtype) * mask


ENTRIES: dict[str, tuple[Callable[..., tuple[Tensor, Tensor, Tensor]], type]] = {
    "token_tis": (token_tis, TISSettings),
    "seq_tis": (seq_tis, TISSettings),
    "seq_mis": (seq_mis, SeqMISSettings),
    "icepop": (icepop, IcePopSettings),
    "geo_rs": (geo_rs, GeoRSSettings),
    "k3_rs": (k3_rs, K3RSSettings),
    "m2po": (m2po, M2POSettings),
}
"""name -> (weight function, settings dataclass); `corrections.py` registers them (this module imports no registry: no cycle)."""
