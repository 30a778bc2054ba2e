"""The critic's part of the config tree: `critic.*` (PPO's value model, used with
`algorithm.advantage=gae`; `asyncrl/trainer/critic.py`), and `algorithm.kl_ctrl.*` (the KL in
the reward that GAE reads). Its classes are on `asyncrl.config`'s public surface.

It runs on the trainer's ranks with the trainer's micro-batching, packing, schedule and
`trainer.betas`; what differs from the policy's optimisation is here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from asyncrl.config.checks import check as _check
from asyncrl.config.checks import check_literals as _check_literals


@dataclass
class KLCtrlConfig:
    type: Literal["fixed", "adaptive"] = "fixed"
    """`fixed` beta, or `adaptive` (Ziegler et al.: beta moves toward `target_kl` over `horizon` samples; checkpointed)."""
    kl_coef: float = 0.001
    """Starting beta of the KL in the reward (`algorithm.use_kl_in_reward`)."""
    target_kl: float = 0.1
    """`adaptive`: the KL (each sequence's token mean, averaged over the batch) the controller steers to."""
    horizon: float = 10000.0
    """`adaptive`: samples over which beta may change by about 20%."""

    def __post_init__(self) -> None:
        _check_literals(self, "algorithm.kl_ctrl")  # type
        _check(self.kl_coef >= 0, "algorithm.kl_ctrl.kl_coef", f"must be >= 0, got {self.kl_coef}")
        _check(self.target_kl > 0, "algorithm.kl_ctrl.target_kl", f"must be > 0, got {self.target_kl}")
        _check(self.horizon > 0, "algorithm.kl_ctrl.horizon", f"must be > 0, got {self.horizon}")


@dataclass
class CriticConfig:
    model_path: str = ""
    """Local folder of the critic's starting weights (a HF causal LM; a value head is added). Empty: the policy's model (`model.path` or the tiny demo model)."""
    lr: float = 0.0
    """Critic AdamW learning rate; 0: `trainer.lr`. Follows `trainer.lr_schedule` / `trainer.warmup_steps`."""
    weight_decay: float = 0.0
    """Critic AdamW weight decay."""
    grad_clip: float = 1.0
    """Clip of the critic's gradient norm; 0 = no clip."""
    cliprange_value: float = 0.5
    """PPO value clipping: the new value may move at most this far from the step's starting value in the loss (verl's default 0.5); 0 = unclipped."""

    def __post_init__(self) -> None:
        _check(self.lr >= 0, "critic.lr", f"must be >= 0 (0 = trainer.lr), got {self.lr}")
        _check(self.weight_decay >= 0, "critic.weight_decay", f"must be >= 0, got {self.weight_decay}")
        _check(self.grad_clip >= 0, "critic.grad_clip", f"must be >= 0, got {self.grad_clip}")
        _check(self.cliprange_value >= 0, "critic.cliprange_value", f"must be >= 0, got {self.cliprange_value}")
        if self.model_path:
            from pathlib import Path

            _check(Path(self.model_path).expanduser().is_dir(), "critic.model_path", f"{self.model_path!r} is not a local folder")
