"""Policy losses, loss aggregation, KL estimators and entropy: pure per-token tensor functions.

Every function works on `[B, T]` tensors aligned like `TrainBatch` (token t scored at
position t, `mask` 1 where the token is trained on). Policy losses live in the
`POLICY_LOSSES` registry, chosen by `algorithm.loss` (`ppo_clip` with dual clip, `vanilla_pg`, `gspo`,
`cispo`; verl's `clip_cov`, `kl_cov`, `reinforce`: `losses_verl.py`). An entry (`PolicyLoss`) is a function,
the dataclass of the loss's own constants (`algorithm.loss_args.<field>`, checked against it when the config
loads) and its `level` (`sequence`: aggregated per sequence whatever `algorithm.loss_agg` says). The engine
computes what every loss shares once (`LossInputs.of`: the anchor, the log-ratio to it, the
shared PPO clip range) and calls `entry(inputs, settings)`. A loss returns a per-token loss and
per-token statistics, never a scalar, so the engine aggregates over the *global* batch
(`agg_loss` with explicit normalisers) and N ranks give the same step as one.

A new loss is one function, and one dataclass beside it if it has constants, in a module
imported before the config loads; `algorithm.loss=scaled_pg algorithm.loss_args.scale=2` selects it:

    @dataclass(frozen=True)
    class ScaledSettings:
        scale: float = 1.0
        "Multiplies the advantage (a field's docstring is its documentation)."

        def __post_init__(self) -> None:
            check_setting(self.scale > 0, "scale", f"must be > 0, got {self.scale}")

    @register_policy_loss("scaled_pg", settings=ScaledSettings)
    def scaled_pg(x: LossInputs, s: ScaledSettings) -> PolicyLossOutput:
        ratio = clamped_ratio(x.log_ratio)
        return PolicyLossOutput(-s.scale * x.advantages * ratio, ratio.detach(), torch.zeros_like(ratio))

Off-policy corrections (`corrections.py`) stay outside the losses: they choose the anchor
(`proximal_logprobs`, the proximal policy of decoupled PPO / TIS / MIS, else `old_logprobs`)
and return per-token weights that the engine multiplies into `PolicyLossOutput.loss`.

    >>> x = LossInputs.of(torch.zeros(1, 3), torch.zeros(1, 3), torch.ones(1, 3), torch.ones(1, 3))
    >>> out = POLICY_LOSSES["ppo_clip"](x)
    >>> agg_loss(out.loss, x.mask, "token_mean")
    tensor(-1.)
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Any, Callable, Literal, Mapping, Protocol

import torch
from torch import Tensor

from asyncrl.registry import Registry
from asyncrl.trainer import losses_verl

AGG_MODES = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm")

LOG_RATIO_CLAMP = 20.0
"""|log ratio| bound before the exp of a token ratio (verl): e^20 ~ 5e8 lies past any clip, and a token whose
log-ratio is beyond it (a stale, now far likelier token) gets a large finite loss and no gradient, not inf / nan."""


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


@dataclass(frozen=True)
class LossInputs:
    """What every policy loss is given, `[B, T]` each, computed once per micro-batch by the engine (`of`)."""

    logprobs: Tensor
    """log pi_theta of each token, with its gradient."""
    log_ratio: Tensor
    """`logprobs - anchor`, the anchor being the correction's proximal policy where it gives one, else the
    behaviour policy (`old_logprobs`). Not clamped: a loss bounds its own exp (`clamped_ratio`)."""
    advantages: Tensor
    mask: Tensor
    """1 at the tokens trained on."""
    clip_ratio_low: float = 0.2
    """The shared PPO clip range (`algorithm.clip_ratio_low` / `_high`): ratios in [1 - low, 1 + high]."""
    clip_ratio_high: float = 0.2

    @classmethod
    def of(cls, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, *,
           proximal_logprobs: Tensor | None = None, clip_ratio_low: float = 0.2, clip_ratio_high: float = 0.2) -> LossInputs:
        anchor = old_logprobs if proximal_logprobs is None else proximal_logprobs
        return cls(logprobs, logprobs - anchor, advantages, mask, clip_ratio_low, clip_ratio_high)


def clamped_ratio(log_ratio: Tensor) -> Tensor:
    """exp of the log-ratio clamped to +-`LOG_RATIO_CLAMP` (no gradient beyond it).

    >>> clamped_ratio(torch.tensor([0.0, 100.0]))
    tensor([1.0000e+00, 4.8517e+08])
    """
    return torch.exp(torch.clamp(log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


class SettingError(ValueError):
    """A bad value of a loss's setting: the message names `algorithm.loss_args.<field>` (the config renames
    the key when the user set it under an older one, e.g. `algorithm.clip_ratio_c`)."""

    def __init__(self, field: str, msg: str) -> None:
        super().__init__(f"algorithm.loss_args.{field}: {msg}")
        self.field, self.msg = field, msg


def check_setting(ok: bool, field: str, msg: str) -> None:
    """For a settings dataclass's `__post_init__`: a `SettingError` naming the field unless `ok`."""
    if not ok:
        raise SettingError(field, msg)


@dataclass(frozen=True)
class NoSettings:
    """The settings of a loss without constants of its own."""


class PolicyLossFn(Protocol):
    def __call__(self, x: LossInputs, settings: Any, /) -> PolicyLossOutput: ...


@dataclass(frozen=True)
class PolicyLoss:
    """A registered policy loss: its function, its settings dataclass and how it aggregates."""

    name: str
    fn: PolicyLossFn
    settings: type = NoSettings
    """The dataclass of the loss's constants; every field has a default and a docstring (configs/README.md
    lists them) and `__post_init__` checks the values (`check_setting`)."""
    level: Literal["token", "sequence"] = "token"
    """`sequence`: one ratio per sequence (GSPO), so the policy loss is aggregated `seq_mean_token_mean`
    whatever `algorithm.loss_agg` says, as verl and the GSPO paper do (KL and entropy terms follow `loss_agg`)."""

    def agg(self, mode: str) -> str:
        """The aggregation of this loss's policy term, given `algorithm.loss_agg`."""
        return "seq_mean_token_mean" if self.level == "sequence" else mode

    def make_settings(self, args: Mapping[str, Any] | None = None) -> Any:
        """The settings object of `algorithm.loss_args` (field name -> value; missing: the default). An unknown
        name or a value of the wrong type is a `SettingError` naming `algorithm.loss_args.<name>`; then the
        dataclass's `__post_init__` checks the values."""
        hints = typing.get_type_hints(self.settings)
        names = [f.name for f in dataclasses.fields(self.settings)]
        kwargs = {}
        for key, value in (args or {}).items():
            if key not in names:
                has = f"its settings: {names}" if names else "it has no settings"
                raise SettingError(str(key), f"not a setting of policy loss {self.name!r} ({has})")
            kwargs[key] = _typed(key, value, hints[key])
        return self.settings(**kwargs)

    def __call__(self, x: LossInputs, settings: Any = None) -> PolicyLossOutput:
        return self.fn(x, self.make_settings() if settings is None else settings)


def _typed(key: str, value: Any, hint: Any) -> Any:
    """`value` checked against a plain scalar field type (an int is taken where a float is declared)."""
    if hint is float and type(value) is int:
        return float(value)
    if hint in (bool, int, float, str) and type(value) is not hint:
        raise SettingError(key, f"must be a {hint.__name__}, got {value!r}")
    return value


POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy loss", "algorithm.loss", import_paths=False)
"""No import paths: an entry is a `PolicyLoss` (function, settings, level), not a bare callable."""


def register_policy_loss(name: str, *, settings: type = NoSettings,
                         level: Literal["token", "sequence"] = "token") -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator: `@register_policy_loss("my_loss", settings=MySettings)` makes a loss selectable as
    `algorithm.loss=my_loss`, its constants as `algorithm.loss_args.<field>`; returns the function unchanged."""
    if not dataclasses.is_dataclass(settings) or level not in ("token", "sequence"):
        raise TypeError(f"policy loss {name!r}: settings must be a dataclass and level 'token' or 'sequence'")
    settings()  # every field needs a valid default: a loss selected with no loss_args uses them

    def deco(fn: PolicyLossFn) -> PolicyLossFn:
        POLICY_LOSSES.add(name, PolicyLoss(name, fn, settings, level))
        return fn

    return deco


@dataclass(frozen=True)
class PPOClipSettings:
    """`ppo_clip`'s own constant (its clip range is the shared `algorithm.clip_ratio_low` / `_high`)."""

    clip_ratio_c: float = 3.0
    """Dual clip (Ye et al. 2019, verl's `clip_ratio_c`): for A < 0 the loss is at most -clip_ratio_c * A, so a stale token whose ratio grew large gets a bounded loss and no gradient; 0 = off, else > 1. The older key `algorithm.clip_ratio_c` sets it too."""

    def __post_init__(self) -> None:
        check_setting(self.clip_ratio_c == 0 or self.clip_ratio_c > 1, "clip_ratio_c", f"must be > 1 (or 0 = off), got {self.clip_ratio_c}")


@register_policy_loss("ppo_clip", settings=PPOClipSettings)
def ppo_clip(x: LossInputs, s: PPOClipSettings) -> PolicyLossOutput:
    """PPO clipped surrogate: max(-A r, -A clip(r, 1 - low, 1 + high)), r = exp(log_ratio) clamped as
    verl does (`clamped_ratio`), with dual clip: for A < 0 past r = c the loss is the constant c |A| (no
    gradient, counted in `clipped` and `dual_clipped`).

    >>> out = ppo_clip(LossInputs.of(torch.tensor([[0.5]]), torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1)), PPOClipSettings())
    >>> round(out.loss.item(), 4), out.clipped.item()  # r = 1.6487 clipped to 1.2
    (-1.2, 1.0)
    >>> ppo_clip(LossInputs.of(torch.tensor([[2.0]]), torch.zeros(1, 1), -torch.ones(1, 1), torch.ones(1, 1)), PPOClipSettings()).loss
    tensor([[3.]])
    """
    ratio = clamped_ratio(x.log_ratio)
    unclipped = -x.advantages * ratio
    clipped = -x.advantages * torch.clamp(ratio, 1.0 - x.clip_ratio_low, 1.0 + x.clip_ratio_high)
    loss = torch.maximum(unclipped, clipped)
    took_clip = clipped > unclipped
    dual = torch.zeros_like(took_clip)
    if s.clip_ratio_c:
        bound = -x.advantages * s.clip_ratio_c
        dual = (x.advantages < 0) & (loss > bound)
        loss = torch.where(dual, bound, loss)
    return PolicyLossOutput(loss=loss, ratio=ratio.detach(), clipped=(took_clip | dual).float(), dual_clipped=dual.float())


def _masked_row_mean(x: Tensor, mask: Tensor) -> Tensor:
    """[B] mean of x over each row's loss tokens (0 for a row without any)."""
    m = mask.to(x.dtype)
    return (x * m).sum(dim=-1) / m.sum(dim=-1).clamp(min=1)


@dataclass(frozen=True)
class GSPOSettings:
    """`gspo`'s clip range: its own, far smaller than PPO's (the shared `algorithm.clip_ratio_*` are ignored)."""

    seq_clip_ratio_low: float = 3e-4
    """The sequence ratio's lower bound is 1 - seq_clip_ratio_low (the GSPO paper: 3e-4; verl reads its `clip_ratio_low` here). The older key `algorithm.gspo_clip_ratio_low` sets it too."""
    seq_clip_ratio_high: float = 4e-4
    """The sequence ratio's upper bound is 1 + seq_clip_ratio_high (the GSPO paper: 4e-4; verl: `clip_ratio_high`). The older key `algorithm.gspo_clip_ratio_high` sets it too."""

    def __post_init__(self) -> None:
        check_setting(0 < self.seq_clip_ratio_low < 1, "seq_clip_ratio_low", f"must be in (0, 1), got {self.seq_clip_ratio_low}")
        check_setting(self.seq_clip_ratio_high > 0, "seq_clip_ratio_high", f"must be > 0, got {self.seq_clip_ratio_high}")


@register_policy_loss("gspo", settings=GSPOSettings, level="sequence")
def gspo(x: LossInputs, s: GSPOSettings) -> PolicyLossOutput:
    """GSPO (Zheng et al. 2025): PPO clip on the sequence ratio s = exp(mean over the row's loss
    tokens of the log-ratio), the geometric mean of its token ratios.

    Token t carries s_t = sg(s) * exp(logp_t - sg(logp_t)): its value is s, its gradient flows
    through its own log-prob only (grad of s_t = s * grad logp_t), as in the paper. When the clip
    binds, the whole sequence is clipped. Aggregated per sequence (`level="sequence"`:
    `seq_mean_token_mean` whatever `algorithm.loss_agg` says), as the paper and verl do. The log of
    s is clamped at 10 (verl) so a very stale sequence gives a large, finite ratio.

    >>> lp = torch.log(torch.tensor([[1.0, 4.0]]))  # token ratios 1 and 4: s = sqrt(4) = 2
    >>> out = gspo(LossInputs.of(lp, torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2)), GSPOSettings())
    >>> out.ratio, out.loss  # clipped to 1 + 4e-4
    (tensor([[2., 2.]]), tensor([[-1.0004, -1.0004]]))
    """
    log_s = _masked_row_mean(x.log_ratio, x.mask).detach().unsqueeze(-1)
    log_s_t = torch.clamp(x.logprobs - x.logprobs.detach() + log_s, max=10.0)
    ratio = torch.exp(log_s_t)
    unclipped = -x.advantages * ratio
    clipped = -x.advantages * torch.clamp(ratio, 1.0 - s.seq_clip_ratio_low, 1.0 + s.seq_clip_ratio_high)
    loss = torch.maximum(unclipped, clipped)
    return PolicyLossOutput(loss=loss, ratio=ratio.detach(), clipped=(clipped > unclipped).float())


@register_policy_loss("cispo")
def cispo(x: LossInputs, s: NoSettings) -> PolicyLossOutput:
    """CISPO (MiniMax-M1): -sg(clip(r, 1 - low, 1 + high)) * A * logp, r = exp(log_ratio).

    Unlike PPO's clip, no token loses its gradient: a clipped token still moves by its capped IS
    weight (`clipped` marks where the cap bound; the shared `algorithm.clip_ratio_low` / `_high` set
    it; the paper leaves the lower bound loose, e.g. `clip_ratio_low` near 1). The loss value is not
    a surrogate of the return (it is -w A logp); its gradient is the capped IS policy gradient.

    >>> lp = torch.log(torch.tensor([[2.0]]))  # r = 2, capped at 1.2: loss = -1.2 * 1 * log 2
    >>> round(cispo(LossInputs.of(lp, torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1)), NoSettings()).loss.item(), 4)
    -0.8318
    """
    ratio = clamped_ratio(x.log_ratio).detach()
    weight = torch.clamp(ratio, 1.0 - x.clip_ratio_low, 1.0 + x.clip_ratio_high)
    return PolicyLossOutput(loss=-weight * x.advantages * x.logprobs, ratio=ratio, clipped=(weight != ratio).float())


@register_policy_loss("vanilla_pg")
def vanilla_pg(x: LossInputs, s: NoSettings) -> PolicyLossOutput:
    """Unclipped importance-weighted policy gradient: -A r (on-policy: -A logp's gradient); r clamped as `ppo_clip`'s.

    >>> vanilla_pg(LossInputs.of(torch.zeros(1, 1), torch.zeros(1, 1), torch.full((1, 1), 2.0), torch.ones(1, 1)), NoSettings()).loss
    tensor([[-2.]])
    """
    ratio = clamped_ratio(x.log_ratio)
    return PolicyLossOutput(loss=-x.advantages * ratio, ratio=ratio.detach(), clipped=torch.zeros_like(ratio))


for _name, (_fn, _settings) in losses_verl.ENTRIES.items():  # verl's clip_cov, kl_cov, reinforce: their math is there
    register_policy_loss(_name, settings=_settings or NoSettings)(lambda x, s, fn=_fn: PolicyLossOutput(*fn(x, s)))


def agg_loss(loss: Tensor, mask: Tensor, mode: str, *, num_tokens: float | None = None, num_seqs: float | None = None,
             norm_len: float | None = None) -> Tensor:
    """Reduce a [B, T] per-token loss to a scalar over the tokens where `mask` is 1.

    - `token_mean`: sum(loss * mask) / num_tokens (default: mask.sum())
    - `seq_mean_token_mean`: sum over rows of (row token mean) / num_seqs
    - `seq_mean_token_sum`: sum over rows of (row token sum) / num_seqs
    - `seq_mean_token_sum_norm` (Dr. GRPO): sum over rows of (row token sum / norm_len) / num_seqs,
      `norm_len` a constant (`algorithm.loss_agg_norm_len`, e.g. the max response length), so a
      token weighs the same in a short and a long response. verl's `seq-mean-token-sum-norm` leaves
      out the mean over sequences (sum of all tokens / its `loss_scale_factor`): N times this, N the
      sequences with loss tokens (docs/verl.md).

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


KL_CLAMP_LOG_RATIO, KL_CLAMP_VALUE = 20.0, 10.0


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

