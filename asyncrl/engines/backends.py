"""`build_server`: one `RolloutServer` of the backend `rollout.backend` names.

Job: look the name up in `BACKENDS` (registry.py), import that backend's module only then, and let its
class build itself from the config (`RolloutServer.from_config`). No backend is named here: a new one
is its module plus its line in registry.py. Boundary: builds, never starts or places: local fleets are
`asyncrl/rollout/fleet_build.py`'s, Ray actors `asyncrl/rollout/server_actor.py`'s (both call this,
neither is called back).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from asyncrl.engines.base import RolloutServer
from asyncrl.engines.registry import BACKENDS

if TYPE_CHECKING:
    from asyncrl.config import RolloutConfig


def build_server(cfg: RolloutConfig, model_path: str, *, dtype: str, seed: int, index: int = 0,
                 log_dir: str | None = None) -> RolloutServer:
    """Server `index` of a fleet of `cfg.backend`. `log_dir` (the run directory) receives engine
    logs that would otherwise flood the console (vLLM: `vllm.log`). An unknown name is the
    registry's `UnknownName` (a `ValueError` naming `rollout.backend`)."""
    module, _, attr = BACKENDS.get(cfg.backend).partition(":")
    cls: type[RolloutServer] = getattr(importlib.import_module(module), attr)
    return cls.from_config(cfg, model_path, dtype=dtype, seed=seed, index=index, log_dir=log_dir)
