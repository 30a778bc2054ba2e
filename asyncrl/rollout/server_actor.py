"""Ray shell of a rollout server: `ServerActor` holds one `RolloutServer`; `ActorServer` is its
client-side proxy, itself a `RolloutServer`, so the `Router` serves local servers and actors alike.

Job: place servers (one placement-group bundle per server: CPUs, plus `tensor_parallel_size` GPUs
when `rollout.gpu_bundles`), forward the interface's verbs, and turn "the actor is gone" into the
router's `ServerDied`. Weights reach an actor either as (name, tensor) pairs through Ray's object
store (`update_weights_named`: small models, tests) or from the weight plane: the actor joins the
checkpoint engine as a `Receiver` once and loads each next update in its own process
(`update_weights_from`), so big models never cross Ray.
Boundary: no routing, no restart policy (fleet.py), no engine logic (torch_engine / vllm_engine).
This and launch code are the only rollout modules that import ray.

    pg = make_placement(cfg, num_servers=2)
    servers = [spawn_server(cfg, path, dtype="float32", seed=0, index=i, placement=pg) for i in range(2)]
    await asyncio.gather(*(s.ready() for s in servers))
    out = await servers[0].generate([5, 6], SamplingParams(max_tokens=8))
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, Iterable

import ray
from ray.exceptions import RayActorError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from asyncrl.config import RolloutConfig
from asyncrl.rollout.base import GenerateOutput, PauseMode, RolloutServer, SamplingParams, ServerStats
from asyncrl.rollout.router import ServerDied


class ServerActor:
    """The actor body (wrapped by `ray.remote` in `spawn_server`): one server, the same verbs, async."""

    def __init__(self, cfg: dict[str, Any], model_path: str, dtype: str, seed: int, index: int) -> None:
        self._args = (RolloutConfig(**cfg), model_path, dtype, seed, index)
        self.server: RolloutServer | None = None
        self._receiver: Any = None

    async def start(self) -> int:
        """Build the engine on the actor's event loop (vLLM's AsyncLLM wants one); returns its version."""
        from asyncrl.rollout.fleet import build_server

        cfg, model_path, dtype, seed, index = self._args
        self.server = build_server(cfg, model_path, dtype=dtype, seed=seed, index=index)
        return self.server.version

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams, request_id: str | None = None) -> GenerateOutput:
        return await self.server.generate(prompt_ids, sampling, request_id)

    async def pause(self, mode: PauseMode = "wait") -> None:
        await self.server.pause(mode)

    async def resume(self) -> None:
        await self.server.resume()

    async def update_weights_named(self, named_tensors: list[tuple[str, Any]], version: int) -> int:
        await self.server.update_weights(named_tensors, version)
        return self.server.version

    async def update_weights_from(self, weight_sync_config: dict[str, Any], sender_endpoint: str,
                                  receiver_id: str, pause_mode: PauseMode | None = "abort", timeout_s: float | None = None) -> int:
        """Join the weight plane (first call only) and load its next update: pause(mode), stream the
        buckets into `update_weights`, resume (`pause_mode=None`: the caller pauses and resumes).
        Returns the version now served."""
        from checkpoint_engine import Receiver, WeightSyncConfig
        from checkpoint_engine.server_loop import apply_update

        if self._receiver is None:
            cfg = WeightSyncConfig(**weight_sync_config)
            self._receiver = Receiver(cfg, receiver_id, endpoint=sender_endpoint, version=self.server.version)
        update = await asyncio.to_thread(self._receiver.next_update, timeout_s)
        if pause_mode is None:
            await self.server.update_weights(update, update.version)
            return update.version
        return await apply_update(self.server, update, pause_mode)

    async def reset_prefix_cache(self) -> None:
        await self.server.reset_prefix_cache()

    async def stats(self) -> ServerStats:
        return self.server.stats()

    async def health(self) -> bool:
        return self.server is not None and self.server.stats().healthy

    async def close(self) -> None:
        if self._receiver is not None:
            self._receiver.close()
        if self.server is not None:
            await self.server.close()


class ActorServer(RolloutServer):
    """Client-side proxy of a `ServerActor`. `stats()` and `version` are synchronous in the
    interface, so they answer from what this proxy saw last (its own in-flight count, the last
    `refresh()`); `FleetManager.stats()` refreshes first."""

    def __init__(self, handle: Any, name: str) -> None:
        self.handle = handle
        self.name = name
        self._in_flight = 0
        self._stats = ServerStats(version=0, in_flight=0, paused=False, generated_tokens=0, tokens_per_s=0.0)
        self._dead = False

    async def _call(self, verb: str, *args: Any) -> Any:
        try:
            return await getattr(self.handle, verb).remote(*args)
        except RayActorError as exc:  # translated: the router fails over on ServerDied
            self._dead = True
            raise ServerDied(f"rollout server {self.name} died during {verb}: {type(exc).__name__}") from exc

    async def ready(self) -> "ActorServer":
        """Wait until the engine is built (model loaded)."""
        version = await self._call("start")
        self._stats = dataclasses.replace(self._stats, version=version)
        return self

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams, request_id: str | None = None) -> GenerateOutput:
        self._in_flight += 1
        try:
            return await self._call("generate", list(prompt_ids), sampling, request_id)
        finally:
            self._in_flight -= 1

    async def pause(self, mode: PauseMode = "wait") -> None:
        await self._call("pause", mode)

    async def resume(self) -> None:
        await self._call("resume")

    async def update_weights(self, named_tensors: Iterable[tuple[str, Any]], version: int) -> None:
        got = await self._call("update_weights_named", list(named_tensors), version)
        self._stats = dataclasses.replace(self._stats, version=got)

    async def update_weights_from(self, weight_sync_config: dict[str, Any], sender_endpoint: str,
                                  receiver_id: str, pause_mode: PauseMode | None = "abort", timeout_s: float | None = None) -> int:
        got = await self._call("update_weights_from", weight_sync_config, sender_endpoint, receiver_id, pause_mode, timeout_s)
        self._stats = dataclasses.replace(self._stats, version=got)
        return got

    async def reset_prefix_cache(self) -> None:
        await self._call("reset_prefix_cache")

    async def refresh(self) -> ServerStats:
        """Fetch the actor's stats (a dead actor reads as unhealthy instead of raising)."""
        if not self._dead:
            try:
                self._stats = await self._call("stats")
            except ServerDied:  # deliberate: stats report the death, the router acts on it
                pass
        return self.stats()

    def stats(self) -> ServerStats:
        return dataclasses.replace(self._stats, in_flight=self._in_flight, healthy=self._stats.healthy and not self._dead)

    @property
    def version(self) -> int:
        return self._stats.version

    async def close(self) -> None:
        if not self._dead:
            try:
                await self._call("close")
            except ServerDied:  # deliberate: already gone is closed
                pass
            ray.kill(self.handle, no_restart=True)
        self._dead = True


def make_placement(cfg: RolloutConfig, num_servers: int) -> PlacementGroup:
    """One bundle per server: `cpus_per_server` CPUs (+ `tensor_parallel_size` GPUs with `gpu_bundles`)."""
    bundle: dict[str, float] = {"CPU": cfg.cpus_per_server}
    if cfg.gpu_bundles:
        bundle["GPU"] = cfg.tensor_parallel_size
    return placement_group([dict(bundle) for _ in range(num_servers)], strategy=cfg.placement_strategy)


async def wait_placed(pg: PlacementGroup, timeout_s: float = 300.0) -> None:
    """Wait until Ray reserved every bundle (raises TimeoutError with what was asked)."""
    try:
        await asyncio.wait_for(pg.ready(), timeout_s)
    except asyncio.TimeoutError:
        raise TimeoutError(f"placement group of {pg.bundle_specs} not placed in {timeout_s} s") from None


def remove_placement(pg: PlacementGroup) -> None:
    remove_placement_group(pg)


def spawn_server(cfg: RolloutConfig, model_path: str, *, dtype: str, seed: int, index: int,
                 placement: PlacementGroup, bundle: int | None = None, name: str = "") -> ActorServer:
    """Start one `ServerActor` in `placement`'s bundle `bundle` (default `index`); await `.ready()`."""
    gpus = cfg.tensor_parallel_size if cfg.gpu_bundles else 0
    actor_cls = ray.remote(num_cpus=cfg.cpus_per_server, num_gpus=gpus, max_restarts=0)(ServerActor)
    strategy = PlacementGroupSchedulingStrategy(placement, placement_group_bundle_index=index if bundle is None else bundle)
    handle = actor_cls.options(scheduling_strategy=strategy, max_concurrency=1000).remote(
        dataclasses.asdict(cfg), str(model_path), dtype, seed, index)
    return ActorServer(handle, name or f"server-{index}")


def kill(server: ActorServer) -> None:
    """Kill the actor at once (tests of failover; the fleet's `remove` drains instead)."""
    ray.kill(server.handle, no_restart=True)
