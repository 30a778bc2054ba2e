"""The config tree's error type and its checks: a bad value fails at load with the key to change.

Shared by the modules of the config tree (`config.py`, `config_rollout.py`); `ConfigError` is
re-exported by `asyncrl.config`.
"""

from __future__ import annotations

from typing import Sequence


class ConfigError(ValueError):
    """A config value that cannot be used; the message names the key."""


def check(ok: bool, key: str, msg: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {msg}")


def one_of(value: str, key: str, choices: Sequence[str]) -> None:
    check(value in choices, key, f"must be one of {list(choices)}, got {value!r}")
