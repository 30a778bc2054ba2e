"""Builds the parts of a run from its config: model, tokenizer, task, servers, trainer, data plane.

The controller drives what this module builds; nothing here runs a loop. In the embedded
default every part lives in this process (`ray.enabled=false`): one trainer rank, the servers'
hosts and the queue share this process's data plane. With Ray the trainer is a group of
FSDP2 rank actors in a placement group (GPUs with `trainer.device=cuda`) and each rollout server is
an actor in its fleet's placement group that runs whole samples and loads weights itself; this
process then holds metadata only: it never reads a trajectory tensor and holds no `Sender` or
`Receiver`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Awaitable, Callable

from asyncrl.engines.sample import Sample
from asyncrl.config import Config, ConfigError
from asyncrl.data.datasets import PromptStream
from asyncrl.data.tasks import Task, build_task
from asyncrl.engines.base import SamplingParams
from asyncrl.rollout.host_spec import HostSpec, make_agent, tokenizer_codec

if TYPE_CHECKING:
    from asyncrl.trainer.actor import TrainerGroup
    from asyncrl.trainer.rank import TrainerRank


def resolve_model_path(cfg: Config) -> str:
    if cfg.model.path:
        return str(Path(cfg.model.path).expanduser())
    from asyncrl.data.tiny_model import ensure_tiny_model

    return str(ensure_tiny_model(Path(cfg.model.cache_dir).expanduser(), cfg.model.tiny))


@dataclass
class Components:
    model_path: str
    tokenizer: Any
    task: Task
    prompts: PromptStream
    trainer: TrainerRank | TrainerGroup
    """One rank in this process, or the group of Ray rank actors: the same blocking verbs."""
    eval_samples: list[Sample]
    make_plan: Callable[[list[list[Any]]], tuple[Any, int]]
    """Groups of queue records -> (`BatchPlan`, trained tokens)."""
    storage: Any
    """This process's data plane: the queue frees handles through it (and, in one process,
    the hosts write into it and the trainer reads from it)."""
    spawn: Callable[[], Awaitable[Any]]
    """Builds the `FleetManager` of the run's servers (run inside the pipeline's event loop)."""
    make_trainer: Callable[[], Any] = lambda: None
    """Builds the trainer anew (`restart_trainer`); blocking."""
    fleets: Any = None
    """The `FleetManager`: the one owner of the server set and of the version each serves."""
    sweep: bool = False
    """At close, remove the data-plane files of this run's server processes that were killed (an
    in-process queue dies with the run; a durable one may be resumed and keeps them)."""

    async def start(self) -> None:
        """Start what needs the event loop: the fleets (Ray actors join the router here)."""
        if self.fleets is None:
            self.fleets = await self.spawn()

    @property
    def router(self) -> Any:
        return self.fleets.router

    @property
    def servers(self) -> list[Any]:
        return self.fleets.servers if self.fleets is not None else []

    async def restart_trainer(self, health_interval_s: float) -> None:
        """The trainer died: end what is left of it and start a new one (new processes); the fleets stay.
        Their restarts and re-syncs in flight end first (without a trainer they fail), then the next
        `attach_weights` joins every server to the new trainer's weight plane and brings back the ones
        taken out, and the next publish gives them its weights. Meanwhile the fleets' health loop runs
        (every `health_interval_s`): a server that dies or hangs now is replaced before the new trainer
        waits for it."""
        close = getattr(self.trainer, "close", None)
        if close is not None:
            await asyncio.to_thread(close)
        if self.fleets is None:
            self.trainer = await asyncio.to_thread(self.make_trainer)
            return
        await self.fleets.detach_weights()
        watch = asyncio.create_task(self.fleets.watch(health_interval_s))
        try:
            self.trainer = await asyncio.to_thread(self.make_trainer)
        finally:
            watch.cancel()
            await asyncio.gather(watch, return_exceptions=True)
        if watch.done() and not watch.cancelled() and watch.exception() is not None:
            raise watch.exception()  # type: ignore[misc]

    async def close(self) -> None:
        if self.fleets is not None:
            await self.fleets.close()
        close = getattr(self.trainer, "close", None)
        if close is not None:
            close()
        if self.sweep and hasattr(self.storage, "sweep"):
            self.storage.sweep()
        self.storage.close()  # the run's plane: its queue clients (one per segment, `Pipeline`) leave it open


def detached_names(cfg: Config) -> Any:
    """The Ray names of the run's actors when they outlive the controller (`ray.detached`), else None."""
    from asyncrl.orphan import DetachedNames

    return DetachedNames(cfg.queue.run_id) if cfg.ray.enabled and cfg.ray.detached else None


def take_back(cfg: Config) -> Any:
    """A resumed detached run: its trainer ranks where all of them still run (a controller that died left
    them), as a `TrainerGroup`, with its fleets' placement groups; the servers are taken back as their
    fleets spawn, and one that is gone or does not answer (killed or hung while the controller was
    down, or still being replaced) is started anew in its bundle. The run's secret is theirs (the planes
    they hold use it). Where a rank or a placement group is gone, or a rank does not answer, whatever is
    left is ended and None returned (the log line says why): the run starts its actors anew, as without
    `ray.detached`."""
    import ray

    from asyncrl.rollout.server_actor import find_placement, find_server
    from asyncrl.trainer.actor import TrainerGroup

    names = detached_names(cfg)
    n = cfg.trainer.num_ranks
    ranks, placement, answered = TrainerGroup.find(names, n)
    fleets = {name: ([find_server(names, name, i) for i in range(c.num_servers)], find_placement(names.fleet_placement(name)))
              for name, c in _named_fleets(cfg.rollout)}
    lost = [name for name, (_, pg) in fleets.items() if pg is None]
    if placement is None:
        why = "the trainer's placement group is gone"
    elif len(ranks) < n:
        why = f"{n - len(ranks)} of {n} trainer ranks are gone"
    elif not answered:
        why = "a trainer rank did not answer (held in a collective its peer never joined, by a verb sent as the controller died?)"
    elif lost:
        why = f"the placement group of fleet {lost[0]!r} is gone"
    else:
        group = TrainerGroup.attach(ranks, placement, cfg.ray.orphan_timeout_s)
        cfg.queue.secret = cfg.weights.secret = group.secret()
        found = sum(h is not None for hs, _ in fleets.values() for h in hs)
        gone = sum(len(hs) for hs, _ in fleets.values()) - found
        print(f"asyncrl: took back the run's {len(ranks)} trainer ranks and {found} servers (ray.detached)"
              + (f"; {gone} server{'s' if gone > 1 else ''} gone, started anew" if gone else ""), flush=True)
        return group
    print(f"asyncrl: the run's actors are not taken back ({why}): starting them anew (ray.detached)", flush=True)
    for handle in ranks + [h for hs, _ in fleets.values() for h in hs if h is not None]:
        ray.kill(handle, no_restart=True)
    for pg in [placement] + [pg for _, pg in fleets.values()]:
        if pg is not None:
            ray.util.remove_placement_group(pg)
    return None


def init_ray(cfg: Config) -> None:
    """Join `ray.address`, or start a local Ray whose CPU count covers the run's bundles (Ray's CPUs
    are scheduling slots: a 2-core laptop can place 2 trainer ranks and 2 servers)."""
    import os

    import ray

    if ray.is_initialized():
        return
    num_cpus = cfg.ray.num_cpus or None
    if not cfg.ray.address and num_cpus is None:
        t = cfg.trainer
        need = t.num_ranks * t.cpus_per_rank + sum(c.num_servers * c.cpus_per_server for c in _fleets(cfg.rollout))
        num_cpus = max(os.cpu_count() or 1, int(need + 0.999))
    resources = None if cfg.ray.address else (custom_resources(cfg) or None)  # a local Ray offers what the bundles ask
    from asyncrl.orphan import NAMESPACE

    ray.init(address=cfg.ray.address or None, num_cpus=num_cpus, resources=resources, include_dashboard=False, log_to_driver=False,
             namespace=NAMESPACE if cfg.ray.detached else None)
    from asyncrl.hosts import on_node

    on_node(ray.util.get_node_ip_address(), ray.util.get_node_ip_address())  # this process's listeners' `auto`
    token = os.environ.get("RAY_AUTH_TOKEN_PATH") or os.path.expanduser("~/.ray/auth_token")
    if os.path.isfile(token) and os.stat(token).st_uid == os.getuid():
        os.chmod(token, 0o600)  # Ray writes the token it generates for a local cluster world-readable


def custom_resources(cfg: Config) -> dict[str, float]:
    """Custom Ray resources the run's bundles ask for in all (`trainer.ray_resources`, `rollout.ray_resources`)."""
    need: dict[str, float] = {}
    for per, count in [(cfg.trainer.ray_resources, cfg.trainer.num_ranks)] + [(c.ray_resources, c.num_servers) for c in _fleets(cfg.rollout)]:
        for name, amount in per.items():
            need[name] = need.get(name, 0.0) + amount * count
    return need


def check_resources(cfg: Config) -> None:
    """A custom resource no node of the cluster offers: a config error naming the key (else placement waits its timeout)."""
    import ray

    have = ray.cluster_resources()
    for key, per in [("trainer.ray_resources", cfg.trainer.ray_resources)] + [("rollout.ray_resources", c.ray_resources) for c in _fleets(cfg.rollout)]:
        for name in per:
            if name not in have:
                offered = sorted(k for k in have if not k.startswith("node:") and k not in ("CPU", "GPU", "memory", "object_store_memory"))
                raise ConfigError(f"{key}.{name}: no node of the Ray cluster offers resource {name!r} (custom resources: {offered}); "
                                  f"start the nodes with `ray start --resources '{{\"{name}\": N}}'` (deploy/ray/start_cluster.sh --resources)")


def may_land(cfg: Config) -> tuple[set[str], set[str]]:
    """The hosts (node addresses) of the live Ray nodes that offer a trainer rank's bundle, and those that
    offer a server's (of every fleet): where each role may land. A bundle that no node offers is a config
    error naming the key (placement would wait its timeout for a node that may never come)."""
    import ray

    nodes = [n for n in ray.nodes() if n.get("Alive")]
    t = cfg.trainer
    rank = {"CPU": t.cpus_per_rank, **({"GPU": t.gpus_per_rank} if t.device == "cuda" else {}), **t.ray_resources}  # as TrainerGroup's
    servers = {name: {"CPU": c.cpus_per_server, **c.ray_resources, **({"GPU": c.tensor_parallel_size * c.gpus_per_worker}
                                                                      if c.gpu_bundles else {})}
               for name, c in _named_fleets(cfg.rollout)}  # as `server_actor.make_placement` builds them

    def offering(need: dict[str, float], key: str) -> set[str]:
        found = {n["NodeManagerAddress"] for n in nodes if all(n["Resources"].get(k, 0.0) >= v for k, v in need.items())}
        if not found:
            raise ConfigError(f"{key}: no live node of the Ray cluster offers a whole bundle {need} at once "
                              f"(the nodes: {[_offer(n) for n in nodes]})")
        return found

    trainer = offering(rank, "trainer.ray_resources")
    server_hosts: set[str] = set()
    for name, need in servers.items():
        server_hosts |= offering(need, "rollout.ray_resources" if name == "main" else f"rollout.fleets[{name}].ray_resources")
    return trainer, server_hosts


def _offer(node: dict[str, Any]) -> str:
    """A node's address and what it offers (CPUs, GPUs, custom resources), for an error line."""
    res = {k: v for k, v in node["Resources"].items() if not k.startswith("node:") and k not in ("memory", "object_store_memory")}
    return f"{node['NodeManagerAddress']} {res}"


def check_hosts(cfg: Config) -> None:
    """A placement the planes cannot serve (a plane that does not cross hosts, a loopback listener) on
    every host the roles may land on: a config error naming the key, before anything starts
    (`asyncrl.hosts.check_placement`; asked again with where they landed, `spawn`)."""
    import ray

    from asyncrl.hosts import check_placement

    trainer, servers = may_land(cfg)
    check_placement(cfg, trainer, servers, ray.util.get_node_ip_address(), may=True)


def check_gpus(cfg: Config) -> None:
    """`trainer.device=cuda` / `rollout.gpu_bundles` where no GPU can be had: a config error naming the key."""
    t, r = cfg.trainer, cfg.rollout
    if cfg.ray.enabled:
        import ray

        have = float(ray.cluster_resources().get("GPU", 0))
        need_t = t.num_ranks * t.gpus_per_rank if t.device == "cuda" else 0.0
        need_r = sum(c.num_servers * c.tensor_parallel_size * c.gpus_per_worker for c in _fleets(r)) if r.gpu_bundles else 0.0
        if need_t and need_t > have:
            raise ConfigError(f"trainer.device: cuda needs {need_t:g} GPUs (trainer.num_ranks {t.num_ranks} x trainer.gpus_per_rank "
                              f"{t.gpus_per_rank:g}); the Ray cluster has {have:g}")
        if need_r and need_t + need_r > have:
            raise ConfigError(f"rollout.gpu_bundles: the fleets need {need_r:g} GPUs besides the trainer's {need_t:g}; "
                              f"the Ray cluster has {have:g} (fractions: rollout.gpus_per_worker, trainer.gpus_per_rank)")
    elif t.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("trainer.device: cuda, but this machine has no usable CUDA GPU (torch.cuda.is_available() is "
                              "False); use trainer.device=cpu or auto")


def _fleets(r: Any) -> list[Any]:
    return [c for _, c in _named_fleets(r)]


def _named_fleets(r: Any) -> list[tuple[str, Any]]:
    from asyncrl.rollout.fleet_build import fleet_configs

    return list(fleet_configs(r).items())


def build_trainer(cfg: Config, model_path: str, storage: Any) -> TrainerRank | TrainerGroup:
    if cfg.trainer.threads:
        import torch

        torch.set_num_threads(cfg.trainer.threads)
    from asyncrl.trainer.lora import LoraSpec

    kw = dict(trainer=cfg.trainer, algorithm=cfg.algorithm, critic=cfg.critic, lora=LoraSpec.from_model(cfg.model),
              dtype=cfg.model.dtype, temperature=cfg.rollout.temperature, seed=cfg.seed)
    if cfg.ray.enabled:
        from asyncrl.trainer.actor import TrainerGroup

        return TrainerGroup(cfg.trainer.num_ranks, model_path, queue=cfg.queue, weights=cfg.weights, detached=detached_names(cfg),
                            orphan_timeout_s=cfg.ray.orphan_timeout_s, placement_timeout_s=cfg.trainer.placement_timeout_s, **kw)
    from asyncrl.trainer.rank import TrainerRank, build_engine

    return TrainerRank(build_engine(model_path, **kw), plane=storage, weights=cfg.weights)


def host_spec(cfg: Config, reward: str, sampling: SamplingParams, eval_sampling: SamplingParams, log_dir: str = "") -> HostSpec:
    return HostSpec(agent=dataclasses.asdict(cfg.agent), reward=reward, sampling=dataclasses.asdict(sampling),
                    eval_sampling=dataclasses.asdict(eval_sampling), queue=dataclasses.asdict(cfg.queue),
                    partial_rollouts=cfg.rollout.partial_rollouts, log_dir=log_dir)


def local_fleets(cfg: Config, model_path: str, spec: HostSpec, tokenizer: Any, storage: Any) -> Callable[[], Awaitable[Any]]:
    """The embedded fleet: servers in this process, each behind a `ServerHost` on `storage`."""
    from asyncrl.engines.backends import build_server
    from asyncrl.rollout.fleet import FleetManager
    from asyncrl.rollout.fleet_build import Fleet, build_fleet
    from asyncrl.rollout.host import ServerHost
    from asyncrl.rollout.router import Router

    r = cfg.rollout
    encode, decode = tokenizer_codec(tokenizer)

    def host(i: int, server: Any) -> Any:
        return ServerHost(server, name=f"main-{i}", plane=storage, partial_rollouts=r.partial_rollouts,
                          agent=make_agent(spec.agent, spec.reward, encode, decode, SamplingParams(**spec.sampling), tokenizer=tokenizer),
                          eval_agent=make_agent(spec.agent, spec.reward, encode, decode, SamplingParams(**spec.eval_sampling),
                                                tokenizer=tokenizer))

    async def make(i: int) -> Any:
        """One more server in this process (`asyncrl scale`), its model loaded off the event loop."""
        server = await asyncio.to_thread(build_server, r, model_path, dtype=cfg.model.dtype, seed=cfg.seed, index=i,
                                         log_dir=spec.log_dir or None)
        return host(i, server)

    async def spawn() -> Any:
        servers = build_fleet(r, model_path, dtype=cfg.model.dtype, seed=cfg.seed, log_dir=spec.log_dir or None)
        manager = FleetManager(Router(max_failovers=r.max_failovers, partial_rollouts=r.partial_rollouts), restart_dead=False)
        await manager.add_fleet(Fleet("main", [host(i, s) for i, s in enumerate(servers)], make=make))
        return manager

    return spawn


async def ray_fleets(cfg: Config, model_path: str, spec: HostSpec, trainer: Callable[[], Any]) -> Any:
    """The run's fleets as Ray actors in their placement groups (`FleetManager.spawn`), once they run
    checked against where the trainer ranks run (`asyncrl.hosts.check_placement`): a placement the planes
    cannot serve stops the run with the key to change before the first publish."""
    import ray

    from asyncrl.hosts import check_placement
    from asyncrl.rollout.fleet import FleetManager

    manager = await FleetManager.spawn(cfg.rollout, model_path, dtype=cfg.model.dtype, seed=cfg.seed, spec=dataclasses.asdict(spec),
                                       detached=detached_names(cfg), orphan_timeout_s=cfg.ray.orphan_timeout_s)
    try:
        check_placement(cfg, set(getattr(trainer(), "nodes", [])), {s.node for s in manager.servers if getattr(s, "node", "")},
                        ray.util.get_node_ip_address())
    except ConfigError:
        await manager.close()
        raise
    where = ", ".join(f"{s.name} on {s.node} ({getattr(s, 'ifname', '') or 'no interface found'})" for s in manager.servers)
    print(f"asyncrl: servers {where}", flush=True)  # each server's gloo / NCCL sockets (`asyncrl.hosts.on_node`)
    return manager


def share_run_secret(cfg: Config) -> None:
    """One secret per run on every socket the planes open (queue controller, storage units, weight
    senders): `queue.secret` or `weights.secret` if set (either names it for both), else
    `ASYNCRL_SECRET` or the 0600 file `ASYNCRL_SECRET_FILE` (`asyncrl.config.io.run_secret`), else a fresh
    random one. It travels to the run's processes inside their configs and is never written to the
    run directory (the resolved config records `<set>`)."""
    from asyncrl.config.io import run_secret

    secret = cfg.queue.secret or cfg.weights.secret or run_secret() or secrets.token_hex(16)
    cfg.queue.secret = cfg.weights.secret = secret


def build(cfg: Config, run_dir: Any = None) -> Components:
    from transfer_queue import make_storage

    from asyncrl.batching import PlanBuilder
    from asyncrl.preflight import load_tokenizer

    share_run_secret(cfg)
    kept = None
    if cfg.ray.enabled:
        init_ray(cfg)
        check_gpus(cfg)
        check_resources(cfg)
        check_hosts(cfg)
        kept = take_back(cfg) if cfg.ray.detached and cfg.resume else None
    model_path = resolve_model_path(cfg)
    tok = load_tokenizer(model_path)  # an unreadable tokenizer: a ConfigError naming model.path
    if tok.eos_token_id is None:
        raise ConfigError(f"model.path: tokenizer in {model_path} has no EOS token")
    encode, decode = tokenizer_codec(tok)
    task = build_task(cfg.data, encode, tokenizer=tok, reward=cfg.agent.reward)
    r = cfg.rollout
    sampling = SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, max_tokens=r.max_tokens, stop_token_ids=[tok.eos_token_id], stop=list(r.stop))
    eval_sampling = SamplingParams(temperature=r.eval_temperature, max_tokens=r.max_tokens, stop_token_ids=[tok.eos_token_id], stop=list(r.stop), seed=cfg.seed)
    spec = host_spec(cfg, cfg.agent.reward or task.reward, sampling, eval_sampling, log_dir=str(run_dir) if run_dir else "")
    make_agent(spec.agent, spec.reward, encode, decode, sampling, tokenizer=tok)  # a bad agent key or template fails here, before anything starts
    storage = make_storage(cfg.queue)
    if run_dir is not None:  # mark the run with its directory (a resume's files are kept while it has a checkpoint),
        from asyncrl.shm_gc import at_start  # then remove what this user's runs that are gone left

        if hasattr(storage, "note_run"):
            storage.note_run({"durable": cfg.queue.metadata != "memory", "run_dir": str(Path(run_dir).resolve())})
        at_start(cfg.queue.shm_dir, cfg.queue.shm_keep_s)
    if cfg.ray.enabled:  # servers are Ray actors in placement groups, started inside the event loop
        spawn: Callable[[], Awaitable[Any]] = lambda: ray_fleets(cfg, model_path, spec, lambda: parts.trainer)
    else:
        check_gpus(cfg)
        spawn = local_fleets(cfg, model_path, spec, tok, storage)
    eval_samples = [
        Sample(uid=f"eval-{p.index}", group_id=f"eval-{p.index}", index_in_group=0, group_size=1, prompt_ids=p.prompt_ids, answer=p.answer)
        for p in task.eval.prompts
    ]
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    parts = Components(
        model_path=model_path,
        tokenizer=tok,
        task=task,
        prompts=PromptStream(task.train, seed=cfg.data.seed),
        trainer=kept if kept is not None else build_trainer(cfg, model_path, storage),
        make_trainer=lambda: build_trainer(cfg, model_path, storage),
        eval_samples=eval_samples,
        make_plan=PlanBuilder(cfg.algorithm, pad_id=pad_id, minibatches=cfg.trainer.minibatches),
        storage=storage,
        spawn=spawn,
        sweep=cfg.queue.metadata == "memory",
    )
    return parts
