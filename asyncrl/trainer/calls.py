"""The controller's handle to the trainer: a rank's or a group's verbs, awaited, one at a time.

Job: `AsyncTrainer` runs the blocking verbs of a `TrainerRank` (this process) or a `TrainerGroup` (Ray
rank actors) on a worker thread, behind one lock, so the controller's event loop keeps serving rollouts
while a step, a publish or a re-sync runs, and no two of them interleave.
Boundary: no verbs of its own, no Ray, no torch: it only orders and awaits what the rank or group does.
It is the `FleetManager`'s `WeightSource` (`asyncrl/rollout/fleet_state.py`) by shape; the rollout side
never imports it.
A publish with the parity probe returns once the weights are loaded: the trainer's reference (a forward
on the probe) is scored next, as a verb of its own that keeps the lock from the publish, so no step
changes the weights before it and no step waits for the servers' side or the comparison.
"""

from __future__ import annotations

import asyncio
import threading
import time
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
        """One step on `plan` (or its `to_bytes`): its rows carry typed handles, never tensors. `lock_s`:
        how long it waited for the trainer (a publish's probe, a re-sync)."""
        t0 = time.perf_counter()
        async with self._lock:
            t1 = time.perf_counter()
            out = await asyncio.to_thread(self.impl.train, plan)
        return dict(out, lock_s=t1 - t0)

    async def publish(self, version: int, receivers: list[str], probe: list[int] | None = None) -> dict[str, Any]:
        """Send the weights as `version` to `receivers`; returns once each loaded them or was evicted. The
        outcome says how long the publish waited for the trainer (`lock_s`) and how long its verb took
        (`call_s`; phases: `asyncrl/rollout/publish_phases.py`). `probe`: its `"probe"` is a future of
        (the trainer's log-probs of `probe[1:]` under the weights just sent, seconds the forward took),
        scored after the verb while the lock stays held (in the verb, a list, where the trainer has no
        `score` verb of its own)."""
        t0 = time.perf_counter()
        await self._lock.acquire()
        t1 = time.perf_counter()
        after = bool(probe) and callable(getattr(self.impl, "score", None))
        try:
            out = dict(await asyncio.to_thread(self.impl.publish, version, receivers, None if after else probe),
                       lock_s=t1 - t0, call_s=time.perf_counter() - t1)
        except BaseException:
            self._lock.release()
            raise
        if not after:
            self._lock.release()
            return out
        out["probe"] = self._score_holding_lock(probe)  # type: ignore[arg-type]
        return out

    def _score_holding_lock(self, probe: list[int]) -> asyncio.Future:
        """The trainer's forward on `probe` on a thread of its own; the lock is released when the forward
        has ended (not when a waiter gives up: a step must never run beside it)."""
        loop, done = asyncio.get_running_loop(), asyncio.get_running_loop().create_future()

        def settle(result: Any, exc: BaseException | None) -> None:
            if not done.cancelled():  # first: the check that waits for it runs before the next verb
                done.set_exception(exc) if exc is not None else done.set_result(result)
            self._lock.release()

        def run() -> None:
            t0 = time.perf_counter()
            try:
                result, exc = (self.impl.score(probe), time.perf_counter() - t0), None
            except BaseException as e:  # handed to the awaiting task
                result, exc = None, e
            try:
                loop.call_soon_threadsafe(settle, result, exc)
            except RuntimeError:  # deliberate: the loop closed meanwhile (the run ended); nobody waits
                pass

        threading.Thread(target=run, name="trainer-probe", daemon=True).start()
        return done

    async def sync(self, receivers: list[str], resend: bool = False, probe: list[int] | None = None) -> dict[str, Any]:
        return await self._call("sync", receivers, resend, probe)

    async def save(self, path: str) -> None:
        await self._call("save", path)

    async def load(self, path: str) -> None:
        await self._call("load", path)
