"""Rollout fleets: the servers that serve one run, grouped, placed, restarted and synced.

Job: building servers is engines/backends.py (`build_server`), starting them fleet_build.py (`build_fleet`,
`Fleet`). The `FleetManager` owns every
fleet of a run, the version each server serves and the rejoin rule: it adds and drains fleets
while requests run, has the trainer publish each version to exactly the servers that take
requests (weights travel trainer -> server on the weight plane, never through this process),
and restarts a server the router found dead, giving it the current weights before it takes a
request again.
Boundary: routing lives in router.py, the Ray shell in server_actor.py (imported only when a
fleet of actors is spawned, so this module stays importable without Ray).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import weakref
from typing import Any, Awaitable, Protocol, TypeVar

from checkpoint_engine.membership import DISCONNECTED, SILENT

from asyncrl.config import RolloutConfig
from asyncrl.engines.base import PEER_LOADED_MEANWHILE, PEER_WAS_LOADING, PauseMode, RolloutServer
from asyncrl.rollout.fleet_build import START_ATTEMPTS, Fleet, fleet_configs
from asyncrl.rollout.fleet_log import FleetLog
from asyncrl.rollout.parity import ParityCheck, WeightParityError
from asyncrl.rollout.router import Router, ServerDied
from asyncrl.trainer.rank import TrainerDied



class WeightSource(Protocol):
    """Where servers get weights: the trainer's weight plane (the controller's `AsyncTrainer`), or a test double."""

    endpoints: list[str]
    """The senders servers join: one, or one per trainer rank (sharded publish)."""

    async def publish(self, version: int, receivers: list[str], probe: list[int] | None = None) -> dict[str, Any]:
        """`probe`: also return, as `"probe"`, the log-probs of `probe[1:]` under the weights just sent
        (None from a source without a model): the parity probe's reference, in the same call."""
        ...

    async def sync(self, receivers: list[str], resend: bool = False, probe: list[int] | None = None) -> dict[str, Any]: ...


T = TypeVar("T")
log = logging.getLogger(__name__)
JOIN_GRACE_S = 0.5
"""`attach_weights`: after the first server joined, how long the others get before a slow one (hung?) is
taken out of routing and joins in the background (a hung one then costs no publish `rollout.health_timeout_s`).
A live server's join answers in 0.01-0.2 s on a loaded 2-core host; a trainer restart that met a hung server
waited the whole grace (2 s before 2026-12-06), with the fleet idle."""
PEER_TRIES = 3
OVERLAPPED = (PEER_WAS_LOADING, PEER_LOADED_MEANWHILE)  # a publish reached the peer during its hand-out: again
"""Hand-outs from a peer a joiner gets while publishes keep making the one it loaded stale (then: the next publish)."""
RESTART_BACKOFF_S = 60.0
"""Longest wait between two tries to replace a server that failed `START_ATTEMPTS` times in a row while others serve."""
EVENTS_SHOWN = 10
"""A fleet's latest joins, drains, preemptions and restarts shown by `asyncrl status`."""
SERVER_WAIT_S = 600.0
"""How long a request waits for a server while every server is being restarted (placement, model load, sync)."""


def server_name(server: RolloutServer) -> str:
    return str(getattr(server, "name", id(server)))


class FleetManager:
    """The one owner of the server set and of the version each serves: a server takes requests
    only at the current version, and a publish goes to exactly the servers that take requests.

    Trace: fleets main (s0, s1) join the weight plane; publish(v0) -> the trainer sends v0 to
    {s0, s1}, both load it, manager.version = 0; s1's actor dies mid-sample -> router takes s1
    out, on_dead -> restart: fresh s1' joins the weight plane -> sync(s1') (the trainer re-sends
    the current version to it alone) -> s1' holds v0 -> router.add(s1'). publish(v1) reaches
    only the routed servers; one that did not load it (evicted: too slow, refused) is taken out
    of routing, re-synced, and routed again (restarted if the sync fails too). add_fleet(f)
    joins and syncs f first; remove_fleet(f) drains f's servers before closing them.

        manager = FleetManager(Router())
        await manager.add_fleet(await Fleet.spawn("main", cfg, path, dtype="float32", seed=0, spec=spec))
        await manager.attach_weights(trainer, cfg.weights, pause_mode="keep")
        await manager.publish(0)
        out = await manager.router.call(lambda s: s.run_sample(sample))
    """

    def __init__(self, router: Router | None = None, *, restart_dead: bool = True) -> None:
        self.router = router if router is not None else Router()
        self.router.on_dead = self._on_dead
        self._restarting: dict[str, int] = {}
        """Restarts and re-syncs in progress per fleet name: servers that will take requests again."""
        self._returning: set[RolloutServer] = set()
        """The servers those restarts and re-syncs are about (the dead one, then its replacement)."""
        self._join_began: dict[RolloutServer, float] = {}
        """Pending joiners: when their join began (their `join` event's `seconds`)."""
        self._draining: dict[RolloutServer, str] = {}
        """Servers a shrink took away, while they drain, with their fleet (a death then is a preemption, not replaced)."""
        self._joined: dict[RolloutServer, Any] = {}
        """The weight source each server last joined (a restarted trainer is a new source)."""
        if restart_dead:  # while every server restarts, requests wait for one
            self.router.server_wait_s = SERVER_WAIT_S
            self.router.server_coming = self._coming
        self.fleets: dict[str, Fleet] = {}
        self.version = -1
        """The version every server that takes requests holds (-1: nothing published yet)."""
        self.restart_dead = restart_dead
        self.restarts = 0
        self.resyncs = 0
        self.probe_failures = 0
        """Servers found dead or hung by `watch` (not by a request or a publish)."""
        self._weights: WeightSource | None = None
        self._weights_cfg: Any = None
        self._pause_mode: PauseMode = "keep"
        self._tasks: set[asyncio.Task] = set()
        self._membership = asyncio.Lock()
        """Held by a publish, and by a server's sync-then-route: a server is routed only at the version every routed server holds."""
        self._error: BaseException | None = None
        self.last_publish_time = 0.0
        self.last_publish_s = 0.0
        self.evicted: dict[str, str] = {}
        """Servers left out of a publish, and why (cumulative)."""
        self._silent: weakref.WeakSet[RolloutServer] = weakref.WeakSet()
        """Servers not worth asking anything (`answering`): dead or hung ones being replaced, and those the
        weight plane heard nothing from until their probe answers."""
        self.parity: ParityCheck | None = None
        """The weight-parity rule (`attach_weights`); None: no probe."""
        self.targets: dict[str, int] = {}
        """Each fleet's size as last asked (`resize`); a server that dies while its fleet is above it is not replaced."""
        self._pending: list[RolloutServer] = []
        """Joiners no peer could give the current weights: the next publish includes them, then they are routed."""
        self.changes = FleetLog()
        """Joins, drains, preemptions and restarts; sizes over time; joins by source (`events`, `history`, `joins`)."""
        self.events, self.history, self.joins = self.changes.events, self.changes.history, self.changes.joins
        self._resizing = asyncio.Lock()
        self._restarts_of: dict[tuple[str, int], asyncio.Task] = {}
        """Dead servers being replaced, and the task that does it (a shrink cancels it: `resize`)."""
        self.capacity: Any = None
        """`rollout.follow_cluster`: () -> {fleet: servers the cluster has room for now}; a server that dies
        while its fleet is above that is a preemption (its node is gone), not restarted."""
        self.autoscale: dict[str, Any] | None = None
        """`rollout.autoscale`'s latest verdict on `main` (set by the controller; `asyncrl status`)."""

    def _coming(self, fleet: str | None) -> bool:
        """Whether a server of `fleet` (None: any) is being brought back; a restart that failed
        raises its error here, so the requests that waited for it stop with it (the trainer's
        death restarts the run) instead of waiting `SERVER_WAIT_S` for nobody."""
        self._check()
        return any(n for f, n in self._restarting.items() if fleet in (None, f))

    @classmethod
    async def spawn(cls, cfg: RolloutConfig, model_path: str, *, dtype: str, seed: int,
                    spec: dict[str, Any] | None = None, router: Router | None = None,
                    detached: Any = None, orphan_timeout_s: float = 300.0) -> "FleetManager":
        """Every fleet of `cfg` (`main` + `rollout.fleets`) as Ray actors, behind one router (built
        from the rollout keys unless given). Fleet k's servers draw seeds from `seed + 1000 * k + index`.
        `detached` (`orphan.DetachedNames`): they outlive this process, and the ones still running from
        a controller that died are taken back (`Fleet.spawn`)."""
        if router is None:
            router = Router(max_failovers=cfg.max_failovers, partial_rollouts=cfg.partial_rollouts)
        manager = cls(router, restart_dead=cfg.restart_dead_servers)
        named = list(fleet_configs(cfg).items())
        fleets = await asyncio.gather(*(Fleet.spawn(name, c, model_path, dtype=dtype, seed=seed + 1000 * k, spec=spec,
                                                    detached=detached, orphan_timeout_s=orphan_timeout_s)
                                        for k, (name, c) in enumerate(named)))
        for fleet in fleets:
            await manager.add_fleet(fleet)
        for (name, c), fleet in zip(named, fleets):  # a resume's servers that were gone: started while the run goes on
            if len(fleet.servers) < c.num_servers:
                manager._background(manager.resize(name, c.num_servers))
        return manager

    @property
    def servers(self) -> list[RolloutServer]:
        """Every server of every fleet (routed or not)."""
        return [s for f in self.fleets.values() for s in f.servers]

    def answering(self) -> list[RolloutServer]:
        """`servers` less those known dead or hung, or silent on the weight plane and not yet probed: what a
        checkpoint asks for its partial samples (a hung one would hold it `rollout.health_timeout_s`)."""
        return [s for s in self.servers if s not in self._silent]

    def _check(self) -> None:
        if isinstance(self._error, (WeightParityError, TrainerDied)):  # a deliberate stop; the trainer's death restarts the run
            raise self._error
        if self._error is not None:
            raise RuntimeError(f"fleet manager: a server could not be brought back: {self._error!r}") from self._error

    # ---- weights ------------------------------------------------------------------------
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
        of routing (then re-synced in the background). Metrics `weights/*`."""
        self._check()
        if self._weights is None:
            raise RuntimeError("publish: no weight source attached (attach_weights)")
        async with self._membership:
            return await self._publish(version)

    async def _publish(self, version: int) -> dict[str, float]:
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
                _loaded(s, version)
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
        if checked:
            for s, verdict in await self._parity(loaded, version, out.get("probe")):
                if self.parity.action == "stop":  # type: ignore[union-attr]
                    raise WeightParityError(verdict)
                self._take_out(s, "parity", resend=True)  # the version is sent again, then checked again
        return {"weights/publish_s": self.last_publish_s, "weights/gbps": float(out.get("gbps", 0.0)),
                "weights/evicted": float(len(live) - len(done)), "weights/bytes": float(out.get("bytes", 0)),
                "weights/sender_s": float(out.get("seconds", 0.0)), "weights/gather_s": float(out.get("gather_s", 0.0)),
                **(self.parity.metrics() if checked else {})}  # type: ignore[union-attr]

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
        parity = self.parity
        if parity is None or not servers or reference is None:  # no reference: a trainer without a model (benchmarks)
            return []
        servers = [s for s in servers if self._member(s)]  # a server taken away meanwhile (`resize`) is not judged
        scores = await asyncio.gather(*(s.score(parity.ids) for s in servers), return_exceptions=True)
        failed = []
        for s, got in zip(servers, scores):
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
        _loaded(server, self.version)
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

    # ---- membership -----------------------------------------------------------------------
    def _fleet_of(self, server: RolloutServer) -> Fleet:
        return next(f for f in self.fleets.values() if server in f.servers)

    async def add_fleet(self, fleet: Fleet) -> None:
        """Sync `fleet`'s servers to the current version, then route requests to them."""
        self._check()
        if fleet.name in self.fleets:
            raise ValueError(f"fleet {fleet.name!r} already serves this run")
        self.fleets[fleet.name] = fleet
        await asyncio.gather(*(self._join(s) for s in fleet.servers))
        async with self._membership:
            await asyncio.gather(*(self._bring_current(s) for s in fleet.servers))
            for s in fleet.servers:
                self.router.add(s, fleet.name)

    async def remove_fleet(self, name: str) -> Fleet:
        """Stop routing to the fleet, wait for its requests to finish, close its servers."""
        fleet = self.fleets.pop(name)
        await asyncio.gather(*(self.router.drain(s) for s in fleet.servers if s in self.router.servers))
        await fleet.close()
        return fleet

    def _member(self, server: RolloutServer) -> bool:
        return any(s is server for f in self.fleets.values() for s in f.servers)

    def _event(self, kind: str, server: RolloutServer | None = None, fleet: str = "", **detail: Any) -> None:
        if server is not None and self._member(server):
            fleet = self._fleet_of(server).name
        self.changes.record(kind, server_name(server) if server is not None else "", fleet, self.size(), **detail)

    def metrics(self) -> dict[str, float]:
        """`fleet/*` for the run's step log (`FleetLog.metrics`)."""
        return self.changes.metrics(self.size())

    def take_events(self) -> list[dict[str, Any]]:
        """Events since the last call (the controller logs them to metrics.jsonl)."""
        return self.changes.take()

    def size(self) -> dict[str, int]:
        """Routed servers per fleet (what serves requests now)."""
        out = {name: 0 for name in self.fleets}
        for name in self.fleets:
            out[name] = sum(1 for s in self.fleets[name].servers if s in self.router.servers)
        return out

    async def resize(self, name: str, servers: int, drain_timeout_s: float = 60.0) -> dict[str, Any]:
        """Change fleet `name` to `servers` servers while the run goes on (`asyncrl scale`). Growing
        starts the new servers and joins each in the background: it gets the current weights from a
        routed peer (`_enter`), so no publish waits for it. Shrinking drains servers (no new requests;
        those in flight finish within `drain_timeout_s`, then the server is closed and they move, with
        their snapshots, to other servers), the ones not routed first, then the newest. Returns what it
        did; raises ValueError for a request it refuses (the caller answers it)."""
        self._check()
        if name not in self.fleets:
            raise ValueError(f"no fleet {name!r} in this run (fleets: {', '.join(self.fleets)})")
        if servers < 1:
            raise ValueError(f"a fleet needs at least 1 server, asked {servers}")
        async with self._resizing:
            fleet = self.fleets[name]
            before = len(fleet.servers)
            self.targets[name] = servers
            if servers > before:
                def up(s: RolloutServer) -> None:  # each joins as soon as it is up, not when the last one is
                    self._event("start", s, **_startup(s))
                    self._background(self._counted(s, self._enter(s)))

                new, errors = await fleet.grow(servers - before, on_up=up)
                for e in errors:
                    self._event("start_failed", None, fleet=name, error=repr(e)[:200])
                out = {"fleet": name, "from": before, "to": len(fleet.servers), "started": [server_name(s) for s in new],
                       "failed": [repr(e)[:200] for e in errors]}
            elif servers < before:
                replacing = lambda s: (name, fleet.index_of(s)) in self._restarts_of  # noqa: E731
                dead = [s for s in fleet.servers if replacing(s)]  # dead, being replaced: the cheapest to give up
                # then those coming back (joining, or re-synced after a missed publish: a node that vanished
                # is often one of them), which serve nothing now; then the rest, the unrouted and newest first.
                # (Leaving the ones coming back out drained the one healthy server of a run whose other
                # node had just gone, and the fleet was left with none.)
                returning = [s for s in fleet.servers if s in self._returning and not replacing(s) and s not in self.router.servers]
                order = dead + returning + sorted((s for s in fleet.servers if not replacing(s) and not any(s is r for r in returning)),
                                                  key=lambda s: (s in self.router.servers, -fleet.index_of(s)))
                victims = order[: before - servers]
                for v in victims:
                    task = self._restarts_of.pop((name, fleet.index_of(v)), None)
                    if task is not None:
                        task.cancel()
                indices = [fleet.detach(v) for v in victims]
                self._draining.update((v, name) for v in victims)
                self._pending = [p for p in self._pending if not any(p is v for v in victims)]
                await asyncio.gather(*(self._leave(fleet, v, i, drain_timeout_s) for v, i in zip(victims, indices)))
                out = {"fleet": name, "from": before, "to": len(fleet.servers), "drained": [server_name(v) for v in victims]}
            else:
                out = {"fleet": name, "from": before, "to": before}
            return out

    async def _enter(self, server: RolloutServer) -> None:
        """A server that joins a live run: the current weights from a routed peer that holds them
        (`_from_peer`), then routed at once if the version is still current; else (no peer could, or a
        publish came meanwhile) the next publish includes it and routes it. Nothing published yet: it
        joins the trainer's plane and is routed, as a fleet's first servers are."""
        t0 = time.time()
        try:
            if self._weights is None or self.version < 0:
                await self._join(server)
                async with self._membership:
                    try:
                        await self._bring_current(server)
                    except RuntimeError as exc:  # not loaded (a version came meanwhile): the next publish brings it
                        if isinstance(exc, TrainerDied):
                            raise
                        self._pending.append(server)
                        self._event("join_pending", server, why=str(exc)[:200])
                        return
                    if self._member(server):
                        self.router.add(server, self._fleet_of(server).name)
                self.joins["trainer"] += 1
                self._event("join", server, via="trainer", seconds=round(time.time() - t0, 3))
                return
            got: int | str = "no routed peer"
            for _ in range(PEER_TRIES):  # a publish that lands during a hand-out leaves the joiner a version behind: again
                while self._membership.locked():  # a publish (or a sync) is on: hand out after it, at its version
                    await asyncio.sleep(0.05)
                got = await self._from_peer(server)
                if isinstance(got, str):
                    if got in OVERLAPPED:  # a publish reached the peer during the hand-out: again, after it
                        continue
                    break
                await self._join(server)  # the trainer's plane, for every publish from now on
                async with self._membership:
                    if got == self.version and self._member(server):
                        _loaded(server, got)
                        self.router.add(server, self._fleet_of(server).name)
                        self.joins["peer"] += 1
                        self._event("join", server, via="peer", version=got, seconds=round(time.time() - t0, 3))
                        return
            if self._joined.get(server) is not self._weights:
                await self._join(server)
            async with self._membership:
                if self._member(server):
                    self._pending.append(server)
                    self._join_began[server] = t0
                    self._event("join_pending", server, why=f"no peer: {got}" if isinstance(got, str) else f"peer gave version {got}, now {self.version}")
        except ServerDied as exc:  # died while joining: a preemption like any other
            self.joins["failed"] += 1
            self.router.take_out(server, exc) if server in self.router.servers else self._on_dead(server, exc)

    async def _from_peer(self, server: RolloutServer) -> int | str:
        """Have a routed server that holds the current version send its weights to `server` over the
        weight plane (`ServerHost.offer_weights`); the version `server` loaded, or why no peer could
        (none holds the version or can export its weights, or each one tried failed: the last one's
        reason, one of `OVERLAPPED` when a publish reached it during the hand-out)."""
        name = server_name(server)
        peers = [s for s in self.router.servers if s.version == self.version and hasattr(s, "offer_weights")]
        peers.sort(key=lambda s: s.stats().in_flight)
        why = f"no routed server holds version {self.version}" if not peers else "no peer can export its weights"
        for peer in peers[:2]:
            try:
                endpoint = await peer.offer_weights(self._weights_cfg, name)
            except ServerDied as exc:  # the peer died: the router's
                if peer in self.router.servers:
                    self.router.take_out(peer, exc)
                why = f"peer {server_name(peer)} died"
                continue
            if endpoint is None:
                continue
            await server.join_weights(self._weights_cfg, [endpoint], self._pause_mode)  # the joiner dying: the caller's
            self._joined.pop(server, None)  # joined to the peer, not to the source
            try:
                out = await peer.send_offered(name, float(getattr(self._weights_cfg, "timeout_s", 30.0)))
            except ServerDied as exc:
                if peer in self.router.servers:
                    self.router.take_out(peer, exc)
                why = f"peer {server_name(peer)} died"
                continue
            if out.get("loaded"):
                return int(out["version"])
            why = str(out.get("why") or "not loaded")
            log.info("join of %s: peer %s could not give it its weights (%s)", name, server_name(peer), why)
            if why in OVERLAPPED:  # the other peer holds the same version and takes the same publish
                break
        return why

    async def _leave(self, fleet: Fleet, server: RolloutServer, index: int, timeout_s: float) -> None:
        """Drain a server taken out of its fleet: no new requests; the ones in flight get `timeout_s` (a
        server in this process gets what it needs: its samples cannot move), then it is closed (a Ray
        actor's calls then fail over, their samples continued from their snapshots)."""
        t0 = time.time()
        moved = 0
        if server in self.router.servers:
            remote = hasattr(server, "probe")
            try:
                async with asyncio.timeout(timeout_s if remote else None):
                    await self.router.drain(server)
            except TimeoutError:
                moved = server.stats().in_flight
                self.router.remove(server)
        try:
            await self._close_one(fleet, server, index)
        finally:
            self._draining.pop(server, None)
        self._event("drain", server, fleet=fleet.name, seconds=round(time.time() - t0, 3), moved=moved)

    async def _close_one(self, fleet: Fleet, server: RolloutServer, index: int) -> None:
        self.router.remove(server)
        self._joined.pop(server, None)
        await fleet.close_one(server, index)

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
            self._event("restart", fresh, **_startup(fresh))
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

    async def stats(self) -> dict[str, Any]:
        """Per fleet and per server: health, in-flight, version, tokens/s; plus totals. An observer's
        verb: it never raises the manager's error (the health loop, `watch`, does)."""
        fleets: dict[str, Any] = {}
        for name, fleet in self.fleets.items():
            rows = []
            gaps = self.parity.gaps if self.parity is not None else {}
            for s in fleet.servers:
                st = await s.refresh() if hasattr(s, "refresh") else s.stats()
                parity = gaps.get(server_name(s))
                rows.append({"name": getattr(s, "name", f"{name}-{len(rows)}"), "healthy": st.healthy,
                             "routed": s in self.router.servers, "in_flight": st.in_flight, "version": st.version,
                             "paused": st.paused, "tokens_per_s": st.tokens_per_s, "generated_tokens": st.generated_tokens,
                             "parity_max_abs": parity[1] if parity else None, "parity_version": parity[0] if parity else None})
            self.changes.note_sizes(self.size())
            fleets[name] = {
                "servers": rows, "healthy": sum(r["healthy"] for r in rows),
                "in_flight": sum(r["in_flight"] for r in rows), "tokens_per_s": sum(r["tokens_per_s"] for r in rows),
                "size": sum(r["routed"] for r in rows), "target": self.targets.get(name, len(fleet.servers)),
                "history": [list(h) for h in self.history.get(name, [])],
                "events": [{k: v for k, v in e.items() if k != "size"} for e in self.events if e["fleet"] == name][-EVENTS_SHOWN:],
                **({"autoscale": dict(self.autoscale)} if self.autoscale is not None and name == "main" else {}),
            }
        return {"version": self.version, "fleets": fleets, "restarts": self.restarts, "resyncs": self.resyncs, "probe_failures": self.probe_failures,
                "failovers": self.router.failovers, "resubmits": self.router.resubmits, "joins": dict(self.joins)}

    async def close(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*list(self._tasks), return_exceptions=True)
        await asyncio.gather(*(f.close() for f in self.fleets.values()))
        self.fleets.clear()


def _startup(server: RolloutServer) -> dict[str, Any]:
    """A started server's `startup` split (`remote_server.startup_split`) for its fleet event; none for
    a server in this process."""
    split = getattr(server, "startup", None)
    return {"startup": split} if split else {}


def _loaded(server: RolloutServer, version: int) -> None:
    """Record on a proxy that its server now holds `version` (a local server knows it itself)."""
    hook = getattr(server, "loaded", None)
    if hook is not None:
        hook(version)
