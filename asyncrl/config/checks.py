"""The config tree's error type and its checks: a bad value fails at load with the key to change.

The bottom of the `asyncrl.config` package: the modules of the tree (`tree`, `rollout`, `algorithm`,
`critic`) and its loader (`io`) import it; it imports none of them. `ConfigError` is also on the
package's public surface (`asyncrl/config/__init__.py`). The checks that read the disk (data files, the
model folder and its tokenizer, installed engines) are `asyncrl/preflight.py`'s: run once before
anything starts, not at every load. `check_overlong` is the cross-section check of DAPO's overlong
shaping; `check_gpu_layout` those of the GPU settings (trainer, weight plane, fleets), called by
`preflight` before anything starts. `check_registered` checks an algorithm name against its registry
itself (imported when a config is checked, not when this module is: they import torch), so a name a
user registers is valid at load. `check_literals` checks every `Literal[...]` field of a config
dataclass (its string choices) in one place, with `one_of`'s message.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Collection, Literal, Sequence, get_args, get_origin, get_type_hints

from asyncrl.registry import UnknownName


class ConfigError(ValueError):
    """A config value that cannot be used; the message names the key."""


def check(ok: bool, key: str, msg: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {msg}")


def one_of(value: str, key: str, choices: Sequence[str]) -> None:
    check(value in choices, key, f"must be one of {list(choices)}, got {value!r}")


@functools.lru_cache(maxsize=None)
def literal_fields(cls: type) -> tuple[tuple[str, tuple[Any, ...]], ...]:
    """(name, choices) of each field of the dataclass `cls` typed `Literal[...]`, in field order."""
    hints = get_type_hints(cls)
    return tuple((f.name, get_args(hints[f.name])) for f in dataclasses.fields(cls) if get_origin(hints[f.name]) is Literal)


def check_literals(obj: Any, section: str) -> None:
    """Each `Literal[...]` field of the config dataclass `obj` holds one of its choices; else the `one_of` error
    naming `<section>.<field>`. (Through `load`, OmegaConf rejects such a value first; `io` words it alike.)"""
    for name, choices in literal_fields(type(obj)):
        one_of(getattr(obj, name), f"{section}.{name}", choices)


def _registry_of(key: str) -> tuple[Any, Collection[str]]:
    """The `asyncrl.registry.Registry` behind a config key, and the names valid there beside its entries."""
    if key == "algorithm.advantage":
        from asyncrl.trainer.advantages import ADVANTAGES, TOKEN_LEVEL_ADVANTAGES

        return ADVANTAGES, TOKEN_LEVEL_ADVANTAGES
    if key == "algorithm.loss":
        from asyncrl.trainer.losses import POLICY_LOSSES

        return POLICY_LOSSES, ()
    if key == "algorithm.correction":
        from asyncrl.trainer.corrections import CORRECTIONS

        return CORRECTIONS, ()
    raise KeyError(f"no registry behind config key {key!r}")


def check_registered(value: str, key: str) -> None:
    """`value` is a name registered for `key` (or valid there beside the registry, e.g. `gae`), or, where the
    registry takes import paths, a `package.module:attr` that imports to a callable (imported now: a typo fails at load).
    Otherwise the `one_of` error, listing the registry's names."""
    registry, extra = _registry_of(key)
    if value in registry or value in extra:
        return
    if registry.import_paths and ":" in value:
        try:
            registry.get(value)
        except UnknownName as e:
            raise ConfigError(str(e)) from None
        except ImportError as e:
            raise ConfigError(f"{key}: cannot import {value!r} ({type(e).__name__}: {e})") from None
        return
    one_of(value, key, [*registry.names(), *extra])


RAY_BUILTIN_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory")
"""Resources Ray counts itself: set them with the `cpus_*` / `gpus_*` keys, never as custom ones."""


def check_resources(resources: dict[str, float], key: str) -> None:
    """Custom Ray resources of a bundle (`trainer.ray_resources`, `rollout.ray_resources`): names Ray
    does not count itself, amounts > 0."""
    for name, amount in resources.items():
        check(isinstance(name, str) and bool(name) and name not in RAY_BUILTIN_RESOURCES, f"{key}.{name}",
              f"must be a custom resource name (not one of {list(RAY_BUILTIN_RESOURCES)}: use the cpus_/gpus_ keys)")
        check(isinstance(amount, (int, float)) and amount > 0, f"{key}.{name}", f"must be > 0, got {amount!r}")


def max_response_length(cfg: Any) -> tuple[int, str]:
    """(the response budget overlong shaping measures against, the key that sets it): the tool agent's
    total `agent.kwargs.max_response_tokens` when given (its responses include tool tokens), else
    `rollout.max_tokens` (one generate call: the single-turn agent's whole response)."""
    if "max_response_tokens" in cfg.agent.kwargs:
        return int(cfg.agent.kwargs["max_response_tokens"]), "agent.kwargs.max_response_tokens"
    return int(cfg.rollout.max_tokens), "rollout.max_tokens"


def check_overlong(cfg: Any) -> None:
    """The cross-section checks of `agent.overlong_buffer_len` (called by `Config` when it is on)."""
    buffer = cfg.agent.overlong_buffer_len
    check(cfg.agent.name != "tool" or "max_response_tokens" in cfg.agent.kwargs, "agent.kwargs.max_response_tokens",
          "required with agent.name=tool and agent.overlong_buffer_len > 0 (the tool agent's total response budget, tool tokens included)")
    limit, key = max_response_length(cfg)
    check(buffer < limit, "agent.overlong_buffer_len",
          f"must be < the max response length {key}={limit} (the penalty starts at {key} - agent.overlong_buffer_len tokens), got {buffer}")


class FleetKeys:
    """One fleet's view of the rollout keys: its `rollout.fleets[i]` entry over the main keys, and
    the key a user sets to change a field (the entry's own, else the main one it inherits)."""

    def __init__(self, r: Any, index: int | None = None) -> None:
        self.r, self.entry = r, {} if index is None else r.fleets[index]
        self.prefix = "rollout" if index is None else f"rollout.fleets[{index}]"

    def get(self, field: str) -> Any:
        return self.entry.get(field, getattr(self.r, field))

    def key(self, field: str) -> str:
        return f"{self.prefix}.{field}" if field in self.entry else f"rollout.{field}"

    @property
    def gpus(self) -> float:
        """GPUs in one server's Ray bundle (0 without `gpu_bundles`)."""
        return self.get("tensor_parallel_size") * self.get("gpus_per_worker") if self.get("gpu_bundles") else 0.0


def fleets_of(r: Any) -> list[FleetKeys]:
    """The main fleet and each `rollout.fleets` entry, as `FleetKeys`."""
    return [FleetKeys(r)] + [FleetKeys(r, i) for i in range(len(r.fleets))]


NO_CUDA_WEIGHTS = "or weights.device=cpu with weights.backend=shm (one host) or gloo"


def check_gpu_layout(cfg: Any) -> None:
    """GPU settings that cannot work together, decided from the config alone (the machine's side,
    whether CUDA is there and how many GPUs, is `preflight.check_cuda`'s). Where each GPU user lives:
    with `ray.enabled` every trainer rank and every server is an actor that sees only the GPUs of its
    bundle (`trainer.gpus_per_rank` with `trainer.device=cuda`; `tensor_parallel_size * gpus_per_worker`
    with `rollout.gpu_bundles`), as cuda:0..; a fraction lets Ray put two actors on one GPU. Without Ray
    the trainer and the torch engine's servers share this process (vLLM's GPU workers are processes of
    their own). NCCL refuses two ranks of a group on one GPU; CUDA opens an IPC handle only in another
    process that sees the GPU it lives on."""
    t, w, ray = cfg.trainer, cfg.weights, cfg.ray.enabled
    fleets = fleets_of(cfg.rollout)
    cuda_weights = w.device.startswith("cuda")
    index = w.device.partition(":")[2]
    check(not cuda_weights or w.device == "cuda" or (w.device.startswith("cuda:") and index.isdigit()), "weights.device",
          f"must be cpu, cuda or cuda:N, got {w.device!r}")
    if ray and t.device == "cuda" and t.num_ranks > 1:
        check(t.gpus_per_rank == 1 or w.backend == "cuda_ipc", "trainer.gpus_per_rank",
              f"must be 1 with trainer.num_ranks={t.num_ranks} on cuda: the ranks form one NCCL group (FSDP) and a "
              f"fraction lets Ray put two of them on one GPU, which NCCL refuses; got {t.gpus_per_rank:g}")
    for f in fleets:
        tp, gpw = f.get("tensor_parallel_size"), f.get("gpus_per_worker")
        check(not (ray and f.get("gpu_bundles") and tp > 1 and gpw < 1), f.key("gpus_per_worker"),
              f"must be 1 with {f.key('tensor_parallel_size')}={tp}: a server's workers form one NCCL group and its "
              f"bundle of {tp} x {gpw:g} GPUs cannot give each its own GPU; got {gpw:g}")
    if ray and cuda_weights:
        check(t.device == "cuda", "trainer.device", f"must be cuda with weights.device={w.device} and ray.enabled=true: "
              f"trainer rank 0 holds the weight plane's GPU buffers, and its actor holds a GPU only with trainer.device=cuda "
              f"(got {t.device!r}); {NO_CUDA_WEIGHTS}")
        for f in fleets:
            check(f.get("gpu_bundles"), f.key("gpu_bundles"), f"must be true with weights.device={w.device} and "
                  f"ray.enabled=true: a server receives weights in its actor, which holds a GPU only in a GPU bundle; {NO_CUDA_WEIGHTS}")
        check(index in ("", "0"), "weights.device", f"must be cuda (or cuda:0) with ray.enabled=true: each actor sees "
              f"only the GPUs of its bundle, from cuda:0; got {w.device!r}")
    for f in fleets:
        tp = f.get("tensor_parallel_size")
        check(not (index and f.get("backend") == "vllm" and tp > 1), "weights.device", f"must be cuda without an index "
              f"with {f.key('tensor_parallel_size')}={tp}: {w.device} puts every vLLM worker's receiver on that one GPU "
              f"(plain cuda: each on its own); got {w.device!r}")
    if w.backend == "nccl":
        _check_nccl(t, w, ray, fleets)
    if w.backend == "cuda_ipc":
        _check_cuda_ipc(t, ray, fleets)


def _check_nccl(t: Any, w: Any, ray: bool, fleets: list[FleetKeys]) -> None:
    """`weights.backend=nccl`: one group of trainer rank 0 and every server worker, each on its own GPU."""
    check(ray, "weights.backend", "nccl needs ray.enabled=true: its group is trainer rank 0 and every server worker, each "
          f"on its own GPU, and without Ray they share weights.device={w.device} (torch engine servers: this process; vLLM: "
          "its first worker is on the trainer's GPU), where NCCL refuses two ranks on one GPU; use weights.backend=cuda_ipc "
          "with rollout.backend=vllm to share one GPU, or weights.device=cpu with weights.backend=shm")
    shared = ([f"trainer.gpus_per_rank={t.gpus_per_rank:g}"] if t.gpus_per_rank < 1 else []) + [
        f"{f.key('gpus_per_worker')}={f.get('gpus_per_worker'):g}" for f in fleets for _ in range(f.get("num_servers") * f.get("tensor_parallel_size"))
        if f.get("gpus_per_worker") < 1]
    check(len(shared) < 2, "weights.backend", f"nccl needs each rank of its group (trainer rank 0, every server worker) on "
          f"its own GPU, and {', '.join(sorted(set(shared)))} let Ray put two of them on one GPU, which NCCL refuses; "
          "give each a whole GPU (trainer.gpus_per_rank=1 rollout.gpus_per_worker=1), or share one GPU with weights.backend=cuda_ipc")


def _check_cuda_ipc(t: Any, ray: bool, fleets: list[FleetKeys]) -> None:
    """`weights.backend=cuda_ipc`: every server's receiver opens the trainer's GPU buffers from another process."""
    if not ray:
        for f in fleets:
            check(f.get("backend") == "vllm", f.key("backend"), f"must be vllm with weights.backend=cuda_ipc and ray.enabled=false: "
                  f"a {f.get('backend')} server receives weights in this process, the one whose GPU buffers it would open, and "
                  "CUDA opens an IPC handle only in another process (vLLM's GPU workers are); or ray.enabled=true, "
                  "or weights.device=cpu with weights.backend=shm")
        return
    check(t.num_ranks == 1, "trainer.num_ranks", f"must be 1 with weights.backend=cuda_ipc and ray.enabled=true: every server "
          "opens every rank's buffers, so all ranks would share its GPU, where their NCCL group (FSDP) cannot run; "
          f"got {t.num_ranks} (more ranks: weights.backend=nccl, a GPU each)")
    parts = [(f, f.get("num_servers"), f.gpus) for f in fleets]
    total = t.gpus_per_rank + sum(n * g for _, n, g in parts)
    sums = " + ".join([f"{t.gpus_per_rank:g}"] + [f"{n} x {g:g}" for _, n, g in parts])
    check(total <= 1 + 1e-9, "weights.backend", "cuda_ipc with ray.enabled=true needs every server on the trainer's GPU "
          "(Ray shows an actor only the GPUs of its bundle): trainer.gpus_per_rank + rollout.num_servers x "
          f"rollout.tensor_parallel_size x rollout.gpus_per_worker must be <= 1, got {sums} = {total:g}; e.g. 0.5 and one "
          "server at 0.5, or weights.backend=nccl with a GPU each")
