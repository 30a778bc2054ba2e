"""The trainer pool's verbs as the controller sees them: one typed protocol for both pools.

`TrainerRank` (one rank in this process, the embedded default) and `TrainerGroup` (FSDP2 Ray
actors) have these same blocking verbs; `TrainerHandle` runs them on a worker thread, one at a
time. Boundary: a type only; it builds nothing and knows neither pool.

    pool: TrainerPool = build_trainer(cfg, model_path, storage)
    metrics = pool.train(plan)              # one optimizer step over the plan's rows
    pool.publish(pool.step, ["main-0"])     # weights -> the named servers' receivers
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class TrainerPool(Protocol):
    @property
    def step(self) -> int:
        """Trainer steps taken: the policy version the pool holds."""
        ...

    @property
    def endpoints(self) -> list[str]:
        """Where servers join the trainer's weight plane (one sender, or one per rank)."""
        ...

    def train(self, plan: Any) -> dict[str, float]:
        """One step on a `BatchPlan` (or its wire bytes); returns the step's metrics."""
        ...

    def publish(self, version: int, receivers: list[str], probe: list[int] | None = None) -> dict[str, Any] | None:
        """`probe`: token ids the outcome's `"probe"` scores with the weights sent (the parity probe's reference)."""
        ...

    def sync(self, receivers: list[str], resend: bool = False, probe: list[int] | None = None) -> dict[str, Any] | None: ...

    def save(self, path: str) -> None: ...

    def load(self, path: str) -> Any: ...
