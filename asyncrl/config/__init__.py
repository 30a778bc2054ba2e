"""The config of a run, in one import: the public surface of the `asyncrl.config` package.

    from asyncrl.config import load, TrainerConfig
    cfg = load("configs/demo.yaml", ["trainer.lr=3e-4"])

The names in `__all__` are the package's documented surface: the typed tree's dataclasses, its
`ConfigError`, and loading, saving and documenting it. They are imported here from the modules that
define them; this facade is the only place that gathers them, it is not a leftover of a split.
Anything else (the checks, the presets, the secret, the alias map) is imported from its own module.

The modules, lowest first; each imports only those above it in this list, never this `__init__`,
so the package has no import cycle, counting imports inside functions (docs/layers.md):

    checks     ConfigError and the checks every section runs (registries imported when checking)
    aliases    verl's key names and the hint an unknown key gets
    critic     critic.*, algorithm.kl_ctrl.*
    rollout    rollout.* (with the cost_model backend's and the autoscaler's settings)
    algorithm  algorithm.* (a policy loss's own settings: its dataclass in trainer/losses.py)
    tree       Config and the other sections: model, data, trainer, agent, logging, ray
    doc        the docstring reader, every key's table, the policy losses' table (`asyncrl config --doc`)
    io         load, load_with_changes, dump_resolved, to_dict, run_secret, the hardware=cpu preset
"""

from asyncrl.config.algorithm import AlgorithmConfig
from asyncrl.config.checks import ConfigError
from asyncrl.config.critic import CriticConfig, KLCtrlConfig
from asyncrl.config.doc import document
from asyncrl.config.io import dump_resolved, load, load_with_changes, to_dict
from asyncrl.config.rollout import AutoscaleConfig, CostModelConfig, RolloutConfig
from asyncrl.config.tree import (AgentConfig, Config, DataConfig, LoggingConfig, ModelConfig, RayConfig, TinyModelConfig,
                                 TrainerConfig)

__all__ = [
    "AgentConfig", "AlgorithmConfig", "AutoscaleConfig", "Config", "ConfigError", "CostModelConfig", "CriticConfig",
    "DataConfig", "KLCtrlConfig", "LoggingConfig", "ModelConfig", "RayConfig", "RolloutConfig", "TinyModelConfig",
    "TrainerConfig", "document", "dump_resolved", "load", "load_with_changes", "to_dict",
]
