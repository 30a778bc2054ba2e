"""TrainerHandle: the trainer as the controller drives it: async verbs, one at a time.

The pool behind it is a `TrainerRank` in this process (the embedded default) or a
`TrainerGroup` of Ray actors; both have the same blocking verbs, which run here on a worker
thread so the event loop keeps serving rollouts. A lock orders them: a training step, a
publish and a re-sync of a restarted server are all collective over the ranks and must never
interleave (FSDP all-gathers in a publish would otherwise meet a step's collectives).

    trainer = TrainerHandle(parts.trainer)
    metrics = await trainer.train(plan)
    outcome = await trainer.publish(3, ["main-0"])   # also what `FleetManager` calls
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from asyncrl.trainer.plan import BatchPlan


class TrainerDied(RuntimeError):
    """A trainer rank's process is gone (or the group was torn down because one was): the run
    restarts its processes from the last checkpoint (`trainer.max_restarts`)."""


class TrainerHandle:
    def __init__(self, impl: Any) -> None:
        self.impl = impl
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
