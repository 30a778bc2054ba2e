"""The config of a run, in one import: the typed tree (`config_tree` and its sections in
`config_algorithm`, `config_critic`, `config_rollout`), its checks' `ConfigError`, and loading,
saving and documenting it (`config_io`).

    from asyncrl.config import load, TrainerConfig
    cfg = load("configs/demo.yaml", ["trainer.lr=3e-4"])

A facade only: the modules below never import it, so the tree, its checks and its loader form no
import cycle (docs/layers.md).
"""

from asyncrl.config_checks import ConfigError  # noqa: F401
from asyncrl.config_io import document, dump_resolved, load, to_dict  # noqa: F401
from asyncrl.config_tree import *  # noqa: F401,F403
from asyncrl.config_tree import MODES, Mode  # noqa: F401
