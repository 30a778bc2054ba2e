"""What the simulator is told about a run's rules (`Schedule`) and what it answers (`SimResult`).

Job: the typed records around `sim.Simulator`: the schedule of one run (mode, eta, publish
cadence, admission, update mode, staleness level: the same keys as `trainer.*` / `rollout.*`),
the trace of its admission decisions, and one simulated run's measurements. No behaviour: what a
mode admits is `asyncrl.admission.mode_rule`'s, as for the controller.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from asyncrl.admission import ModeRule, mode_rule

MODES = ("sync", "one_step_off", "fully_async")
UPDATE_MODES = ("keep", "abort", "wait")
STALENESS_LEVELS = ("group", "token")


@dataclass
class Schedule:
    mode: str = "fully_async"
    eta: int = 4
    """trainer.max_staleness of fully_async (sync: 0, one_step_off: 1)."""
    publish_every: int = 1
    admission: str = "pace"
    """trainer.admission of fully_async: `pace` or `bound`."""
    slack: float = 0.25
    steps: int = 20
    """Measured trainer steps (after `warmup`)."""
    warmup: int = 3
    update_mode: str = "keep"
    """rollout.update_mode: how a publish treats samples in flight (keep, abort, wait: see `sim.py`)."""
    staleness_level: str = "group"
    """trainer.staleness_level: `group` (a group is as old as its oldest token) or `token`."""
    group_affinity: bool = True
    """rollout.group_affinity: every sample of a group runs on the server its first sample was sent to."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"trainer.mode: {self.mode!r} is not one of {MODES}")
        if self.admission not in ("pace", "bound"):
            raise ValueError(f"trainer.admission: {self.admission!r} is not pace or bound")
        if self.update_mode not in UPDATE_MODES:
            raise ValueError(f"rollout.update_mode: {self.update_mode!r} is not one of {UPDATE_MODES}")
        if self.staleness_level not in STALENESS_LEVELS:
            raise ValueError(f"trainer.staleness_level: {self.staleness_level!r} is not one of {STALENESS_LEVELS}")

    @classmethod
    def of_run(cls, trainer: Mapping[str, Any], rollout: Mapping[str, Any], *, steps: int, warmup: int) -> Schedule:
        """The schedule of a run's `trainer` and `rollout` config sections (its resolved `config.yaml`, or
        `dataclasses.asdict` of its config): every key the simulator models, so it admits as that run did."""
        return cls(mode=trainer["mode"], eta=trainer["max_staleness"], publish_every=trainer["publish_every"],
                   admission=trainer["admission"], slack=trainer["admission_slack"], steps=steps, warmup=warmup,
                   update_mode=rollout["update_mode"], staleness_level=trainer["staleness_level"],
                   group_affinity=rollout["group_affinity"])

    @property
    def rule(self) -> ModeRule:
        """What the mode admits, as the controller's `TrainerConfig.rule` (`asyncrl.admission.mode_rule`)."""
        return mode_rule(self.mode, max_staleness=self.eta, publish_every=self.publish_every,
                         admission=self.admission, slack=self.slack)


@dataclass
class TraceEvent:
    """One call into the manager and the admission decisions right after it."""

    t: float
    op: str
    """finish | drop | took | step_done | set_version | start (the run's first admissions)."""
    args: tuple
    admitted: int
    can_start: bool
    limit: int


@dataclass
class SimResult:
    trained_tokens_per_s: float
    generated_tokens_per_s: float
    trainer_idle_ratio: float
    rollout_idle_ratio: float
    step_s: float
    staleness_hist: dict[int, int]
    staleness_mean: float
    staleness_max: int
    drops: int
    dropped_fraction: float
    stale_token_fraction: float = 0.0
    """Trained tokens older than eta at their step (masked out of the loss at `staleness_level=token`)."""
    token_staleness_mean: float = 0.0
    """Mean over trained tokens of (step - the version that generated the token)."""
    partial_fraction: float = 0.0
    """Trained samples whose tokens came from more than one version."""
    max_partial_span: int = 0
    """Most versions one trained sample spanned (last - first)."""
    prefill_s: float = 0.0
    """`update_mode=abort`: mean seconds a server stood still per publish, prefilling what it was running."""
    trace: list[TraceEvent] = field(default_factory=list, repr=False)
