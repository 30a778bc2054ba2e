"""The config tree's error type and its checks: a bad value fails at load with the key to change.

Shared by the modules of the config tree (`config_tree.py`, `config_rollout.py`, ...); `ConfigError` is
re-exported by `asyncrl.config`. The checks that read the disk (data files, the model folder and its
tokenizer, installed engines) are `asyncrl/preflight.py`'s: run once before anything starts, not at
every load. `check_overlong` is the one cross-section check of DAPO's overlong shaping.
`check_registered` checks an algorithm name against its registry itself (imported when a config is
checked, not when this module is), so a name a user registers is valid at load. `check_literals` checks
every `Literal[...]` field of a config dataclass (its string choices) in one place, with `one_of`'s message.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Literal, Sequence, get_args, get_origin, get_type_hints


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
    naming `<section>.<field>`. (Through `load`, OmegaConf rejects such a value first; `config_io` words it alike.)"""
    for name, choices in literal_fields(type(obj)):
        one_of(getattr(obj, name), f"{section}.{name}", choices)


def _registry_of(key: str) -> tuple[Any, tuple[str, ...]]:
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
    from asyncrl.registry import UnknownName

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
