"""Off-policy corrections: per-token weights that make stale, asynchronously generated samples usable.

Three policies meet in an asynchronous step: the behavior policy pi_behav that sampled the
tokens (its log-probs ride in `TrainBatch.old_logprobs`, one version per token in
`token_versions`), the proximal policy pi_prox that anchors the PPO trust region, and the
current policy pi_theta being trained. A correction picks pi_prox and turns the per-token
ratio rho = pi_prox / pi_behav into a detached weight w that multiplies the policy loss:

    loss_t = w_t * policy_loss(logp_theta, anchor = pi_prox)_t

| `algorithm.correction` | anchor | w | tokens dropped (w = 0) |
|---|---|---|---|
| `none`, `bypass` | pi_behav | 1 | none |
| `decoupled_ppo` (AReaL) | pi_prox | rho | rho > is_cap (if is_cap > 0) |
| `tis` | pi_prox | min(rho, is_cap) | none |
| `mis` | pi_prox | rho' | rho' outside [mis_low, mis_high] |
| `token_tis`, `seq_tis`, `seq_mis`, `icepop`, `geo_rs`, `k3_rs`, `m2po` | see `rollout_corr.py` (verl's rollout correction, AReaL's IcePop / M2PO) | | |

with rho' = rho (token level) or the geometric mean of rho over the sequence's loss tokens
(sequence level; a product would make the bounds mean different things at different lengths).
Dropped tokens still count in the loss normaliser: masking shrinks the step, it does not
re-weight the survivors. With pi_behav == pi_prox every correction is plain PPO (w = 1).

An entry with a settings dataclass (`register_correction(..., settings=...)`, set as
`algorithm.correction_args.<field>`) is given the unclamped, masked log rho too and may define both
forms: `form=decoupled` (anchor pi_prox, rho = pi_prox / pi_behav) and `form=bypass` (anchor pi_behav,
rho = pi_theta / pi_behav from the training forward, detached: verl's bypass mode).

pi_prox comes from `algorithm.proximal`:
- `recompute`: one `compute_logprobs` pass with the step's starting weights (`needs_proximal`);
- `interpolate`: log pi_prox = log pi_behav + alpha (log pi_theta - log pi_behav), the log-linear
  form of AReaL with alpha = (v_prox - v_tok) / (v_theta - v_tok). The trainer takes one optimizer
  step per batch, so v_prox = v_theta = the version at the start of the step and log pi_theta is
  the training forward's own (detached) output: alpha = 1 for stale tokens (v_tok < version) and
  0 for fresh ones, at no extra forward pass. The only difference from `recompute` is that fresh
  tokens keep w = 1, ignoring trainer/inference numerical mismatch.

This module is pure tensors: no model, no ranks. Statistics leave as additive sums
(`stat_sums`, `stat_max`) so the engine reduces them over micro-batches and ranks, then
`stat_metrics` names them `correction/*` (per mini-batch); what the same outputs say about the
training-inference mismatch over a whole step is `mismatch.py`'s (`mismatch/*`).

    corrector = Corrector(AlgorithmConfig(correction="tis", is_cap=2.0))
    out = corrector(logp.detach(), behav, mask, proximal_logprobs=prox)
    x = LossInputs.of(logp, behav, adv, mask, proximal_logprobs=out.proximal_logprobs)
    loss = POLICY_LOSSES["ppo_clip"](x).loss * out.weight
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol

import torch
from torch import Tensor

from asyncrl.registry import Registry
from asyncrl.trainer import rollout_corr

if TYPE_CHECKING:  # config checks read CORRECTIONS: importing the config here would be a cycle
    from asyncrl.config import AlgorithmConfig

LOG_RATIO_LIMIT = 20.0
"""|log rho| is clamped here so exp() stays finite (e^20 ~ 5e8: far past any cap)."""


@dataclass
class CorrectionOutput:
    proximal_logprobs: Tensor | None
    """[B, T] the PPO anchor, or None: anchor on the behavior policy (`old_logprobs`)."""
    weight: Tensor
    """[B, T] detached weight w of each token's policy loss (0 = dropped)."""
    ratio: Tensor
    """[B, T] rho = pi_prox / pi_behav before any cap or mask (1 off the loss mask)."""
    clipped: Tensor
    """[B, T] float, 1 where the weight was truncated (tis)."""
    masked: Tensor
    """[B, T] float, 1 where the token was dropped (w = 0 on a loss token)."""
    kl: Tensor
    """[B, T] k3 estimate of KL(pi_behav || pi_prox) from behavior samples: rho - 1 - log rho."""
    log_ratio: Tensor
    """[B, T] log rho = log pi_anchor - log pi_behav, unclamped (0 off the loss mask): the gap `mismatch.py` reports."""


class WeightFn(Protocol):
    def __call__(self, ratio: Tensor, mask: Tensor, **constants: float | str) -> tuple[Tensor, Tensor, Tensor]:
        """(weight, clipped, masked) from rho [B, T] and the loss mask."""
        ...


class SettingsWeightFn(Protocol):
    def __call__(self, ratio: Tensor, mask: Tensor, *, log_ratio: Tensor, settings: Any) -> tuple[Tensor, Tensor, Tensor]:
        """(weight, clipped, masked) from rho, the loss mask, log rho (masked, unclamped) and the entry's settings."""
        ...


@dataclass(frozen=True)
class Correction:
    weight_fn: WeightFn | SettingsWeightFn
    uses_proximal: bool
    """False: the anchor is the behavior policy and no pi_prox is needed (with settings: their `form`, if any, decides)."""
    settings: type | None = None
    """The dataclass of `algorithm.correction_args` (a `SettingsWeightFn` then); None: the flat `algorithm.is_cap` / `mis_*` keys."""

    def make_settings(self, args: Mapping[str, Any] | None = None) -> Any:
        """The settings object of `algorithm.correction_args`; a bad name or type is a ValueError naming the key."""
        if self.settings is None:
            if args:
                raise ValueError(f"algorithm.correction_args: this correction has no settings of its own (its keys: algorithm.is_cap, mis_*), got {dict(args)}")
            return None
        hints, names = typing.get_type_hints(self.settings), [f.name for f in dataclasses.fields(self.settings)]
        for key, value in (args or {}).items():
            if key not in names:
                raise ValueError(f"algorithm.correction_args.{key}: not a setting of this correction (its settings: {names})")
            if hints[key] is float and type(value) is int:
                args = {**args, key: float(value)}
            elif hints[key] in (bool, int, float, str) and type(value) is not hints[key]:
                raise ValueError(f"algorithm.correction_args.{key}: must be a {hints[key].__name__}, got {value!r}")
        return self.settings(**(args or {}))

    def proximal_for(self, settings: Any) -> bool:
        """Whether this entry, with these settings, anchors on pi_prox (`form=decoupled`) or on pi_behav (`bypass`)."""
        form = getattr(settings, "form", None)
        return self.uses_proximal if form is None else form == "decoupled"


CORRECTIONS: Registry[Correction] = Registry("correction", "algorithm.correction", import_paths=False)
"""No import paths: an entry is a `Correction` (its weight function and whether it needs pi_prox), not a bare callable."""


def register_correction(name: str, *, uses_proximal: bool, settings: type | None = None) -> Callable[[Any], Any]:
    """Decorator: `@register_correction("my_is", uses_proximal=True)` makes it selectable as `algorithm.correction=my_is`;
    with `settings=MySettings` (a dataclass, every field defaulted) its fields are `algorithm.correction_args.<field>`."""
    if settings is not None:
        settings()  # every field needs a valid default

    def deco(fn: Any) -> Any:
        CORRECTIONS.add(name, Correction(fn, uses_proximal, settings))
        return fn

    return deco


@register_correction("none", uses_proximal=False)
def no_correction(ratio: Tensor, mask: Tensor, **constants: float | str) -> tuple[Tensor, Tensor, Tensor]:
    """Plain PPO with old = behavior policy: w = 1.

    >>> no_correction(torch.tensor([[3.0]]), torch.ones(1, 1))[0]
    tensor([[1.]])
    """
    zero = torch.zeros_like(ratio)
    return torch.ones_like(ratio), zero, zero


register_correction("bypass", uses_proximal=False)(no_correction)


@register_correction("decoupled_ppo", uses_proximal=True)
def decoupled_ppo(ratio: Tensor, mask: Tensor, *, is_cap: float = 0.0, **constants: float | str) -> tuple[Tensor, Tensor, Tensor]:
    """AReaL decoupled PPO: w = rho, tokens with rho > is_cap dropped (is_cap 0: no cap).

    >>> decoupled_ppo(torch.tensor([[0.5, 3.0]]), torch.ones(1, 2), is_cap=2.0)[0]
    tensor([[0.5000, 0.0000]])
    """
    keep = ratio <= is_cap if is_cap > 0 else torch.ones_like(ratio, dtype=torch.bool)
    return torch.where(keep, ratio, 0.0), torch.zeros_like(ratio), (~keep).float() * mask


@register_correction("tis", uses_proximal=True)
def truncated_is(ratio: Tensor, mask: Tensor, *, is_cap: float = 2.0, **constants: float | str) -> tuple[Tensor, Tensor, Tensor]:
    """Truncated importance sampling: w = min(rho, is_cap).

    >>> truncated_is(torch.tensor([[0.5, 3.0]]), torch.ones(1, 2), is_cap=2.0)[0]
    tensor([[0.5000, 2.0000]])
    """
    return ratio.clamp(max=is_cap), (ratio > is_cap).float() * mask, torch.zeros_like(ratio)


@register_correction("mis", uses_proximal=True)
def masked_is(
    ratio: Tensor, mask: Tensor, *, mis_low: float = 0.5, mis_high: float = 2.0, mis_level: str = "token", **constants: float | str
) -> tuple[Tensor, Tensor, Tensor]:
    """Masked importance sampling: w = rho' if mis_low <= rho' <= mis_high else 0.

    rho' is rho (`token`) or exp(mean of log rho over the row's loss tokens) (`sequence`).

    >>> masked_is(torch.tensor([[1.5, 3.0]]), torch.ones(1, 2), mis_level="token")[0]
    tensor([[1.5000, 0.0000]])
    """
    if mis_level == "sequence":
        mean_log = (ratio.log() * mask).sum(dim=-1, keepdim=True) / mask.sum(dim=-1, keepdim=True).clamp(min=1)
        ratio = mean_log.exp().expand_as(ratio)
    elif mis_level != "token":
        raise ValueError(f"algorithm.mis_level: unknown {mis_level!r}, known ['token', 'sequence']")
    keep = (ratio >= mis_low) & (ratio <= mis_high)
    return torch.where(keep, ratio, 0.0), torch.zeros_like(ratio), (~keep).float() * mask


for _name, (_fn, _settings) in rollout_corr.ENTRIES.items():  # verl's and AReaL's: token_tis ... m2po
    register_correction(_name, uses_proximal=True, settings=_settings)(_fn)


def interpolate_proximal(logprobs: Tensor, behavior_logprobs: Tensor, token_versions: Tensor, version: int) -> Tensor:
    """log pi_prox = log pi_behav + alpha (log pi_theta - log pi_behav), alpha = 1 if 0 <= v_tok < version else 0.

    >>> interpolate_proximal(torch.tensor([[-1.0, -1.0]]), torch.tensor([[-2.0, -2.0]]), torch.tensor([[3, 5]]), 5)
    tensor([[-1., -2.]])
    """
    alpha = ((token_versions >= 0) & (token_versions < version)).to(logprobs.dtype)
    return behavior_logprobs + alpha * (logprobs - behavior_logprobs)


class Corrector:
    """The configured correction: declares whether it needs recomputed pi_prox, then weights tokens.

        corrector = Corrector(cfg.algorithm)
        if corrector.needs_proximal: batch = batch.replace(proximal_logprobs=engine.compute_logprobs(batch))
        out = corrector(logp.detach(), mb.old_logprobs, mb.loss_mask, proximal_logprobs=mb.proximal_logprobs,
                        token_versions=mb.token_versions, version=engine.step)
    """

    def __init__(self, algorithm: AlgorithmConfig) -> None:
        self.spec = CORRECTIONS.get(algorithm.correction)  # unknown: a KeyError naming algorithm.correction
        self.settings = self.spec.make_settings(algorithm.correction_args)
        self.uses_proximal = self.spec.proximal_for(self.settings)
        self.interpolate = self.uses_proximal and algorithm.proximal == "interpolate"
        self.needs_proximal = self.uses_proximal and not self.interpolate
        """True: the caller passes `proximal_logprobs` from a `compute_logprobs` pass at the step's start."""
        self.constants: dict[str, float | str] = dict(
            is_cap=algorithm.is_cap, mis_low=algorithm.mis_low, mis_high=algorithm.mis_high, mis_level=algorithm.mis_level
        )

    def __call__(
        self,
        logprobs: Tensor,
        behavior_logprobs: Tensor,
        mask: Tensor,
        *,
        proximal_logprobs: Tensor | None = None,
        token_versions: Tensor | None = None,
        version: int = 0,
    ) -> CorrectionOutput:
        """`logprobs`: pi_theta's (detached); for `none` they stand in for pi_prox in the statistics only."""
        logprobs = logprobs.detach()
        if self.interpolate:
            if token_versions is None:
                raise ValueError("algorithm.proximal=interpolate needs TrainBatch.token_versions")
            proximal_logprobs = interpolate_proximal(logprobs, behavior_logprobs, token_versions, version)
        elif self.needs_proximal and proximal_logprobs is None:
            raise ValueError("algorithm.proximal=recompute: pass proximal_logprobs (compute_logprobs at the step's start)")
        prox = proximal_logprobs if self.uses_proximal else logprobs
        mask = mask.to(logprobs.dtype)
        raw_log_ratio = (prox - behavior_logprobs) * mask
        log_ratio = raw_log_ratio.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
        ratio = log_ratio.exp()
        if self.spec.settings is None:
            weight, clipped, masked = self.spec.weight_fn(ratio, mask, **self.constants)
        else:
            weight, clipped, masked = self.spec.weight_fn(ratio, mask, log_ratio=raw_log_ratio, settings=self.settings)
        return CorrectionOutput(
            proximal_logprobs=proximal_logprobs if self.uses_proximal else None,
            weight=weight.detach(), ratio=ratio, clipped=clipped, masked=masked, kl=ratio - 1.0 - log_ratio,
            log_ratio=raw_log_ratio,
        )  # fmt: skip


STAT_SUMS = ("ratio", "ratio_sq", "weight", "clipped", "masked", "kl")


def stat_sums(out: CorrectionOutput, mask: Tensor) -> Tensor:
    """float64 [6]: sums over loss tokens of rho, rho^2, w, clipped, masked, kl (add over micro-batches / ranks).

    >>> from asyncrl.config import AlgorithmConfig
    >>> out = Corrector(AlgorithmConfig())(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), proximal_logprobs=torch.zeros(1, 2))
    >>> stat_sums(out, torch.ones(1, 2)).tolist()
    [2.0, 2.0, 2.0, 0.0, 0.0, 0.0]
    """
    m = mask.double()
    per_tok = torch.stack([out.ratio, out.ratio**2, out.weight, out.clipped, out.masked, out.kl]).double()
    return (per_tok * m).sum(dim=(1, 2))


def stat_max(out: CorrectionOutput, mask: Tensor) -> Tensor:
    """float64 scalar: max rho over loss tokens (-inf if none); reduce with MAX."""
    return out.ratio.double().masked_fill(mask <= 0, -float("inf")).max()  # masked, not indexed: no host sync


def stat_metrics(sums: list[float], ratio_max: float, num_tokens: float) -> dict[str, float]:
    """`correction/*` metrics from the reduced sums over `num_tokens` loss tokens.

    ess = (sum rho)^2 / (N sum rho^2) in (0, 1] (1: all weights equal); is_weight_* are rho
    (before cap / mask), weight_mean is w; clip_frac, masked_frac are fractions of loss tokens.

    >>> stat_metrics([2.0, 2.0, 2.0, 0.0, 0.0, 0.0], 1.0, 2.0)["correction/ess"]
    1.0
    """
    s = dict(zip(STAT_SUMS, sums))
    n = max(num_tokens, 1.0)
    return {
        "correction/ess": s["ratio"] ** 2 / (n * s["ratio_sq"]) if s["ratio_sq"] > 0 else 0.0,
        "correction/is_weight_mean": s["ratio"] / n,
        "correction/is_weight_max": ratio_max if num_tokens else 0.0,
        "correction/weight_mean": s["weight"] / n,
        "correction/clip_frac": s["clipped"] / n,
        "correction/masked_frac": s["masked"] / n,
        "correction/behav_prox_kl": s["kl"] / n,
    }


def age_sums(out: CorrectionOutput, mask: Tensor, ages: Tensor, eta: int) -> Tensor:
    """float64 [eta + 2, 3]: per token age (trainer step - generating version; the last row: older
    than eta) the loss tokens, and their sums of rho and of the behavior-proximal kl.

    >>> from asyncrl.config import AlgorithmConfig
    >>> out = Corrector(AlgorithmConfig())(torch.zeros(1, 3), torch.zeros(1, 3), torch.ones(1, 3), proximal_logprobs=torch.zeros(1, 3))
    >>> age_sums(out, torch.ones(1, 3), torch.tensor([[0, 1, 7]]), eta=1).tolist()
    [[1.0, 1.0, 0.0], [1.0, 1.0, 0.0], [1.0, 1.0, 0.0]]
    """
    live = (mask > 0).reshape(-1, 1)  # every token added, 0 where not live: no mask indexing, no host sync
    bucket = ages.clamp(0, eta + 1).reshape(-1).to(out.ratio.device)
    vals = torch.stack([torch.ones_like(out.ratio), out.ratio, out.kl], dim=-1).double().reshape(-1, 3).where(live, 0.0)
    return torch.zeros(eta + 2, 3, dtype=torch.float64, device=vals.device).index_add_(0, bucket, vals)


def age_metrics(by_age: Tensor) -> dict[str, float]:
    """`correction/age_<a>/{tokens,is_weight_mean,behav_prox_kl}` from `age_sums` (the last age is `gt<eta>`); ages with no token are left out."""
    out: dict[str, float] = {}
    last = by_age.shape[0] - 1
    for a, (n, rho, kl) in enumerate(by_age.tolist()):
        if n:
            key = f"correction/age_{a}" if a < last else f"correction/age_gt{last - 1}"
            out.update({f"{key}/tokens": n, f"{key}/is_weight_mean": rho / n, f"{key}/behav_prox_kl": kl / n})
    return out

