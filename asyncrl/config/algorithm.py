"""The algorithm's part of the config tree: `algorithm.*` (advantage, policy loss, KL, entropy,
off-policy correction, DAPO's dynamic sampling), with `algorithm.kl_ctrl.*` from `critic`.

A policy loss's own constants are not fields here: they are the fields of the loss's settings
dataclass beside it (`trainer/losses.py`), set as `algorithm.loss_args.<field>` and checked against
the selected loss when the config is built (`AlgorithmConfig.loss_settings`; a few older flat keys
map onto them, `OLD_LOSS_KEYS`). Their table in configs/README.md is `doc.loss_settings_table`
(`asyncrl config --doc`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from asyncrl.config.checks import ConfigError
from asyncrl.config.checks import check as _check
from asyncrl.config.checks import check_literals as _check_literals
from asyncrl.config.checks import check_registered as _check_registered
from asyncrl.config.critic import KLCtrlConfig


@dataclass
class RolloutCorrectionConfig:
    """verl's `algorithm.rollout_correction` (verl/trainer/config/algorithm.py), so that a verl recipe's keys load.

    Each combination asyncrl has an entry for becomes that entry (`translate`): `rollout_is` token / sequence with a
    float threshold -> `token_tis` / `seq_tis`; token with "low_high" -> `icepop`; `rollout_rs` `seq_sum_k1` with
    sequence IS -> `seq_mis`; `seq_mean_k1` -> `geo_rs`, `seq_mean_k3` -> `k3_rs` (with the IS as their `tis`).
    `bypass_mode` -> `form=bypass`; with `loss_type=ppo_clip` verl applies no IS weight (the PPO ratio is it), so
    only the rejection is kept (`bypass` when there is none); `loss_type=reinforce` selects `algorithm.loss=reinforce`.
    Any other combination is an error naming the key.
    """

    rollout_is: str | None = None
    """verl: IS weight level, `token` or `sequence`; null: no IS weight."""
    rollout_is_threshold: Any = 2.0
    """verl: the IS weight's upper bound (a number: truncation), or "low_high" (IcePop: weights outside the band are 0)."""
    rollout_is_batch_normalize: bool = False
    """verl: normalise the IS weights to mean 1 over the batch; not supported (true is an error)."""
    rollout_rs: str | None = None
    """verl: rejection sampling, one of `seq_sum_k1` (with rollout_is=sequence), `seq_mean_k1`, `seq_mean_k3` (asyncrl's entries); null: none."""
    rollout_rs_threshold: Any = None
    """verl: the rejection bounds: "low_high" (or one number x: 1/x_x) for `*_k1`, an upper bound for `*_k3`."""
    bypass_mode: bool = False
    """verl: anchor on the rollout's log-probs (`form=bypass`), no proximal policy."""
    loss_type: str = "ppo_clip"
    """verl, with bypass_mode: `ppo_clip` (the PPO ratio is the IS weight) or `reinforce` (-w A logp: `algorithm.loss=reinforce`)."""

    def translate(self) -> tuple[str, dict[str, Any], str | None] | None:
        """(correction, correction_args, loss or None), or None when no verl key is in use."""
        if self.rollout_is is None and self.rollout_rs is None and not self.bypass_mode:
            return None
        key = "algorithm.rollout_correction"
        _check(self.rollout_is in (None, "token", "sequence"), f"{key}.rollout_is", f"must be one of ['token', 'sequence', null], got {self.rollout_is!r}")
        _check(self.loss_type in ("ppo_clip", "reinforce"), f"{key}.loss_type", f"must be one of ['ppo_clip', 'reinforce'], got {self.loss_type!r}")
        _check(not self.rollout_is_batch_normalize, f"{key}.rollout_is_batch_normalize", "is not supported by asyncrl (set false)")
        form = {"form": "bypass"} if self.bypass_mode else {}
        level = None if self.bypass_mode and self.loss_type == "ppo_clip" else self.rollout_is
        loss = "reinforce" if self.bypass_mode and self.loss_type == "reinforce" else None
        high, low = _bounds(self.rollout_is_threshold, f"{key}.rollout_is_threshold") if level else (2.0, None)
        if self.rollout_rs is None:
            if level is None:
                _check(self.bypass_mode, f"{key}.rollout_is", "null with no rollout_rs: choose algorithm.correction instead")
                return "bypass", {}, loss
            _check(level == "token" or low is None, f"{key}.rollout_is_threshold", "a \"low_high\" band needs rollout_is=token (IcePop)")
            if low is not None:
                return "icepop", {"low": low, "high": high, **form}, loss
            return f"{level[:3] if level == 'sequence' else level}_tis", {"threshold": high, **form}, loss
        rs = self.rollout_rs.strip()
        _check(rs in ("seq_sum_k1", "seq_mean_k1", "seq_mean_k3"), f"{key}.rollout_rs",
               f"asyncrl has entries for seq_sum_k1 (with rollout_is=sequence), seq_mean_k1, seq_mean_k3; got {rs!r}")
        _check(low is None, f"{key}.rollout_is_threshold", "a \"low_high\" band (IcePop) cannot be combined with rollout_rs")
        _check(self.rollout_rs_threshold is not None, f"{key}.rollout_rs_threshold", f"required with rollout_rs={rs}")
        tis = {"tis": level, "tis_threshold": high} if level else {}
        if rs == "seq_mean_k3":
            return "k3_rs", {"threshold": float(self.rollout_rs_threshold), **tis, **form}, loss
        text = str(self.rollout_rs_threshold)
        rs_low, rs_high = (float(t) for t in text.split("_", 1)) if "_" in text else (1.0 / float(text), float(text))
        if rs == "seq_mean_k1":
            return "geo_rs", {"low": rs_low, "high": rs_high, **tis, **form}, loss
        _check(level == "sequence", f"{key}.rollout_rs", "seq_sum_k1 is asyncrl's seq_mis: it needs rollout_is=sequence")
        return "seq_mis", {"threshold": high, "low": rs_low, "high": rs_high, **form}, loss


def _bounds(spec: Any, key: str) -> tuple[float, float | None]:
    """verl's `rollout_is_threshold`: a number (upper) or "low_high"."""
    try:
        text = str(spec).strip()
        if "_" in text:
            low, high = (float(t) for t in text.split("_", 1))
            return high, low
        return float(text), None
    except ValueError:
        raise ConfigError(f"{key}: must be a number or \"low_high\", got {spec!r}") from None


@dataclass
class AlgorithmConfig:
    advantage: str = "grpo"
    """Advantage estimator from the registry: `grpo`, `rloo`, `reinforce_pp` (group-centred, then whitened over the batch's sequences), or `gae` (PPO with a critic: per-token GAE from the critic's values, `algorithm.gamma` / `lam`, whitened over the batch; the `critic.*` keys)."""
    norm_adv_by_std: bool = True
    """grpo: divide group-centred rewards by the group's std (Dr. GRPO sets this false)."""
    loss: str = "ppo_clip"
    """Policy loss from the registry (`trainer/losses.py`): `ppo_clip` (with dual clip), `vanilla_pg` (unclipped importance-weighted), `gspo` (one clipped ratio per sequence, always aggregated `seq_mean_token_mean`), `cispo` (clipped, detached IS weight times A times log-prob). Its own constants: `algorithm.loss_args`."""
    loss_args: dict[str, Any] = field(default_factory=dict)
    """The selected loss's own settings by name, e.g. `algorithm.loss_args.clip_ratio_c=5` with `ppo_clip` (each loss's are listed in configs/README.md, "Policy loss settings"); checked at load against the loss's settings dataclass: a name it does not have, or a bad value, is an error naming the key. Unset: the loss's defaults."""
    clip_ratio_low: float = 0.2
    """PPO clip, shared by the losses that clip the token ratio (`ppo_clip`, `cispo`; `gspo` has its own): ratio lower bound is 1 - clip_ratio_low."""
    clip_ratio_high: float = 0.2
    """PPO clip: ratio upper bound is 1 + clip_ratio_high (DAPO raises it, e.g. 0.28)."""
    clip_ratio_c: float | None = None
    """Older key of `algorithm.loss_args.clip_ratio_c` (`ppo_clip`'s dual clip, default 3; verl's name), kept for existing configs; null: not set. Ignored with another loss."""
    gspo_clip_ratio_low: float | None = None
    """Older key of `algorithm.loss_args.seq_clip_ratio_low` (`gspo`, default 3e-4), kept for existing configs; null: not set. Ignored with another loss."""
    gspo_clip_ratio_high: float | None = None
    """Older key of `algorithm.loss_args.seq_clip_ratio_high` (`gspo`, default 4e-4), kept for existing configs; null: not set. Ignored with another loss."""
    loss_agg: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"] = "token_mean"
    """Aggregation: `token_mean` (over all tokens of the batch), `seq_mean_token_mean`, `seq_mean_token_sum`, `seq_mean_token_sum_norm` (Dr. GRPO: token sum / `loss_agg_norm_len`, mean over sequences). Sequence means count only sequences with loss tokens."""
    loss_agg_norm_len: int = 0
    """`seq_mean_token_sum_norm`: the constant each sequence's token sum is divided by (e.g. `rollout.max_response_length`); required > 0 there."""
    kl_coef: float = 0.0
    """Weight of the KL penalty to the reference (initial) policy; 0 skips the reference model."""
    gamma: float = 1.0
    """`gae`: discount per token."""
    lam: float = 1.0
    """`gae`: lambda of the generalised advantage estimate (1: Monte-Carlo returns minus values)."""
    use_kl_in_reward: bool = False
    """`gae`: subtract beta * KL(behaviour || reference) from each policy token's reward, beta from `kl_ctrl`; loads the reference model."""
    kl_ctrl: KLCtrlConfig = field(default_factory=KLCtrlConfig)
    """The KL-in-reward controller (verl's `algorithm.kl_ctrl`)."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator: `k1`, `k2`, `k3` (verl's `low_var_kl`, clamped as the references do: finite at any log-prob gap)."""
    filter_groups: bool = False
    """DAPO dynamic sampling: drop finished groups whose rewards are all equal (no advantage signal), counted as `drops/filtered` (metrics; `drops` in summary.json and `asyncrl status`); admission refills the batch. Needs `rollout.group_size` >= 2. Rewards are compared before overlong shaping (`agent.overlong_buffer_len`), as DAPO compares accuracy."""
    filter_groups_max_batches: int = 10
    """`filter_groups`: this many batches' worth of groups (x `trainer.prompts_per_step`) filtered in a row stop the run with an error (a task the policy always solves or always fails would otherwise generate forever; verl: `filter_groups.max_num_gen_batches`); 0 = no limit. Any queued group resets the count."""
    entropy_coef: float = 0.0
    """Entropy bonus weight (entropy is always logged); with `entropy_target` > 0 it is the starting value of the adapted weight."""
    entropy_target: float = 0.5
    """Adaptive entropy control, 0 = off: after every step the entropy bonus weight moves by `entropy_coef_lr * (entropy_target - entropy)` (token-mean entropy of the step's batch, nats), clamped to [0, `entropy_coef_max`], so the policy keeps exploring instead of collapsing onto a wrong answer (greedy evaluation is unaffected by the spread it keeps). The bonus then counts each token's entropy only up to the target, so it lifts collapsed tokens and never pushes any token further."""
    entropy_coef_lr: float = 0.01
    """Adaptive entropy control: change of the weight per nat of entropy below/above `entropy_target`, per step."""
    entropy_coef_max: float = 1.0
    """Adaptive entropy control: upper bound of the adapted weight."""
    correction: str = "decoupled_ppo"
    """Off-policy correction (`trainer/corrections.py`): `none`/`bypass` (PPO around the behavior policy), `decoupled_ppo` (AReaL), `tis`, `mis`; verl's and AReaL's (`trainer/rollout_corr.py`, settings in `algorithm.correction_args`): `token_tis`, `seq_tis`, `seq_mis`, `icepop`, `geo_rs`, `k3_rs`, `m2po` (docs/algorithms.md). Set by `algorithm.rollout_correction.*` when that is used."""
    correction_args: dict[str, Any] = field(default_factory=dict)
    """The selected correction's own settings by name, e.g. `algorithm.correction_args.threshold=3` with `token_tis`, `algorithm.correction_args.form=bypass` (anchor on the behavior policy, rho = pi_theta / pi_behav); checked at load against the correction's settings dataclass (docs/algorithms.md lists them). `decoupled_ppo`, `tis`, `mis` take none (their keys: `is_cap`, `mis_*`)."""
    rollout_correction: RolloutCorrectionConfig = field(default_factory=lambda: RolloutCorrectionConfig())
    """verl's rollout correction keys, read as verl reads them and turned into `algorithm.correction` / `correction_args` (and `algorithm.loss=reinforce` for verl's bypass REINFORCE) at load."""
    proximal: Literal["recompute", "interpolate"] = "recompute"
    """Proximal policy of `decoupled_ppo`/`tis`/`mis`: `recompute` (one extra forward pass per step) or `interpolate` (from token versions, no extra pass; it takes the weights of each mini-batch as the proximal policy, so with `trainer.minibatches` > 1 its clip does not bind: use `recompute` there)."""
    is_cap: float = 2.0
    """Cap C on the IS weight pi_prox/pi_behav: `tis` truncates to min(w, C); `decoupled_ppo` drops tokens with w > C (0: no cap)."""
    mis_level: Literal["token", "sequence"] = "token"
    """`mis`: mask single tokens (`token`) or whole sequences by their geometric-mean ratio (`sequence`)."""
    mis_low: float = 0.5
    """`mis`: tokens / sequences with IS ratio below this are masked out of the loss."""
    mis_high: float = 2.0
    """`mis`: tokens / sequences with IS ratio above this are masked out of the loss."""

    def __post_init__(self) -> None:
        from asyncrl.trainer.advantages import advantage_spec  # torch: when a config is checked, not when imported

        _check_literals(self, "algorithm")  # proximal, mis_level, loss_agg, kl_estimator
        self._from_verl()
        _check_registered(self.correction, "algorithm.correction")
        self.correction_settings()
        _check(self.is_cap >= 0, "algorithm.is_cap", "must be >= 0")
        _check(self.is_cap > 0 or self.correction != "tis", "algorithm.is_cap", "must be > 0 with correction tis")
        _check(0 <= self.mis_low <= 1, "algorithm.mis_low", "must be in [0, 1]")
        _check(self.mis_high >= 1, "algorithm.mis_high", "must be >= 1")
        _check_registered(self.advantage, "algorithm.advantage")  # the ADVANTAGES registry + TOKEN_LEVEL_ADVANTAGES (gae)
        _check_registered(self.loss, "algorithm.loss")
        self.loss_settings()  # loss_args and the older keys, checked against the loss's settings dataclass
        _check(self.loss_agg_norm_len > 0 or self.loss_agg != "seq_mean_token_sum_norm", "algorithm.loss_agg_norm_len",
               "must be > 0 with loss_agg seq_mean_token_sum_norm (e.g. rollout.max_response_length)")
        _check(self.loss_agg_norm_len >= 0, "algorithm.loss_agg_norm_len", f"must be >= 0, got {self.loss_agg_norm_len}")
        _check(0 <= self.gamma <= 1 and 0 <= self.lam <= 1, "algorithm.gamma", f"gamma and lam must be in [0, 1], got {self.gamma}, {self.lam}")
        _check(not self.use_kl_in_reward or advantage_spec(self.advantage).needs_critic, "algorithm.use_kl_in_reward",
               f"needs algorithm.advantage=gae (the per-token reward; with {self.advantage!r} use the KL in the loss: algorithm.kl_coef)")
        _check(0 <= self.clip_ratio_low < 1, "algorithm.clip_ratio_low", "must be in [0, 1)")
        _check(self.clip_ratio_high >= 0, "algorithm.clip_ratio_high", "must be >= 0")
        _check(self.kl_coef >= 0, "algorithm.kl_coef", "must be >= 0")
        _check(self.entropy_coef >= 0, "algorithm.entropy_coef", f"must be >= 0, got {self.entropy_coef}")
        _check(self.filter_groups_max_batches >= 0, "algorithm.filter_groups_max_batches", f"must be >= 0 (0 = no limit), got {self.filter_groups_max_batches}")
        _check(self.entropy_target >= 0, "algorithm.entropy_target", f"must be >= 0 (0 = off), got {self.entropy_target}")
        _check(self.entropy_coef_lr > 0, "algorithm.entropy_coef_lr", f"must be > 0, got {self.entropy_coef_lr}")
        _check(self.entropy_coef_max >= self.entropy_coef, "algorithm.entropy_coef_max",
               f"must be >= algorithm.entropy_coef ({self.entropy_coef}), got {self.entropy_coef_max}")

    def correction_settings(self) -> Any:
        """The selected correction's settings object (`corrections.Correction.make_settings`), or None for an entry
        without (`decoupled_ppo`, `tis`, `mis`, `none`, `bypass`); a bad one is a `ConfigError` naming the key."""
        from asyncrl.trainer.corrections import CORRECTIONS

        try:
            return CORRECTIONS[self.correction].make_settings(self.correction_args)
        except (TypeError, ValueError) as e:
            msg = str(e)
            raise ConfigError(msg if msg.startswith("algorithm.") else f"algorithm.correction_args ({self.correction}): {msg}") from None

    def _from_verl(self) -> None:
        """`algorithm.rollout_correction.*` (verl's keys), when used, choose the correction, its settings and, for verl's
        bypass REINFORCE, the loss; `correction_args` set beside them to other values is an error."""
        picked = self.rollout_correction.translate()
        if picked is None:
            return
        name, args, loss = picked
        _check(not self.correction_args or self.correction_args == args, "algorithm.correction_args",
               f"and algorithm.rollout_correction.* both set the correction's settings ({self.correction_args} and {args}): set one")
        self.correction, self.correction_args = name, args
        if loss:
            self.loss = loss

    def loss_settings(self) -> Any:
        """The selected loss's settings object (`losses.PolicyLoss.make_settings`): `loss_args`, plus any
        older key of `OLD_LOSS_KEYS` that names one of its fields. A bad value is a `ConfigError` naming
        the key the user set; the older key and `loss_args` giving one setting two values is one too."""
        from asyncrl.trainer.losses import POLICY_LOSSES, SettingError

        args, keys = dict(self.loss_args), {name: f"algorithm.loss_args.{name}" for name in self.loss_args}
        for old, (loss, name) in OLD_LOSS_KEYS.items():
            value = getattr(self, old)
            if value is None or loss != self.loss:
                continue
            _check(args.get(name, value) == value, f"algorithm.{old}",
                   f"and algorithm.loss_args.{name} are one setting, given {value} and {args.get(name)}: set one")
            args[name], keys[name] = value, f"algorithm.{old}"
        try:
            return POLICY_LOSSES[self.loss].make_settings(args)
        except SettingError as e:
            raise ConfigError(f"{keys.get(e.field, f'algorithm.loss_args.{e.field}')}: {e.msg}") from None
        except (TypeError, ValueError) as e:  # a user's __post_init__ that raised without check_setting
            raise ConfigError(f"algorithm.loss_args ({self.loss}): {e}") from None


OLD_LOSS_KEYS: dict[str, tuple[str, str]] = {
    "clip_ratio_c": ("ppo_clip", "clip_ratio_c"),
    "gspo_clip_ratio_low": ("gspo", "seq_clip_ratio_low"),
    "gspo_clip_ratio_high": ("gspo", "seq_clip_ratio_high"),
}
"""`algorithm` keys older than `loss_args`, kept so that existing configs (and verl's `clip_ratio_c`) work:
key -> (the loss, the setting of it the key sets). With another loss selected the key is ignored, as before."""
