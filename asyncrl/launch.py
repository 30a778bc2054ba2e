"""Builds the parts of a run from its config: model, tokenizer, task, servers, trainer, agents.

The controller drives what this module builds; nothing here runs a loop. In the embedded
default every part lives in this process (`ray.enabled=false`); with Ray the trainer
pool is a group of FSDP2 actor shells.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Awaitable, Callable

from agents.base import AgentLoop, Sample
from agents.registry import AGENTS, build_agent, resolve
from agents.rewards import get_reward
from asyncrl.config import Config, ConfigError
from asyncrl.data.datasets import PromptStream
from asyncrl.data.tasks import Task, build_task
from asyncrl.rollout.base import RolloutServer, SamplingParams
from asyncrl.rollout.router import Router
from asyncrl.types import Trajectory


def resolve_model_path(cfg: Config) -> str:
    if cfg.model.path:
        return str(Path(cfg.model.path).expanduser())
    from asyncrl.data.tiny_model import TinyModelSpec, ensure_tiny_model

    t = cfg.model.tiny
    spec = TinyModelSpec(
        hidden_size=t.hidden_size,
        num_layers=t.num_layers,
        num_heads=t.num_heads,
        num_kv_heads=t.num_kv_heads,
        intermediate_size=t.intermediate_size,
        seed=t.seed,
    )
    return str(ensure_tiny_model(Path(cfg.model.cache_dir).expanduser(), spec))


@dataclass
class Components:
    model_path: str
    tokenizer: Any
    task: Task
    prompts: PromptStream
    servers: list[RolloutServer]
    router: Router
    trainer: Any
    """TrainerEngine (in-process) or TrainerGroup (Ray actors): same verbs."""
    agent: AgentLoop
    eval_agent: AgentLoop
    eval_samples: list[Sample]
    make_batch: Callable[[list[list[Trajectory]]], tuple[Any, int]]
    spawn: Callable[[], Awaitable[Any]] | None = None
    """Ray placement: starts the fleets of server actors (run inside the pipeline's event loop)."""
    fleets: Any = None
    """The FleetManager of Ray-placed fleets (None for in-process servers)."""

    async def start(self) -> None:
        """Start what needs the event loop: Ray fleets join `servers` and `router` here."""
        if self.spawn is not None and self.fleets is None:
            self.fleets = await self.spawn()
            self.servers.extend(s for f in self.fleets.fleets.values() for s in f.servers)

    async def close(self) -> None:
        if self.fleets is not None:
            await self.fleets.close()
        else:
            for s in self.servers:
                await s.close()
        close = getattr(self.trainer, "close", None)
        if close is not None:
            close()


def init_ray(cfg: Config) -> None:
    import ray

    if not ray.is_initialized():
        ray.init(address=cfg.ray.address or None, num_cpus=cfg.ray.num_cpus or None, include_dashboard=False,
                 log_to_driver=False)


def build_trainer(cfg: Config, model_path: str) -> Any:
    if cfg.trainer.threads:
        import torch

        torch.set_num_threads(cfg.trainer.threads)
    kw = dict(trainer=cfg.trainer, algorithm=cfg.algorithm, dtype=cfg.model.dtype, temperature=cfg.rollout.temperature, seed=cfg.seed)
    if cfg.ray.enabled:
        from asyncrl.trainer.actor import TrainerGroup

        init_ray(cfg)
        return TrainerGroup(cfg.trainer.num_ranks, model_path, **kw)
    if cfg.trainer.num_ranks > 1:
        raise ConfigError("trainer.num_ranks > 1 needs ray.enabled=true (or run the trainer under torchrun)")
    from asyncrl.trainer.engine import TrainerEngine

    return TrainerEngine(model_path, **kw)


def make_agent(cfg: Config, task: Task, encode: Callable, decode: Callable, sampling: SamplingParams) -> AgentLoop:
    """The configured AgentLoop; `encode` is passed to agents that take it (multi-turn ones)."""
    import inspect

    a = cfg.agent
    kw: dict[str, Any] = dict(decode=decode, sampling=sampling, reward=a.reward or task.reward, reward_kwargs=dict(a.reward_kwargs),
                              reward_timeout_s=a.reward_timeout_s, **a.kwargs)
    try:
        factory = resolve(a.name, AGENTS, "agent")
    except (ValueError, ImportError, AttributeError) as e:
        raise ConfigError(f"agent.name: {e}") from None
    try:
        get_reward(a.reward or task.reward, **a.reward_kwargs)
    except (ValueError, ImportError, AttributeError) as e:
        raise ConfigError(f"agent.reward: {e}") from None
    if "encode" in inspect.signature(factory).parameters:
        kw["encode"] = encode
    try:
        return build_agent(a.name, **kw)
    except TypeError as e:
        raise ConfigError(f"agent.kwargs: {e}") from None


def build(cfg: Config) -> Components:
    from transformers import AutoTokenizer

    from asyncrl.rollout.fleet import build_fleet
    from asyncrl.batching import BatchBuilder

    model_path = resolve_model_path(cfg)
    tok = AutoTokenizer.from_pretrained(model_path)
    if tok.eos_token_id is None:
        raise ConfigError(f"model.path: tokenizer in {model_path} has no EOS token")
    task = build_task(cfg.data, lambda s: tok(s, add_special_tokens=False)["input_ids"])
    decode: Callable[[list[int]], str] = lambda ids: tok.decode(ids, skip_special_tokens=True)
    encode: Callable[[str], list[int]] = lambda s: tok(s, add_special_tokens=False)["input_ids"]
    r = cfg.rollout
    sampling = SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, max_tokens=r.max_tokens, stop_token_ids=[tok.eos_token_id])
    eval_sampling = SamplingParams(temperature=r.eval_temperature, max_tokens=r.max_tokens, stop_token_ids=[tok.eos_token_id], seed=cfg.seed)
    spawn = None
    if cfg.ray.enabled:  # servers are Ray actors in placement groups, started inside the event loop
        init_ray(cfg)
        router = Router(max_failovers=r.max_failovers, partial_rollouts=r.partial_rollouts)
        servers: list[RolloutServer] = []
        from asyncrl.rollout.fleet import FleetManager

        spawn = lambda: FleetManager.spawn(r, model_path, dtype=cfg.model.dtype, seed=cfg.seed, router=router)
    else:
        servers = build_fleet(r, model_path, dtype=cfg.model.dtype, seed=cfg.seed)
        router = Router(servers, max_failovers=r.max_failovers, partial_rollouts=r.partial_rollouts)
    eval_samples = [
        Sample(uid=f"eval-{p.index}", group_id=f"eval-{p.index}", index_in_group=0, group_size=1, prompt_ids=p.prompt_ids, answer=p.answer)
        for p in task.eval.prompts
    ]
    return Components(
        model_path=model_path,
        tokenizer=tok,
        task=task,
        prompts=PromptStream(task.train, seed=cfg.data.seed),
        servers=servers,
        router=router,
        trainer=build_trainer(cfg, model_path),
        agent=make_agent(cfg, task, encode, decode, sampling),
        eval_agent=make_agent(cfg, task, encode, decode, eval_sampling),
        eval_samples=eval_samples,
        spawn=spawn,
        make_batch=BatchBuilder(cfg.algorithm, pad_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id),
    )
