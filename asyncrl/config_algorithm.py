"""The algorithm's part of the config tree: `algorithm.*` (advantage, policy loss, KL, entropy,
off-policy correction, DAPO's dynamic sampling), `algorithm.kl_ctrl.*` and `critic.*` (from
`config_critic`). Re-exported by `asyncrl.config`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from asyncrl.config_checks import check as _check
from asyncrl.config_checks import check_literals as _check_literals
from asyncrl.config_checks import check_registered as _check_registered
from asyncrl.config_critic import KLCtrlConfig


@dataclass
class AlgorithmConfig:
    advantage: str = "grpo"
    """Advantage estimator from the registry: `grpo`, `rloo`, `reinforce_pp` (group-centred, then whitened over the batch's sequences), or `gae` (PPO with a critic: per-token GAE from the critic's values, `algorithm.gamma` / `lam`, whitened over the batch; the `critic.*` keys)."""
    norm_adv_by_std: bool = True
    """grpo: divide group-centred rewards by the group's std (Dr. GRPO sets this false)."""
    loss: str = "ppo_clip"
    """Policy loss from the registry: `ppo_clip` (with dual clip, `clip_ratio_c`), `vanilla_pg` (unclipped importance-weighted), `gspo` (sequence-level ratio, `gspo_clip_ratio_*`), `cispo` (clipped, detached IS weight times A times log-prob)."""
    clip_ratio_low: float = 0.2
    """PPO clip: ratio lower bound is 1 - clip_ratio_low."""
    clip_ratio_high: float = 0.2
    """PPO clip: ratio upper bound is 1 + clip_ratio_high (DAPO raises it, e.g. 0.28)."""
    clip_ratio_c: float = 3.0
    """Dual-clip PPO (`ppo_clip`): for negative advantages the loss is at most clip_ratio_c * |A| (verl's default 3); 0 = off, else > 1."""
    gspo_clip_ratio_low: float = 3e-4
    """`gspo`: the sequence ratio's lower bound is 1 - gspo_clip_ratio_low (the GSPO paper: 3e-4)."""
    gspo_clip_ratio_high: float = 4e-4
    """`gspo`: the sequence ratio's upper bound is 1 + gspo_clip_ratio_high (the GSPO paper: 4e-4)."""
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
    """Off-policy correction (`trainer/corrections.py`): `none`/`bypass` (PPO around the behavior policy), `decoupled_ppo` (AReaL), `tis`, `mis`."""
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
        _check_literals(self, "algorithm")  # proximal, mis_level, loss_agg, kl_estimator
        _check_registered(self.correction, "algorithm.correction")
        _check(self.is_cap >= 0, "algorithm.is_cap", "must be >= 0")
        _check(self.is_cap > 0 or self.correction != "tis", "algorithm.is_cap", "must be > 0 with correction tis")
        _check(0 <= self.mis_low <= 1, "algorithm.mis_low", "must be in [0, 1]")
        _check(self.mis_high >= 1, "algorithm.mis_high", "must be >= 1")
        _check_registered(self.advantage, "algorithm.advantage")  # the ADVANTAGES registry + TOKEN_LEVEL_ADVANTAGES (gae)
        _check_registered(self.loss, "algorithm.loss")
        _check(self.clip_ratio_c == 0 or self.clip_ratio_c > 1, "algorithm.clip_ratio_c", f"must be > 1 (or 0 = off), got {self.clip_ratio_c}")
        _check(0 < self.gspo_clip_ratio_low < 1, "algorithm.gspo_clip_ratio_low", f"must be in (0, 1), got {self.gspo_clip_ratio_low}")
        _check(self.gspo_clip_ratio_high > 0, "algorithm.gspo_clip_ratio_high", f"must be > 0, got {self.gspo_clip_ratio_high}")
        _check(self.loss_agg_norm_len > 0 or self.loss_agg != "seq_mean_token_sum_norm", "algorithm.loss_agg_norm_len",
               "must be > 0 with loss_agg seq_mean_token_sum_norm (e.g. rollout.max_response_length)")
        _check(self.loss_agg_norm_len >= 0, "algorithm.loss_agg_norm_len", f"must be >= 0, got {self.loss_agg_norm_len}")
        _check(0 <= self.gamma <= 1 and 0 <= self.lam <= 1, "algorithm.gamma", f"gamma and lam must be in [0, 1], got {self.gamma}, {self.lam}")
        _check(not self.use_kl_in_reward or self.advantage == "gae", "algorithm.use_kl_in_reward",
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
