"""Rollout fleets: the servers that serve one run, grouped, placed, restarted and synced.

Job: `build_server` is the one place that knows the backends. A `Fleet` is N servers of one
backend and one sampling setup, either local (`build_fleet`: in this process, the embedded
default) or Ray actors in one placement group (`Fleet.spawn`). The `FleetManager` owns every
fleet of a run and the rejoin rule: it adds and drains fleets while requests run, pushes weight
updates (remembering the current version), and restarts a server the router found dead, giving
it the current weights before it takes a request again.
Boundary: routing lives in router.py, the Ray shell in server_actor.py (imported only when a
fleet of actors is spawned, so this module stays importable without Ray).
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, Awaitable, Callable, Iterable

from asyncrl.config import RolloutConfig
from asyncrl.rollout.base import PauseMode, RolloutServer
from asyncrl.rollout.router import DEFAULT_FLEET, Router, ServerDied

SyncFn = Callable[[RolloutServer], Awaitable[None]]


def build_server(cfg: RolloutConfig, model_path: str, *, dtype: str, seed: int, index: int = 0) -> RolloutServer:
    if cfg.backend == "torch":
        from asyncrl.rollout.torch_engine import TorchRolloutServer

        return TorchRolloutServer(
            model_path,
            dtype=dtype,
            max_batch_size=cfg.max_batch_size,
            seed=seed + index,
            threads=cfg.torch_threads,
            prefix_cache_size=cfg.prefix_cache_size,
        )
    if cfg.backend == "vllm":
        from asyncrl.rollout.vllm_engine import VLLMRolloutServer

        return VLLMRolloutServer(
            model_path,
            dtype=dtype,
            seed=seed + index,
            enforce_eager=cfg.enforce_eager,
            gpu_memory_utilization=cfg.gpu_memory_utilization,
            cpu_kv_cache_gb=cfg.cpu_kv_cache_gb,
            tensor_parallel_size=cfg.tensor_parallel_size,
        )
    raise ValueError(f"rollout.backend: unknown backend {cfg.backend!r}")


def build_fleet(cfg: RolloutConfig, model_path: str, *, dtype: str, seed: int) -> list[RolloutServer]:
    return [build_server(cfg, model_path, dtype=dtype, seed=seed, index=i) for i in range(cfg.num_servers)]


def fleet_configs(cfg: RolloutConfig) -> dict[str, RolloutConfig]:
    """The run's fleets by name: `main` from `cfg` itself, then each `rollout.fleets` entry
    (the main keys with the entry's changes)."""
    out = {DEFAULT_FLEET: dataclasses.replace(cfg, fleets=[])}
    for extra in cfg.fleets:
        changes = {k: v for k, v in extra.items() if k != "name"}
        out[extra["name"]] = dataclasses.replace(cfg, fleets=[], **changes)
    return out


class Fleet:
    """N servers of one backend. `respawn(i)` (actor fleets) starts a fresh server in bundle i."""

    def __init__(self, name: str, servers: list[RolloutServer],
                 respawn: Callable[[int], Awaitable[RolloutServer]] | None = None,
                 release: Callable[[], None] | None = None) -> None:
        self.name = name
        self.servers = list(servers)
        self._respawn = respawn
        self._release = release

    @classmethod
    async def spawn(cls, name: str, cfg: RolloutConfig, model_path: str, *, dtype: str, seed: int,
                    placement_timeout_s: float = 300.0) -> "Fleet":
        """`cfg.num_servers` Ray actors in one placement group (one bundle each), models loaded."""
        from asyncrl.rollout import server_actor as sa

        pg = sa.make_placement(cfg, cfg.num_servers)
        await sa.wait_placed(pg, placement_timeout_s)

        async def respawn(i: int) -> RolloutServer:
            server = sa.spawn_server(cfg, model_path, dtype=dtype, seed=seed, index=i, placement=pg, name=f"{name}-{i}")
            return await server.ready()

        servers = await asyncio.gather(*(respawn(i) for i in range(cfg.num_servers)))
        return cls(name, list(servers), respawn, lambda: sa.remove_placement(pg))

    async def restart(self, server: RolloutServer) -> RolloutServer:
        """Replace a dead server by a fresh one in its place (same bundle, same seed)."""
        if self._respawn is None:
            raise RuntimeError(f"fleet {self.name}: local servers cannot be restarted")
        i = self.servers.index(server)
        fresh = await self._respawn(i)
        self.servers[i] = fresh
        return fresh

    async def close(self) -> None:
        await asyncio.gather(*(s.close() for s in self.servers))
        if self._release is not None:
            self._release()


class FleetManager:
    """Owner of the rejoin rule: a server takes requests only at the current version.

    Trace: fleets main (s0, s1) at v0; update_weights(v1) -> both at v1; s1's actor dies
    mid-request -> router takes s1 out, on_dead -> restart: fresh s1' at v0 -> sync(s1')
    (the last named weights, or the `sync` callback, e.g. the weight plane) -> v1 == current
    -> router.add(s1') -> s1' takes requests. add_fleet(f) syncs f the same way first;
    remove_fleet(f) drains f's servers (their requests finish) before closing them.

        manager = FleetManager(Router(), sync=None)
        await manager.add_fleet(await Fleet.spawn("main", cfg, path, dtype="float32", seed=0))
        out = await manager.router.generate(prompt_ids, sampling)
    """

    def __init__(self, router: Router | None = None, *, sync: SyncFn | None = None, version: int = 0,
                 restart_dead: bool = True) -> None:
        self.router = router if router is not None else Router()
        self.router.on_dead = self._on_dead
        self.fleets: dict[str, Fleet] = {}
        self.version = version
        """The version every server that takes requests holds."""
        self._sync = sync
        self._last_named: list[tuple[str, Any]] | None = None
        self.restart_dead = restart_dead
        self.restarts = 0
        self._tasks: set[asyncio.Task] = set()
        self._error: BaseException | None = None

    @classmethod
    async def spawn(cls, cfg: RolloutConfig, model_path: str, *, dtype: str, seed: int,
                    sync: SyncFn | None = None, router: Router | None = None) -> "FleetManager":
        """Every fleet of `cfg` (`main` + `rollout.fleets`) as Ray actors, behind one router (built
        from the rollout keys unless given). Fleet k's servers draw seeds from `seed + 1000 * k + index`."""
        if router is None:
            router = Router(max_failovers=cfg.max_failovers, partial_rollouts=cfg.partial_rollouts)
        manager = cls(router, sync=sync, restart_dead=cfg.restart_dead_servers)
        named = list(fleet_configs(cfg).items())
        fleets = await asyncio.gather(*(Fleet.spawn(name, c, model_path, dtype=dtype, seed=seed + 1000 * k)
                                        for k, (name, c) in enumerate(named)))
        for fleet in fleets:
            await manager.add_fleet(fleet)
        return manager

    def _check(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"fleet manager: a server restart failed: {self._error!r}") from self._error

    async def add_fleet(self, fleet: Fleet) -> None:
        """Sync `fleet`'s servers to the current version, then route requests to them."""
        self._check()
        if fleet.name in self.fleets:
            raise ValueError(f"fleet {fleet.name!r} already serves this run")
        self.fleets[fleet.name] = fleet
        await asyncio.gather(*(self._bring_current(s) for s in fleet.servers))
        for s in fleet.servers:
            self.router.add(s, fleet.name)

    async def remove_fleet(self, name: str) -> Fleet:
        """Stop routing to the fleet, wait for its requests to finish, close its servers."""
        fleet = self.fleets.pop(name)
        await asyncio.gather(*(self.router.drain(s) for s in fleet.servers if s in self.router.servers))
        await fleet.close()
        return fleet

    async def update_weights(self, named_tensors: Iterable[tuple[str, Any]], version: int,
                             pause_mode: PauseMode = "abort") -> None:
        """pause(mode) -> load -> resume on every routed server (small models: the pairs travel to
        each server); they are kept to sync servers that (re)join later."""
        named = list(named_tensors)

        async def one(s: RolloutServer) -> None:
            try:
                await s.pause(pause_mode)
                try:
                    await s.update_weights(named, version)
                finally:
                    await s.resume()
            except ServerDied as exc:  # translated: a death is the router's failover (restart syncs it)
                self.router.take_out(s, exc)

        self._last_named, self.version = named, version  # first: a server rejoining meanwhile syncs to it
        await asyncio.gather(*(one(s) for s in self.router.servers))

    def set_version(self, version: int) -> None:
        """Record that the routed servers now hold `version` (pushed by the weight plane)."""
        self.version = version

    async def _bring_current(self, server: RolloutServer) -> None:
        if server.version >= self.version:
            return
        if self._sync is not None:
            await self._sync(server)
        elif self._last_named is not None:
            await server.update_weights(self._last_named, self.version)
        if server.version != self.version:
            raise RuntimeError(f"rejoin: server holds version {server.version} after sync, the fleet serves {self.version}")

    def _on_dead(self, server: RolloutServer, cause: ServerDied) -> None:
        if not self.restart_dead:
            return
        task = asyncio.get_running_loop().create_task(self.restart(server))
        self._tasks.add(task)
        task.add_done_callback(self._restart_done)

    def _restart_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None and self._error is None:
            self._error = task.exception()

    async def restart(self, server: RolloutServer) -> RolloutServer:
        """Start a replacement for a dead server, sync it to the current version, route to it."""
        fleet = next(f for f in self.fleets.values() if server in f.servers)
        fresh = await fleet.restart(server)
        await self._bring_current(fresh)
        if fleet.name in self.fleets:  # the fleet may have been removed meanwhile
            self.router.add(fresh, fleet.name)
        self.restarts += 1
        return fresh

    async def wait_restarts(self) -> None:
        """Wait for restarts in progress (raises the first that failed)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
        self._check()

    async def stats(self) -> dict[str, Any]:
        """Per fleet and per server: health, in-flight, version, tokens/s; plus totals."""
        self._check()
        fleets: dict[str, Any] = {}
        for name, fleet in self.fleets.items():
            rows = []
            for s in fleet.servers:
                st = await s.refresh() if hasattr(s, "refresh") else s.stats()
                rows.append({"name": getattr(s, "name", f"{name}-{len(rows)}"), "healthy": st.healthy,
                             "routed": s in self.router.servers, "in_flight": st.in_flight, "version": st.version,
                             "paused": st.paused, "tokens_per_s": st.tokens_per_s, "generated_tokens": st.generated_tokens})
            fleets[name] = {
                "servers": rows, "healthy": sum(r["healthy"] for r in rows),
                "in_flight": sum(r["in_flight"] for r in rows), "tokens_per_s": sum(r["tokens_per_s"] for r in rows),
            }
        return {"version": self.version, "fleets": fleets, "restarts": self.restarts,
                "failovers": self.router.failovers, "resubmits": self.router.resubmits}

    async def close(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*(f.close() for f in self.fleets.values()))
        self.fleets.clear()
