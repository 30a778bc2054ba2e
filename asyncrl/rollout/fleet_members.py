"""The fleet's membership: fleets added and removed, and servers joining and leaving a live run.

Job: `FleetMembership`, the `FleetManager`'s part that adds a fleet (synced, then routed) and removes one
(drained, then closed), and resizes a fleet while requests run (`resize`, `asyncrl scale`): a new
server gets the current weights from a routed peer (`_enter`, `_from_peer`) so no publish waits for it,
and a server taken away drains before it is closed (`_leave`).
A mixin on the manager's shared state (`fleet_state.py` says why, not a part the manager owns); it asks
`fleet_weights` to join and sync a server, and `fleet_health` to treat a joiner that died as any death.
Boundary: no publishes (`fleet_weights`), no restarts of dead servers (`fleet_health`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from asyncrl.engines.base import PEER_LOADED_MEANWHILE, PEER_WAS_LOADING, RolloutServer
from asyncrl.rollout.fleet_build import Fleet
from asyncrl.rollout.fleet_state import FleetState, note_loaded, server_name, startup_detail
from asyncrl.rollout.router import ServerDied
from asyncrl.trainer.rank import TrainerDied

log = logging.getLogger(__name__)
PEER_TRIES = 3
OVERLAPPED = (PEER_WAS_LOADING, PEER_LOADED_MEANWHILE)  # a publish reached the peer during its hand-out: again
"""Hand-outs from a peer a joiner gets while publishes keep making the one it loaded stale (then: the next publish)."""


class FleetMembership(FleetState):
    """Which servers belong to which fleet, and how they come and go while the run goes on."""

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
                    self._event("start", s, **startup_detail(s))
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
                        note_loaded(server, got)
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
