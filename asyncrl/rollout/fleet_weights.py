"""The fleet's weight plane: which servers a publish goes to, and bringing one that missed it back.

Job: `FleetWeights`, the `FleetManager`'s part that joins servers to the trainer's weight plane
(`attach_weights`, `_join`), has the trainer publish each version to exactly the routed servers and takes
out of routing one that did not load it (`publish`), checks loaded versions with the parity probe
after the publish returned (`_settle`; a re-sync's before the server is routed: `_parity`), times the
publish's phases (`publish_phases.py`), and sends one server the current version before it is routed (`_bring_current`), or after
it missed a publish (`_recover`, in the background). Weights travel trainer -> server, never through
this process.
A mixin on the manager's shared state (`fleet_state.py` says why, not a part the manager owns); it asks
`fleet_health` to restart a server it cannot bring back.
Boundary: no joining of live runs from peers (`fleet_members`), no restarts (`fleet_health`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from checkpoint_engine.membership import DISCONNECTED, SILENT

from asyncrl.engines.base import PauseMode, RolloutServer
from asyncrl.rollout.fleet_state import FleetState, WeightSource, note_loaded, server_name
from asyncrl.rollout.parity import ParityCheck, WeightParityError
from asyncrl.rollout.publish_phases import phase_metrics
from asyncrl.rollout.router import ServerDied
from asyncrl.trainer.rank import TrainerDied

log = logging.getLogger(__name__)
JOIN_GRACE_S = 0.5
"""`attach_weights`: after the first server joined, how long the others get before a slow one (hung?) is
taken out of routing and joins in the background (a hung one then costs no publish `rollout.health_timeout_s`).
A live server's join answers in 0.01-0.2 s on a loaded 2-core host; a trainer restart that met a hung server
waited the whole grace (2 s before 2026-12-06), with the fleet idle."""


class FleetWeights(FleetState):
    """The weight plane's side of the `FleetManager`: a publish reaches exactly the servers that take requests."""

    _checking: asyncio.Task | None = None
    """The parity check of the last publish that had one (`_settle`), while and after it runs."""
    _parity_event: asyncio.Event | None = None
    """Set when a check fails with `weights.parity_action=stop` (`watch_parity` wakes on it)."""
    _parity_stop: WeightParityError | None = None

    async def attach_weights(self, source: WeightSource, cfg: Any, pause_mode: PauseMode = "keep",
                             parity: ParityCheck | None = None) -> None:
        """Every server (now and later) joins `source`'s weight plane and loads what it publishes;
        with `parity`, loaded versions are checked against the trainer's log-probs (`parity.py`)."""
        self._weights, self._weights_cfg, self._pause_mode, self.parity = source, cfg, pause_mode, parity
        servers = list(self.router.servers)
        joins = [asyncio.ensure_future(self._join(s)) for s in servers]
        if joins:  # every server that joins within JOIN_GRACE_S of the first; a slow one (hung?) rejoins in the background
            await asyncio.wait(joins, return_when=asyncio.FIRST_COMPLETED)
            await asyncio.wait(joins, timeout=JOIN_GRACE_S)
        for server, join in zip(servers, joins):
            if not join.done():
                join.cancel()
                self.router.remove(server)
                self._background(self._counted(server, self._recover(server)))
            elif isinstance(join.exception(), ServerDied):  # died meanwhile: restarted (it joins then) like any dead server
                self.router.take_out(server, join.exception())  # type: ignore[arg-type]
            elif join.exception() is not None:
                raise join.exception()  # type: ignore[misc]
        for fleet in self.fleets.values():  # out of routing when the last source died (`detach_weights`), none coming
            for s in fleet.servers:
                if s not in self.router.servers and not any(s is r for r in servers) and s not in self._returning:
                    self._background(self._counted(s, self._recover(s)))

    async def detach_weights(self) -> None:
        """The weight source died (the trainer restarts; see `Components.restart_trainer`): forget it, its
        error and the version. The servers keep serving what they loaded until the next source publishes;
        restarts and re-syncs in flight go on, and join the next source when they get to it (`_bring_current`)."""
        self._error, self._weights, self.version = None, None, -1

    async def _join(self, server: RolloutServer) -> None:
        source = self._weights
        if source is not None and hasattr(server, "join_weights"):
            await server.join_weights(self._weights_cfg, source.endpoints, self._pause_mode)
            self._joined[server] = source

    async def publish(self, version: int) -> dict[str, float]:
        """Publish `version` to every routed server; returns when each loaded it or was taken out
        of routing (then re-synced in the background). Metrics `weights/*`: the publish's phases
        (`publish_phases.py`) and the parity of the latest checks that ended.
        When the parity probe is due, it is checked after the publish returns (`_settle`), so no train
        step waits for it: the servers score it at once (they resumed after their load) while the
        membership lock, handed on from the publish, keeps any other load or routing change out; the
        trainer scores its reference before its next verb (`AsyncTrainer.publish`); the two are
        compared when both are in, and a failure stops the run (`watch_parity`) or re-syncs the server
        as `weights.parity_action` says. The next publish starts after both sides scored."""
        self._check()
        if self._weights is None:
            raise RuntimeError("publish: no weight source attached (attach_weights)")
        await self._membership.acquire()
        release = _Once(self._membership.release)
        try:
            metrics, check = await self._publish(version)
        except BaseException:
            release()
            raise
        if check is None:
            release()
        else:  # the check releases the lock once the servers scored (or if it never runs)
            self._checking = self._background(check(release))
            self._checking.add_done_callback(lambda _: release())
        return metrics

    async def _publish(self, version: int) -> tuple[dict[str, float], Any]:
        t0 = time.time()
        pending = [s for s in self._pending if s not in self.router.servers and self._member(s)]
        live = self.router.servers + pending
        checked = self.parity is not None and self.parity.due()
        out = await self._weights.publish(version, [server_name(s) for s in live], probe=self.parity.ids if checked else None)  # type: ignore[union-attr]
        self.version = version
        done = set(out["completed"])
        loaded = []
        for s in live:
            if server_name(s) in done:
                note_loaded(s, version)
                loaded.append(s)
                if s in pending:  # a joiner no peer could serve: it holds the current version now
                    self._pending.remove(s)
                    self.router.add(s, self._fleet_of(s).name)
                    self.joins["publish"] += 1
                    began = self._join_began.pop(s, None)
                    self._event("join", s, via="publish", **({"seconds": round(time.time() - began, 3)} if began else {}))
            elif s in self.router.servers:  # not taken out meanwhile (a death is the router's)
                self._take_out(s, out["evicted"].get(server_name(s), "not loaded"))
        self.last_publish_time, self.last_publish_s = time.time(), time.time() - t0
        check = (lambda release: self._settle(loaded, version, out.get("probe"), release)) if checked else None
        return {"weights/publish_s": self.last_publish_s, "weights/gbps": float(out.get("gbps", 0.0)),
                **phase_metrics(out, self.last_publish_s),
                "weights/evicted": float(len(live) - len(done)), "weights/bytes": float(out.get("bytes", 0)),
                "weights/sender_s": float(out.get("seconds", 0.0)), "weights/gather_s": float(out.get("gather_s", 0.0)),
                **(self.parity.metrics() if self.parity is not None else {})}, check

    async def _settle(self, servers: list[RolloutServer], version: int, reference: Any, release: Any) -> None:
        """The parity check of a publish, after it returned: the servers' scores (under the membership
        lock the publish handed on, `release`d once they are in), then the trainer's `reference` (a list,
        or a future of (list, seconds)); a server above the tolerance stops the run or is re-synced."""
        parity = self.parity
        assert parity is not None
        t0 = time.time()
        try:
            scored = await self._scores(servers)
        finally:
            release()
        parity.servers_s = time.time() - t0
        if isinstance(reference, asyncio.Future):
            reference, parity.trainer_s = await asyncio.shield(reference)  # the trainer's lock is released with it
        parity.ended += 1
        for s, verdict in self._judge(scored, version, reference):
            if parity.action == "stop":
                self._parity_stop = WeightParityError(verdict)
                self._parity_failed().set()
                raise self._parity_stop
            if s in self.router.servers:  # else it is being re-synced or replaced already (checked then)
                self._take_out(s, "parity", resend=True)  # the version is sent again, then checked again

    def _parity_failed(self) -> asyncio.Event:
        if self._parity_event is None:
            self._parity_event = asyncio.Event()
        return self._parity_event

    async def watch_parity(self) -> None:
        """Raise the `WeightParityError` of the first check that fails with `weights.parity_action=stop`, as
        soon as it is in (one of the run's loops: checks end after their publish returned)."""
        await self._parity_failed().wait()
        raise self._parity_stop  # type: ignore[misc]

    async def parity_settled(self) -> None:
        """Wait for the parity check in flight, if any; raises the error of one that failed (its stop)."""
        if self._checking is not None:
            await asyncio.gather(self._checking, return_exceptions=True)
        self._check()

    def _take_out(self, server: RolloutServer, why: str, resend: bool = False) -> None:
        """A routed server that does not serve the current version: out of routing, re-synced in the
        background (`resend`: it acknowledged the version, but serves other weights)."""
        self.evicted[server_name(server)] = why
        if why in SILENT:
            self._silent.add(server)
        log.warning("server %s out of routing (%s): re-syncing it", server_name(server), why)
        self.router.remove(server)
        self._background(self._counted(server, self._recover(server, why)))

    async def _parity(self, servers: list[RolloutServer], version: int, reference: list[float] | None
                      ) -> list[tuple[RolloutServer, str]]:
        """Score the probe on `servers` (which just loaded `version`) against the trainer's `reference`
        (scored with the weights it sent them); the servers above the tolerance, each with its one-line
        verdict. A server that dies meanwhile is the router's."""
        if self.parity is None or not servers or reference is None:  # no reference: a trainer without a model (benchmarks)
            return []
        return self._judge(await self._scores(servers), version, reference)

    async def _scores(self, servers: list[RolloutServer]) -> list[tuple[RolloutServer, Any]]:
        """Each member's log-probs of the probe (or the error it raised); a server taken away meanwhile (`resize`) is not asked."""
        servers = [s for s in servers if self._member(s)]
        got = await asyncio.gather(*(s.score(self.parity.ids) for s in servers), return_exceptions=True)  # type: ignore[union-attr]
        return list(zip(servers, got))

    def _judge(self, scored: list[tuple[RolloutServer, Any]], version: int, reference: list[float] | None
               ) -> list[tuple[RolloutServer, str]]:
        parity = self.parity
        if parity is None or reference is None:
            return []
        failed = []
        for s, got in scored:
            if not self._member(s):  # taken away while it scored (closed by a drain): no verdict
                continue
            if isinstance(got, ServerDied):
                self.router.take_out(s, got)
                continue
            if isinstance(got, BaseException):  # a server that cannot score the probe does not pass it
                log.warning("parity probe: server %s failed to score: %r", server_name(s), got)
                got = []
            verdict = parity.judge(server_name(s), version, reference, got)
            if verdict is not None:
                failed.append((s, verdict))
        return failed

    async def _bring_current(self, server: RolloutServer) -> None:
        """Send a server the current version (nothing before the first publish), always, even if it
        acknowledged it (its engine serves other weights: a failed parity check), or the sender may still
        hold a dead process's entry under the same id as current (a fresh join). A server joined to an
        earlier source (the trainer restarted meanwhile) joins the current one first; a sync that meets
        the death of a source replaced meanwhile is done again with the new one. Under `_membership`."""
        while True:
            source = self._weights
            if source is None:
                return
            if self._joined.get(server) is not source:
                await self._join(server)
            if self.version < 0:
                return
            try:
                out = await source.sync([server_name(server)], resend=True, probe=self.parity.ids if self.parity else None)
            except TrainerDied:
                if self._weights is source:  # the source of now died: the run restarts
                    raise
                continue
            break
        if server_name(server) not in out["completed"]:
            raise RuntimeError(f"rejoin: {server_name(server)} did not load version {self.version}: "
                               f"{out['evicted'].get(server_name(server), 'no reason given')}")
        note_loaded(server, self.version)
        for _, verdict in await self._parity([server], self.version, out.get("probe")):  # a re-sync is always checked
            raise WeightParityError(verdict)

    async def _recover(self, server: RolloutServer, why: str = "") -> None:
        """A live server missed a publish (evicted for `why`) or failed its parity check (or is not joined
        to the current source: it joins outside the lock, so a hung one holds up no publish): re-sync it
        and route it again; restart it if that fails. Evicted for silence (`SILENT`: `disconnected`,
        `timeout`, `straggler`): its process is probed first (`rollout.health_timeout_s`, outside the
        trainer), so a dead or hung one is restarted at once instead of re-synced (the sync would hold the
        trainer, and every step behind it, while it waits for the receiver's connection); a live
        `disconnected` one joins anew (its receiver lost the connection)."""
        try:
            if why in SILENT and hasattr(server, "probe"):
                await server.probe()  # ServerDied: restarted below
            self._silent.discard(server)  # it answers
            if why == DISCONNECTED or self._joined.get(server) is not self._weights:
                await self._join(server)
            async with self._membership:
                await self._bring_current(server)
                if any(server in f.servers for f in self.fleets.values()):
                    self.router.add(server, self._fleet_of(server).name)
        except TrainerDied:  # the weight source died, not the server: the run restarts
            raise
        except WeightParityError:
            if self.parity is None or self.parity.action == "stop":
                raise
            await self.restart(server)  # re-sent and still wrong: a fresh server (whose own failure stops the run)
            return
        except (RuntimeError, ServerDied) as exc:  # it cannot load the version: dead (a publish found it gone) or broken
            self.router.remove(server)
            self._on_dead(server, exc if isinstance(exc, ServerDied) else ServerDied(f"{server_name(server)}: re-sync failed: {exc}"))
            return
        self.resyncs += 1


class _Once:
    """`fn` called at most once, however many call it (a lock handed on, released by whoever is last to know)."""

    def __init__(self, fn: Any) -> None:
        self.fn: Any = fn

    def __call__(self) -> None:
        fn, self.fn = self.fn, None
        if fn is not None:
            fn()
