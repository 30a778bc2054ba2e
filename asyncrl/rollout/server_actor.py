"""Ray shell of a rollout server: `ServerActor` is the actor body that holds one `RolloutServer`;
its client-side proxy is `RemoteServer` (remote_server.py), itself a `RolloutServer`, so the
`Router` serves local servers and actors alike.

Job: place servers (one placement-group bundle per server: CPUs, plus `tensor_parallel_size`
GPUs when `rollout.gpu_bundles`), carry the verbs across the process boundary, and turn "the
actor is gone" into the router's `ServerDied`. The `RolloutServer` verbs pass through to the
actor's `ServerHost` as they are (`_to_host`): the host is the one place they are forwarded to the
engine; the actor's own methods are what only an actor does (start, health, reattach) and the
msgpack wire forms of the pipeline's verbs. In the pipeline each actor holds a `ServerHost`: whole samples run in
the actor (AgentLoop, reward, the trajectory written once into the actor's own data plane) and
only the queue record (metadata and handles, msgpack bytes) comes back; weights arrive through
the actor's own `Receiver` on the weight plane (`join_weights`), so neither trajectory tensors
nor weights ever cross Ray or the controller. (name, tensor) pairs through Ray's object store
(`update_weights`) remain for small models in tests.
Boundary: no routing, no restart policy (fleet_health.py), no engine logic (`asyncrl/engines/`),
no backend choice (`asyncrl/engines/backends.py` builds the server). This, remote_server.py and launch code are the only rollout modules that import ray.

    pg = make_placement(cfg, num_servers=2)
    servers = [spawn_server(cfg, path, dtype="float32", seed=0, index=i, placement=pg) for i in range(2)]
    await asyncio.gather(*(s.ready() for s in servers))
    out = await servers[0].generate([5, 6], SamplingParams(max_tokens=8))
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import time
from typing import Any, Awaitable, Callable, Iterator

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from asyncrl.config import CostModelConfig, RolloutConfig
from asyncrl.hosts import on_node
from asyncrl.orphan import NAMESPACE, Detached, DetachedNames, OrphanWatch, watched
from asyncrl.engines.backends import build_server
from asyncrl.engines.base import PauseMode, RolloutServer, ServerStats
from asyncrl.rollout.remote_server import RemoteServer


def _to_host(verb: str) -> Callable[..., Awaitable[Any]]:
    """The actor verb `verb`: the host's method of that name, called as it is (a synchronous one too,
    e.g. `stats`), so the `RolloutServer` interface is forwarded to the engine in one place only
    (`ServerHost`). Assigned in the class body, so that `watched` wraps it like any other verb."""

    async def call(self: ServerActor, *args: Any) -> Any:
        out = getattr(self.host, verb)(*args)
        return await out if inspect.isawaitable(out) else out

    call.__name__, call.__qualname__ = verb, f"ServerActor.{verb}"
    return call


@watched
class ServerActor:
    """The actor body (wrapped by `ray.remote` in `spawn_server`): one server and its `ServerHost`.

    With a `spec` (what the pipeline passes: `HostSpec` as a dict) the actor runs whole samples
    (`run_sample`, `run_eval`: AgentLoops, rewards and the write into its own data plane happen
    here); without one it serves `generate` only (tests, benchmarks). Either way it loads weights
    from the weight plane once it joined it (`join_weights`). In a detached run (`ray.detached`) it
    outlives the controller, watches for one (`asyncrl/orphan.py`) and is taken back by `reattach`."""

    def __init__(self, cfg: dict[str, Any], model_path: str, dtype: str, seed: int, index: int,
                 name: str = "", spec: dict[str, Any] | None = None, detached: dict[str, Any] | None = None) -> None:
        self._times = {"init_at": time.time(), "process_at": _process_started()}
        """Wall times of this process's start, this body's construction and the engine's build (`start`)."""
        from asyncrl.malloc import fixed_mmap_threshold

        fixed_mmap_threshold()  # a model's process (asyncrl/malloc.py)
        self.sockets = on_node(ray.util.get_node_ip_address(), ray.get_runtime_context().gcs_address.rsplit(":", 1)[0])
        """`GLOO_SOCKET_IFNAME` / `NCCL_SOCKET_IFNAME` in force here (`asyncrl/hosts.py`)."""
        cfg = dict(cfg, cost_model=CostModelConfig(**cfg["cost_model"]))
        self._args = (RolloutConfig(**cfg), model_path, dtype, seed, index)
        self.name, self.spec = name or f"server-{index}", spec
        self.server: RolloutServer | None = None
        self.host: Any = None
        self.plane: Any = None
        self._built: asyncio.Future | None = None
        """The engine's build (`start`), begun once."""
        self._samples: set[asyncio.Task] = set()
        """The tasks of the samples running here (what `reattach` gives up)."""
        self.watch: OrphanWatch | None = None
        if detached is not None:
            d = Detached(**detached)
            self.watch = OrphanWatch(d.orphan_timeout_s, lambda: _orphaned(self, d.placement))

    async def start(self) -> tuple[int, int, str, dict[str, float]]:
        """Build the engine on the actor's event loop (vLLM's AsyncLLM wants one), once (a second call
        waits for the first); returns its version, this process's pid and node address (what lets the
        driver kill a hung one at once), and the wall times of its start-up (`process_at`, `init_at`,
        `built_at`: what `RemoteServer.startup` splits a start's seconds by) with the interface its
        sockets use (`ifname`)."""
        if self._built is None:
            self._built = asyncio.ensure_future(self._build())
        await asyncio.shield(self._built)
        import os

        return self.server.version, os.getpid(), ray.util.get_node_ip_address(), dict(self._times, reply_at=time.time(), ifname=self.sockets)

    async def _build(self) -> None:
        cfg, model_path, dtype, seed, index = self._args
        self.server = build_server(cfg, model_path, dtype=dtype, seed=seed, index=index,
                                   log_dir=(self.spec or {}).get("log_dir") or None)
        if self.spec is not None:
            from asyncrl.rollout.host_spec import build_host

            self.host, self.plane = build_host(self.server, self.name, self.spec, model_path)
        else:  # a bare server: the weight plane, no samples
            from asyncrl.rollout.host import ServerHost

            self.host = ServerHost(self.server, name=self.name, agent=None, eval_agent=None, plane=None)
        self._times["built_at"] = time.time()

    async def run_sample(self, sample: bytes, resume: bytes | None = None, resume_from: bytes | None = None) -> bytes:
        """`resume`: the sample's saved state at a checkpoint (`inflight.SavedSample`, msgpack);
        `resume_from`: the handle of a dead server's snapshot of it (msgpack)."""
        from asyncrl.rollout.host_spec import decode_handle, decode_sample, encode_record
        from asyncrl.rollout.inflight import decode_saved

        saved = decode_saved(resume)[0] if resume is not None else None
        snap = decode_handle(resume_from) if resume_from is not None else None
        with self._running():
            return encode_record(await self.host.run_sample(decode_sample(sample), saved, snap))

    async def run_samples(self, samples: bytes) -> bytes:
        """A group's samples in one call (msgpack, an array of samples, none resumed): their records, in order
        (msgpack, an array). One actor call per group instead of one per sample: the controller's cost of a
        call is mostly Ray's own."""
        from asyncrl.rollout.host_spec import decode_samples, encode_records

        with self._running():
            return encode_records(await self.host.run_samples(decode_samples(samples)))

    @contextlib.contextmanager
    def _running(self) -> Iterator[None]:
        task = asyncio.current_task()
        self._samples.add(task)  # type: ignore[arg-type]
        try:
            yield
        finally:
            self._samples.discard(task)  # type: ignore[arg-type]

    async def reattach(self, wipe_plane: bool) -> bool:
        """A new controller takes this server back (`ray.detached`): the samples the dead one had started
        are given up (it continues its checkpoint's instead), and with `wipe_plane` (its queue died with it:
        nothing names these records any more) the data plane starts empty. Answers at once: whether the
        engine is built (if not, the controller's `start` builds it, or waits for the build in progress)."""
        for task in list(self._samples):
            task.cancel()
        await asyncio.gather(*self._samples, return_exceptions=True)
        if wipe_plane and self.plane is not None:
            from transfer_queue import TransferQueueConfig, make_storage

            self.plane.close()
            self.plane = self.host.plane = make_storage(TransferQueueConfig(**self.spec["queue"]))
        return self._built is not None and self._built.done() and self._built.exception() is None

    async def touch(self) -> None:
        """The controller's keepalive (`ray.detached`); running it is the touch."""

    async def progress(self) -> tuple[ServerStats, bytes]:
        """The health probe's verb: stats, and the handles of the running samples' snapshots
        (`ServerHost.snapshot`, msgpack {uid: handle}) written just now."""
        from asyncrl.rollout.host_spec import encode_handles

        return self.host.stats(), encode_handles(await self.host.snapshot())

    async def partial_samples(self) -> bytes:
        """The host's running samples as far as they got (`list[SavedSample]`, msgpack)."""
        from asyncrl.rollout.inflight import encode_saved

        return encode_saved(await self.host.partial_samples())

    async def run_eval(self, sample: bytes) -> dict[str, Any]:
        from asyncrl.rollout.host_spec import decode_sample

        with self._running():
            return await self.host.run_eval(decode_sample(sample))

    async def join_weights(self, weights_config: dict[str, Any], endpoints: list[str], pause_mode: PauseMode = "keep") -> None:
        from checkpoint_engine import WeightsConfig

        await self.host.join_weights(WeightsConfig(**weights_config), endpoints, pause_mode)

    async def offer_weights(self, weights_config: dict[str, Any], receiver_id: str) -> str | None:
        from checkpoint_engine import WeightsConfig

        return await self.host.offer_weights(WeightsConfig(**weights_config), receiver_id)

    # the host's verbs, as they are (`RemoteServer` calls them by these names)
    generate = _to_host("generate")
    pause = _to_host("pause")
    resume = _to_host("resume")
    reset_prefix_cache = _to_host("reset_prefix_cache")
    score = _to_host("score")
    live_requests = _to_host("live_requests")
    stats = _to_host("stats")
    send_offered = _to_host("send_offered")

    async def update_weights_named(self, named_tensors: list[tuple[str, Any]], version: int) -> int:
        """The host's `update_weights`, answering with the version now served (what the proxy keeps)."""
        await self.host.update_weights(named_tensors, version)
        return self.host.version

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


def _orphaned(actor: ServerActor, placement: str) -> None:
    """No controller for `ray.orphan_timeout_s`: free the data plane, then remove the fleet's placement
    group (Ray ends every server in it, this one too)."""
    try:
        if actor.plane is not None:
            actor.plane.close()
    finally:
        remove_placement_group(ray.util.get_placement_group(placement))


def make_placement(cfg: RolloutConfig, num_servers: int, name: str = "") -> PlacementGroup:
    """One bundle per server: `cpus_per_server` CPUs (+ `tensor_parallel_size * gpus_per_worker`
    GPUs with `gpu_bundles`, + `ray_resources`: custom resources that pick the nodes). `name`: a
    detached run's (it outlives the controller)."""
    bundle: dict[str, float] = {"CPU": cfg.cpus_per_server, **cfg.ray_resources}
    if cfg.gpu_bundles:
        bundle["GPU"] = cfg.tensor_parallel_size * cfg.gpus_per_worker
    named = dict(name=name, lifetime="detached") if name else {}
    return placement_group([dict(bundle) for _ in range(num_servers)], strategy=cfg.placement_strategy, **named)


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
                 spec: dict[str, Any] | None = None, detached: Detached | None = None) -> RemoteServer:
    """Start one `ServerActor` in `placement`'s bundle `bundle` (default `index`); await `.ready()`.
    `spec` (a `HostSpec` as a dict) makes it run whole samples and join the weight plane; `detached`
    names it after the run and lets it outlive this process (`ray.detached`)."""
    strategy = PlacementGroupSchedulingStrategy(placement, placement_group_bundle_index=index if bundle is None else bundle)
    name = name or f"server-{index}"
    named = dict(name=detached.name, namespace=NAMESPACE, lifetime="detached") if detached else {}
    handle = _actor_class(cfg).options(scheduling_strategy=strategy, max_concurrency=1000, **named).remote(
        dataclasses.asdict(cfg), str(model_path), dtype, seed, index, name, spec,
        dataclasses.asdict(detached) if detached else None)
    return RemoteServer(handle, name, control_timeout_s=cfg.health_timeout_s)


def _actor_class(cfg: RolloutConfig) -> Any:
    gpus = cfg.tensor_parallel_size * cfg.gpus_per_worker if cfg.gpu_bundles else 0
    return ray.remote(num_cpus=cfg.cpus_per_server, num_gpus=gpus, max_restarts=0)(ServerActor)


def find_placement(name: str) -> PlacementGroup | None:
    """A detached run's placement group by name (None if there is none)."""
    from ray.util import get_placement_group

    try:
        return get_placement_group(name)
    except ValueError:
        return None


def find_server(names: DetachedNames, fleet: str, index: int) -> Any:
    """The actor handle of a detached run's server, or None if there is none by that name."""
    try:
        return ray.get_actor(names.server(fleet, index), namespace=NAMESPACE)
    except ValueError:
        return None


def kill(server: RemoteServer) -> None:
    """Kill the actor at once (tests of failover; the fleet's `remove` drains instead)."""
    ray.kill(server.handle, no_restart=True)


def _process_started() -> float:
    """Wall time this process was created (0.0 where the OS does not say)."""
    import psutil

    try:
        return psutil.Process().create_time()
    except psutil.Error:  # deliberate: the split then counts the imports as queueing
        return 0.0
