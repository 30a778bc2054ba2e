"""How the servers of a fleet are started: a `Fleet` is N servers of one backend (each built by
`engines.backends.build_server`, which looks the backend up in `engines/registry.py`) and one sampling setup, either local
(`build_fleet`: in this process, the embedded default) or Ray actors in one placement group
(`Fleet.spawn`, which replaces a server that dies while starting).
Boundary: which servers take requests, at which version, and what happens when one dies is the
`FleetManager`'s (fleet.py); the Ray shell is server_actor.py (imported only when a fleet of
actors is spawned, so this module stays importable without Ray).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any, Awaitable, Callable

from asyncrl.config import RolloutConfig
from asyncrl.engines.backends import build_server
from asyncrl.engines.base import RolloutServer
from asyncrl.rollout.router import DEFAULT_FLEET, ServerDied

START_ATTEMPTS = 5
"""Starts of one server in a row that may die before it is up (then the fleet fails). A start that
raises (a bad config, a missing file) fails at once; these are deaths: a process killed while it loads
(a preempted node, a chaos run's injector) as well as one that crashes there, so a few are allowed."""


def build_fleet(cfg: RolloutConfig, model_path: str, *, dtype: str, seed: int, log_dir: str | None = None) -> list[RolloutServer]:
    return [build_server(cfg, model_path, dtype=dtype, seed=seed, index=i, log_dir=log_dir) for i in range(cfg.num_servers)]


def fleet_configs(cfg: RolloutConfig) -> dict[str, RolloutConfig]:
    """The run's fleets by name: `main` from `cfg` itself, then each `rollout.fleets` entry
    (the main keys with the entry's changes)."""
    out = {DEFAULT_FLEET: dataclasses.replace(cfg, fleets=[])}
    for extra in cfg.fleets:
        changes = {k: v for k, v in extra.items() if k != "name"}
        out[extra["name"]] = dataclasses.replace(cfg, fleets=[], **changes)
    return out


async def _named_spawn(spawn: Callable[[], Any], name: str, timeout_s: float = 30.0) -> Any:
    """`spawn()`, waiting while Ray still holds the name for the dead actor it replaces (a detached run's
    servers keep their names; Ray frees one a moment after the death). A name still held after `timeout_s`
    (a loaded head slow to mark a replacement that died while starting dead) is a failed start, `ServerDied`,
    like the death itself: the restart tries again, and the run goes on with the other servers meanwhile."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        try:
            return spawn()
        except ValueError as exc:  # ray's ActorAlreadyExistsError is one
            if "already taken" not in str(exc):
                raise
            if asyncio.get_running_loop().time() > deadline:
                raise ServerDied(f"rollout server {name}: Ray still holds its actor name after {timeout_s:.0f} s "
                                 f"(the actor it replaces is not yet dead to Ray)") from exc
            await asyncio.sleep(0.1)


def _own_placement_name(detached: Any, fleet: str, index: int) -> str:
    return f"{detached.fleet_placement(fleet)}-{index}" if detached is not None else ""


class Fleet:
    """N servers of one backend. `restart(server)` (actor fleets) starts a fresh server in its place;
    `grow(k)` starts k more (`make`: a server at a new index), `detach`/`close_one` take one away
    (`FleetManager.resize`)."""

    def __init__(self, name: str, servers: list[RolloutServer],
                 respawn: Callable[[int], Awaitable[RolloutServer]] | None = None,
                 release: Callable[[], None] | None = None,
                 make: Callable[[int], Awaitable[RolloutServer]] | None = None,
                 release_one: Callable[[int], None] | None = None, indices: list[int] | None = None) -> None:
        self.name = name
        self.servers = list(servers)
        self.indices = list(indices) if indices is not None else list(range(len(self.servers)))
        """The index each server was started at (its name, seed and bundle), parallel to `servers`."""
        self._respawn = respawn
        self._release = release
        self._make = make
        self._release_one = release_one

    def index_of(self, server: RolloutServer) -> int:
        return self.indices[next(k for k, s in enumerate(self.servers) if s is server)]

    async def grow(self, k: int, on_up: Callable[[RolloutServer], None] | None = None
                   ) -> tuple[list[RolloutServer], list[BaseException]]:
        """Start `k` more servers (at the lowest free indices), each added to `servers` and told to
        `on_up` as it is up; returns (the new servers, the errors of those that could not be started)."""
        if self._make is None:
            raise RuntimeError(f"fleet {self.name}: this fleet cannot start more servers")
        free, taken, n = [], set(self.indices), 0
        while len(free) < k:
            if n not in taken:
                free.append(n)
            n += 1
        new: list[RolloutServer] = []
        errors: list[BaseException] = []

        async def one(i: int) -> None:
            try:
                got = await self._make(i)
            except Exception as exc:  # deliberate: reported to the caller, the others go on
                errors.append(exc)
                if self._release_one is not None:
                    self._release_one(i)
                return
            self.servers.append(got)
            self.indices.append(i)
            new.append(got)
            if on_up is not None:
                on_up(got)

        await asyncio.gather(*(one(i) for i in free))
        return new, errors

    def detach(self, server: RolloutServer) -> int:
        """Take `server` out of the fleet (it is no longer restarted or listed); returns its index."""
        k = next(k for k, s in enumerate(self.servers) if s is server)
        self.servers.pop(k)
        return self.indices.pop(k)

    async def close_one(self, server: RolloutServer, index: int) -> None:
        """Close a detached server and free what was reserved for it alone (a grown server's placement)."""
        try:
            await server.close()
        finally:
            if self._release_one is not None:
                self._release_one(index)

    @classmethod
    async def spawn(cls, name: str, cfg: RolloutConfig, model_path: str, *, dtype: str, seed: int,
                    spec: dict[str, Any] | None = None, placement_timeout_s: float = 300.0,
                    detached: Any = None, orphan_timeout_s: float = 300.0) -> "Fleet":
        """`cfg.num_servers` Ray actors in one placement group (one bundle each), models loaded;
        with `spec` (a `HostSpec` dict) each runs whole samples and joins the weight plane. `detached`
        (`orphan.DetachedNames`, `ray.detached`): the group and the actors are named after the run and
        outlive this process; where they already run (a controller that died), they are taken back. A resume that
        took at least one back returns with those alone (`FleetManager.spawn` starts the rest while the run goes
        on); one that found none starts them all and returns when they are up."""
        from asyncrl.orphan import Detached
        from asyncrl.rollout import server_actor as sa

        pg = None
        if detached is not None:
            pg = sa.find_placement(detached.fleet_placement(name))
        if pg is None:
            pg = sa.make_placement(cfg, cfg.num_servers, name=detached.fleet_placement(name) if detached else "")
        await sa.wait_placed(pg, placement_timeout_s)

        own: dict[int, Any] = {}
        """Servers started past the fleet's first `num_servers` (`grow`): each in a placement group of its own."""

        def placement_of(i: int) -> tuple[Any, int, str]:
            if i in own:
                return own[i], 0, _own_placement_name(detached, name, i)
            return pg, i, detached.fleet_placement(name) if detached else ""

        async def respawn(i: int) -> RolloutServer:
            """A fresh server in bundle i, started; one that dies while starting is replaced, up
            to `START_ATTEMPTS` times (a crash at load is as likely as one later)."""
            placement, bundle, pg_name = placement_of(i)
            for attempt in range(START_ATTEMPTS):
                named = Detached(detached.server(name, i), pg_name, orphan_timeout_s) if detached else None
                server = None
                try:
                    server = await _named_spawn(lambda: sa.spawn_server(cfg, model_path, dtype=dtype, seed=seed, index=i, placement=placement,
                                                                        bundle=bundle, name=f"{name}-{i}", spec=spec, detached=named),
                                                f"{name}-{i}")
                    return await server.ready()
                except ServerDied:
                    if server is not None:
                        await server.close()
                    if attempt == START_ATTEMPTS - 1:
                        raise
            raise AssertionError("unreachable")

        async def take_back(i: int, handle: Any) -> RolloutServer | None:
            """A detached run's server that still runs (its work given up, its plane emptied when the queue
            died with the controller); None if it died or does not answer."""
            server = sa.RemoteServer(handle, f"{name}-{i}", control_timeout_s=cfg.health_timeout_s)
            try:
                return await server.reattach(wipe_plane=(spec or {}).get("queue", {}).get("metadata", "memory") == "memory")
            except ServerDied:
                await server.close()
                return None

        async def make(i: int) -> RolloutServer:
            """A server at index i: in its bundle of the fleet's group while i < `num_servers` (a slot a
            shrink freed), else in a one-bundle group of its own (placed where Ray finds room: a node
            that just joined the cluster), removed with it."""
            t0 = time.monotonic()
            if i >= cfg.num_servers and i not in own:
                own[i] = sa.make_placement(cfg, 1, name=_own_placement_name(detached, name, i))
                await sa.wait_placed(own[i], placement_timeout_s)
            placed_s = time.monotonic() - t0
            server = await respawn(i)
            server.startup = {"placement_s": round(placed_s, 3), **getattr(server, "startup", {})}
            return server

        def release_one(i: int) -> None:
            if i in own:
                sa.remove_placement(own.pop(i))

        def release() -> None:
            sa.remove_placement(pg)
            for i in list(own):
                release_one(i)

        found = [(i, h) for i in range(cfg.num_servers) if detached is not None and (h := sa.find_server(detached, name, i)) is not None]
        kept = await asyncio.gather(*(take_back(i, h) for i, h in found))
        back = [(i, s) for (i, _), s in zip(found, kept) if s is not None]
        if back:  # a resume that took servers back: it goes on with them; the others start meanwhile (FleetManager.spawn)
            return cls(name, [s for _, s in back], respawn, release, make=make, release_one=release_one, indices=[i for i, _ in back])
        servers = await asyncio.gather(*(respawn(i) for i in range(cfg.num_servers)))
        return cls(name, list(servers), respawn, release, make=make, release_one=release_one)

    async def restart(self, server: RolloutServer) -> RolloutServer:
        """Replace a dead server by a fresh one in its place (same bundle, same seed)."""
        if self._respawn is None:
            raise RuntimeError(f"fleet {self.name}: local servers cannot be restarted")
        fresh = await self._respawn(self.index_of(server))
        k = next((k for k, s in enumerate(self.servers) if s is server), None)
        if k is None:  # detached meanwhile (a shrink): not ours to start
            await fresh.close()
            raise LookupError(f"fleet {self.name}: {getattr(server, 'name', server)} was taken away while its replacement started")
        self.servers[k] = fresh
        return fresh

    async def close(self) -> None:
        await asyncio.gather(*(s.close() for s in self.servers))
        if self._release is not None:
            self._release()
