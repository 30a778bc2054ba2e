"""The controller's handle to the trainer: a rank's or a group's verbs, awaited, one at a time.

Job: `AsyncTrainer` runs the blocking verbs of a `TrainerRank` (this process) or a `TrainerGroup` (Ray
rank actors) on a worker thread, behind one lock, so the controller's event loop keeps serving rollouts
while a step, a publish or a re-sync runs, and no two of them interleave.
Boundary: no verbs of its own, no Ray, no torch: it only orders and awaits what the rank or group does.
It is the `FleetManager`'s `WeightSource` (`asyncrl/rollout/fleet_state.py`) by shape; the rollout side
never imports it.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from asyncrl.trainer.plan import BatchPlan


class AsyncTrainer:
    """The trainer as this process's event loop drives it: async verbs, one at a time.

    `trainer` is a `TrainerRank` in this process (the embedded default) or a `TrainerGroup` of Ray
    actors; both have the same blocking verbs, which run here on a worker thread so the event loop
    keeps serving rollouts. A lock orders them: a training step, a publish and a re-sync of a
    restarted server are all collective over the ranks and must never interleave (FSDP all-gathers in
    a publish would otherwise meet a step's collectives). The `FleetManager` gets this object as its
    weight source (`attach_weights`), so its syncs queue behind the step in flight.

        trainer = AsyncTrainer(parts.trainer)
        metrics = await trainer.train(plan)
        outcome = await trainer.publish(3, ["main-0"])   # also what `FleetManager` calls
    """

    def __init__(self, trainer: Any) -> None:
        self.impl = trainer
        self._lock = asyncio.Lock()

    @property
    def endpoints(self) -> list[str]:
        """Where servers join the trainer's weight plane (one sender, or one per rank)."""
        return self.impl.endpoints

    @property
    def step(self) -> int:
        return self.impl.step

    @property
    def published(self) -> int:
        """The last version the trainer's weight plane published (-1: none; a trainer taken back from a
        controller that died may already have published its checkpoint's)."""
        return int(getattr(self.impl, "published", -1))

    async def _call(self, verb: str, *args: Any) -> Any:
        async with self._lock:
            return await asyncio.to_thread(getattr(self.impl, verb), *args)

    async def train(self, plan: BatchPlan | bytes) -> dict[str, float]:
        """One step on `plan` (or its `to_bytes`): its rows carry typed handles, never tensors."""
        return await self._call("train", plan)

    async def publish(self, version: int, receivers: list[str], probe: list[int] | None = None) -> dict[str, Any]:
        return await self._call("publish", version, receivers, probe)

    async def sync(self, receivers: list[str], resend: bool = False, probe: list[int] | None = None) -> dict[str, Any]:
        return await self._call("sync", receivers, resend, probe)

    async def save(self, path: str) -> None:
        await self._call("save", path)

    async def load(self, path: str) -> None:
        await self._call("load", path)
