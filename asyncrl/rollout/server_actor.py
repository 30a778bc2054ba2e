"""Ray shell of a rollout server: `ServerActor` holds one `RolloutServer`; `ActorServer` is its
client-side proxy, itself a `RolloutServer`, so the `Router` serves local servers and actors alike.

Job: place servers (one placement-group bundle per server: CPUs, plus `tensor_parallel_size`
GPUs when `rollout.gpu_bundles`), forward the verbs, and turn "the actor is gone" into the
router's `ServerDied`. In the pipeline each actor holds a `ServerHost`: whole samples run in
the actor (AgentLoop, reward, the trajectory written once into the actor's own data plane) and
only the queue record (metadata and handles, msgpack bytes) comes back; weights arrive through
the actor's own `Receiver` on the weight plane (`join_weights`), so neither trajectory tensors
nor weights ever cross Ray or the controller. (name, tensor) pairs through Ray's object store
(`update_weights`) remain for small models in tests.
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

from asyncrl.config import CostModelConfig, RolloutConfig
from asyncrl.rollout.base import GenerateOutput, PauseMode, RolloutServer, SamplingParams, ServerStats
from asyncrl.rollout.router import ServerDied


class ServerActor:
    """The actor body (wrapped by `ray.remote` in `spawn_server`): one server and its `ServerHost`.

    With a `spec` (what the pipeline passes: `HostSpec` as a dict) the actor runs whole samples
    (`run_sample`, `run_eval`: AgentLoops, rewards and the write into its own data plane happen
    here); without one it serves `generate` only (tests, benchmarks). Either way it loads weights
    from the weight plane once it joined it (`join_weights`)."""

    def __init__(self, cfg: dict[str, Any], model_path: str, dtype: str, seed: int, index: int,
                 name: str = "", spec: dict[str, Any] | None = None) -> None:
        cfg = dict(cfg, cost_model=CostModelConfig(**cfg["cost_model"]))
        self._args = (RolloutConfig(**cfg), model_path, dtype, seed, index)
        self.name, self.spec = name or f"server-{index}", spec
        self.server: RolloutServer | None = None
        self.host: Any = None
        self.plane: Any = None

    async def start(self) -> int:
        """Build the engine on the actor's event loop (vLLM's AsyncLLM wants one); returns its version."""
        from asyncrl.rollout.fleet_build import build_server

        cfg, model_path, dtype, seed, index = self._args
        self.server = build_server(cfg, model_path, dtype=dtype, seed=seed, index=index,
                                   log_dir=(self.spec or {}).get("log_dir") or None)
        if self.spec is not None:
            from asyncrl.rollout.host_spec import build_host

            self.host, self.plane = build_host(self.server, self.name, self.spec, model_path)
        else:  # a bare server: the weight plane, no samples
            from asyncrl.rollout.host import ServerHost

            self.host = ServerHost(self.server, name=self.name, agent=None, eval_agent=None, plane=None)
        return self.server.version

    async def run_sample(self, sample: bytes) -> bytes:
        from asyncrl.rollout.host_spec import decode_sample, encode_record

        return encode_record(await self.host.run_sample(decode_sample(sample)))

    async def run_eval(self, sample: bytes) -> dict[str, Any]:
        from asyncrl.rollout.host_spec import decode_sample

        return await self.host.run_eval(decode_sample(sample))

    async def join_weights(self, weight_sync_config: dict[str, Any], endpoints: list[str], pause_mode: PauseMode = "keep") -> None:
        from checkpoint_engine import WeightSyncConfig

        await self.host.join_weights(WeightSyncConfig(**weight_sync_config), endpoints, pause_mode)

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams, request_id: str | None = None) -> GenerateOutput:
        return await self.server.generate(prompt_ids, sampling, request_id)

    async def pause(self, mode: PauseMode = "wait") -> None:
        await self.server.pause(mode)

    async def resume(self) -> None:
        await self.server.resume()

    async def update_weights_named(self, named_tensors: list[tuple[str, Any]], version: int) -> int:
        await self.server.update_weights(named_tensors, version)
        return self.server.version

    async def reset_prefix_cache(self) -> None:
        await self.server.reset_prefix_cache()

    async def stats(self) -> ServerStats:
        return self.server.stats()

    async def health(self) -> bool:
        return self.server is not None and self.server.stats().healthy

    async def pid(self) -> int:
        import os

        return os.getpid()

    async def close(self) -> None:
        if self.host is not None:
            await self.host.close()
        if self.plane is not None:
            self.plane.close()


class ActorServer(RolloutServer):
    """Client-side proxy of a `ServerActor`. `stats()` and `version` are synchronous in the
    interface, so they answer from what this proxy saw last (its own in-flight count, the last
    `refresh()`); `FleetManager.stats()` refreshes first."""

    def __init__(self, handle: Any, name: str, control_timeout_s: float = 60.0) -> None:
        self.handle = handle
        self.name = name
        self.control_timeout_s = control_timeout_s
        """A control verb (stats, resume, join, close) unanswered this long means a hung server: `ServerDied`."""
        self._closed = False
        self._in_flight = 0
        self._stats = ServerStats(version=0, in_flight=0, paused=False, generated_tokens=0, tokens_per_s=0.0)
        self._dead = False
        self.record_bytes = 0
        """Bytes of the queue records this proxy received from the actor (`run_sample` replies)."""

    async def _call(self, verb: str, *args: Any) -> Any:
        """Samples and generation may take as long as they take; a control verb that is not
        answered within `control_timeout_s` is a hung server (the caller kills it via `close`)."""
        ref = getattr(self.handle, verb).remote(*args)
        try:
            if verb in _CONTROL_VERBS:
                async with asyncio.timeout(self.control_timeout_s):  # not wait_for: on 3.11 it can swallow a cancel
                    return await ref
            return await ref
        except asyncio.TimeoutError:
            raise ServerDied(f"rollout server {self.name} is hung: no answer to {verb} in {self.control_timeout_s} s "
                             f"(rollout.health_timeout_s)") from None
        except RayActorError as exc:  # translated: the router fails over on ServerDied
            self._dead = True
            raise ServerDied(f"rollout server {self.name} died during {verb}: {type(exc).__name__}") from exc

    async def probe(self) -> None:
        """Raise `ServerDied` if the actor is dead or does not answer within `control_timeout_s`."""
        self._stats = await self._call("stats")

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
        """(name, tensor) pairs through Ray's object store: small models and tests only; the
        pipeline loads weights through the weight plane (`join_weights`)."""
        got = await self._call("update_weights_named", list(named_tensors), version)
        self._stats = dataclasses.replace(self._stats, version=got)

    async def run_sample(self, sample: Any) -> Any:
        """The actor's host runs the whole sample; returns its queue record (`SampleMeta`)."""
        from asyncrl.rollout.host_spec import decode_record, encode_sample

        data = await self._call("run_sample", encode_sample(sample))
        self.record_bytes += len(data)
        return decode_record(data)

    async def run_eval(self, sample: Any) -> dict[str, Any]:
        from asyncrl.rollout.host_spec import encode_sample

        return await self._call("run_eval", encode_sample(sample))

    async def join_weights(self, cfg: Any, endpoints: list[str] | str, pause_mode: PauseMode = "keep") -> None:
        await self._call("join_weights", dataclasses.asdict(cfg), [endpoints] if isinstance(endpoints, str) else list(endpoints),
                         pause_mode)

    def loaded(self, version: int) -> None:
        """The weight plane reported that this server loaded `version`."""
        self._stats = dataclasses.replace(self._stats, version=version)

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
        """Close the server (a hung one is not waited for past `control_timeout_s`), then kill the
        actor: its calls in flight fail at once, so their samples move to other servers."""
        if self._closed:
            return
        self._closed = True
        if not self._dead:
            try:
                await self._call("close")
            except ServerDied:  # deliberate: already gone (or hung) is closed by the kill below
                pass
        if not self._dead:
            ray.kill(self.handle, no_restart=True)
        self._dead = True


_CONTROL_VERBS = frozenset({"stats", "resume", "join_weights", "close", "reset_prefix_cache", "pid"})
"""Verbs that answer at once on a healthy server (`start` loads the model, `pause` may drain, samples generate: no limit)."""


def make_placement(cfg: RolloutConfig, num_servers: int) -> PlacementGroup:
    """One bundle per server: `cpus_per_server` CPUs (+ `tensor_parallel_size * gpus_per_worker`
    GPUs with `gpu_bundles`, + `ray_resources`: custom resources that pick the nodes)."""
    bundle: dict[str, float] = {"CPU": cfg.cpus_per_server, **cfg.ray_resources}
    if cfg.gpu_bundles:
        bundle["GPU"] = cfg.tensor_parallel_size * cfg.gpus_per_worker
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
                 placement: PlacementGroup, bundle: int | None = None, name: str = "",
                 spec: dict[str, Any] | None = None) -> ActorServer:
    """Start one `ServerActor` in `placement`'s bundle `bundle` (default `index`); await `.ready()`.
    `spec` (a `HostSpec` as a dict) makes it run whole samples and join the weight plane."""
    gpus = cfg.tensor_parallel_size * cfg.gpus_per_worker if cfg.gpu_bundles else 0
    actor_cls = ray.remote(num_cpus=cfg.cpus_per_server, num_gpus=gpus, max_restarts=0)(ServerActor)
    strategy = PlacementGroupSchedulingStrategy(placement, placement_group_bundle_index=index if bundle is None else bundle)
    name = name or f"server-{index}"
    handle = actor_cls.options(scheduling_strategy=strategy, max_concurrency=1000).remote(
        dataclasses.asdict(cfg), str(model_path), dtype, seed, index, name, spec)
    return ActorServer(handle, name, control_timeout_s=cfg.health_timeout_s)


def kill(server: ActorServer) -> None:
    """Kill the actor at once (tests of failover; the fleet's `remove` drains instead)."""
    ray.kill(server.handle, no_restart=True)
