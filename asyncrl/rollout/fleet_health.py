"""The fleet's health: deaths, restarts, the background work that brings servers back, and its errors.

Job: `FleetHealth`, the `FleetManager`'s part that hears of a dead server (`_on_dead`, the router's
hook), decides whether it is replaced or was preempted, replaces it (`restart`, `_restart`: a fresh
server, joined and synced before it is routed, with retries and a back-off), probes routed servers
(`watch`), and runs the background work of every part (`_background`, `_counted`): the first failure of
that work is the manager's error, raised by `_check` in every verb, so the run stops loudly with it.
A mixin on the manager's shared state (`fleet_state.py` says why, not a part the manager owns); it asks
`fleet_weights` to join and sync a replacement, and `fleet_members` to close a server a shrink gave up.
Boundary: no placement (`Fleet.restart` starts the process), no routing (the router takes a dead server out).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from typing import Any, Awaitable

from asyncrl.engines.base import RolloutServer
from asyncrl.rollout.fleet_build import START_ATTEMPTS, Fleet
from asyncrl.rollout.fleet_state import FleetState, T, server_name, startup_detail
from asyncrl.rollout.parity import WeightParityError
from asyncrl.rollout.router import ServerDied
from asyncrl.trainer.rank import TrainerDied

log = logging.getLogger(__name__)
RESTART_BACKOFF_S = 60.0
"""Longest wait between two tries to replace a server that failed `START_ATTEMPTS` times in a row while others serve."""


class FleetHealth(FleetState):
    """Dead servers replaced, hung ones found, and background failures turned into the run's error."""

    def _coming(self, fleet: str | None) -> bool:
        """Whether a server of `fleet` (None: any) is being brought back; a restart that failed
        raises its error here, so the requests that waited for it stop with it (the trainer's
        death restarts the run) instead of waiting `SERVER_WAIT_S` for nobody."""
        self._check()
        return any(n for f, n in self._restarting.items() if fleet in (None, f))

    def _check(self) -> None:
        if isinstance(self._error, (WeightParityError, TrainerDied)):  # a deliberate stop; the trainer's death restarts the run
            raise self._error
        if self._error is not None:
            raise RuntimeError(f"fleet manager: a server could not be brought back: {self._error!r}") from self._error

    def _on_dead(self, server: RolloutServer, cause: ServerDied) -> None:
        self._silent.add(server)
        if server in self._draining:  # taken away by a shrink and died while it drained: a preempted spot node
            self._event("preempt", server, fleet=self._draining[server], cause=str(cause)[:200], replaced=False)
            return
        if not self._member(server):  # drained and closed by `resize`: its requests fail over, nothing to restart
            return
        fleet = self._fleet_of(server)
        room = self.capacity().get(fleet.name) if self.capacity is not None else None  # a node gone is room gone
        over = len(fleet.servers) > min(self.targets.get(fleet.name, len(fleet.servers)), room if room is not None else 1 << 30)
        self._event("preempt", server, cause=str(cause)[:200], replaced=self.restart_dead and not over)
        if over:  # the fleet is being shrunk: a death is one server fewer to drain (a preempted spot node)
            self._background(self._close_one(fleet, server, fleet.detach(server)))
        elif self.restart_dead:
            self._restarts_of[(fleet.name, fleet.index_of(server))] = self._background(self._begin_restart(server))

    def _background(self, work: Awaitable[Any]) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(work)  # type: ignore[arg-type]
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        for s in [s for s, t in self._restarts_of.items() if t is task]:
            del self._restarts_of[s]
        if not task.cancelled() and task.exception() is not None and self._error is None:
            self._error = task.exception()
            self.router.recheck()  # requests waiting for the server it was bringing back stop with its error

    async def restart(self, server: RolloutServer) -> RolloutServer:
        """Start a replacement for a dead server, sync it to the current version, route to it; a
        replacement that dies or cannot load the version before it is routed is replaced too
        (`START_ATTEMPTS` in a row)."""
        return await self._begin_restart(server)

    def _begin_restart(self, server: RolloutServer) -> Awaitable[RolloutServer]:
        return self._counted(server, self._restart(self._fleet_of(server), server))

    def _counted(self, server: RolloutServer, work: Awaitable[T]) -> Awaitable[T]:
        """Count `server` (its fleet's) as coming back at once (a request that finds no server waits
        for it: `Router.server_coming`), until `work` (a restart or a re-sync) ends."""
        fleet = self._fleet_of(server).name
        self._restarting[fleet] = self._restarting.get(fleet, 0) + 1
        self._returning.add(server)

        async def run() -> T:
            try:
                return await work
            finally:
                self._restarting[fleet] -= 1
                self._returning.discard(server)

        return run()

    async def _restart(self, fleet: Fleet, server: RolloutServer) -> RolloutServer:
        """Replace `server` (dead) until a replacement is routed at the current version. After
        `START_ATTEMPTS` failures in a row (each start itself retried: `Fleet.spawn`) the run stops if no
        server serves it; while others do, the fleet goes on degraded and tries again, backing off up to
        `RESTART_BACKOFF_S` (a node that keeps killing what starts on it must not end a run the others carry)."""
        for attempt in itertools.count():
            self.router.remove(server)
            await server.close()  # first: a hung one is killed, so its samples fail over and its bundle frees
            if not self._member(server):  # taken away by a shrink meanwhile: not replaced
                return server
            fresh = None
            try:
                try:
                    fresh = await fleet.restart(server)
                except LookupError:  # taken away by a shrink while its replacement started (closed by the fleet)
                    return server
                self._joined.pop(server, None)
                self._returning.add(fresh)  # until routed, or replaced in turn
                await self._join(fresh)
                async with self._membership:  # no publish between its sync and its first request
                    await self._bring_current(fresh)
                    if fleet.name in self.fleets:  # the fleet may have been removed meanwhile
                        self.router.add(fresh, fleet.name)
            except (ServerDied, RuntimeError) as exc:  # died again, or could not load the version (e.g. not joined in time)
                if isinstance(exc, TrainerDied):  # the weight source died, not the server: the run restarts
                    raise
                if isinstance(exc, WeightParityError) and (self.parity is None or self.parity.action == "stop"):
                    raise
                name = server_name(fresh if fresh is not None else server)
                if attempt >= START_ATTEMPTS - 1:
                    if not self.router.servers:  # nothing serves the run: it cannot go on
                        raise
                    wait = min(RESTART_BACKOFF_S, 2.0 ** (attempt - START_ATTEMPTS + 2))
                    self._event("restart_failed", fresh if fresh is not None else server, attempts=attempt + 1, error=repr(exc)[:200])
                    log.warning("restart of %s: %d attempts failed (%s); the fleet goes on without it, next try in %.0f s",
                                name, attempt + 1, exc, wait)
                    await asyncio.sleep(wait)
                else:
                    log.warning("restart of %s: attempt %d failed (%s); starting another", name, attempt + 1, exc)
                if fresh is not None:
                    server = fresh
                continue
            finally:
                if fresh is not None:
                    self._returning.discard(fresh)
            self.restarts += 1
            self._event("restart", fresh, **startup_detail(fresh))
            return fresh
        raise AssertionError("unreachable")

    async def watch(self, interval_s: float) -> None:
        """Probe every routed server each `interval_s` (until cancelled): one that is dead or does
        not answer in time (a hung process) is taken out like a death found by a request, so it is
        killed and restarted even while nothing else would notice (no publish, no new request).
        Servers without `probe` (in this process) are not probed. It raises the error of a restart
        or re-sync that failed (the trainer's death among them), so the run stops on it even while
        nothing publishes: requests that waited for that server then fail at once too."""
        while True:
            await asyncio.sleep(interval_s)
            self._check()
            live = [s for s in self.router.servers if hasattr(s, "probe")]
            results = await asyncio.gather(*(s.probe() for s in live), return_exceptions=True)
            for server, res in zip(live, results):
                if isinstance(res, ServerDied):
                    self.probe_failures += 1
                    self.router.take_out(server, res)
                elif isinstance(res, BaseException):
                    raise res

    async def wait_restarts(self) -> None:
        """Wait for restarts and re-syncs in progress (raises the first that failed)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
        self._check()
