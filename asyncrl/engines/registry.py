"""`BACKENDS`: the rollout backends by the name `rollout.backend` gives, each the import path of its
`RolloutServer` class.

Job: the one list of backends. It holds import paths, not classes, so that checking a name (the config
does, at load) or building one backend (`backends.build_server`) imports nothing heavy (torch, vllm,
httpx) of the others; and it sits low in the layers (docs/layers.md) so that the config may read it.
A new backend is its module (a `RolloutServer` subclass with `from_config`) plus one line here.
Boundary: names only; nothing is imported or built here.

    >>> BACKENDS["torch"]
    'asyncrl.engines.torch_engine:TorchRolloutServer'
"""

from __future__ import annotations

from asyncrl.registry import Registry

BACKENDS: Registry[str] = Registry("rollout backend", "rollout.backend", import_paths=False)
BACKENDS.add("torch", "asyncrl.engines.torch_engine:TorchRolloutServer")
BACKENDS.add("vllm", "asyncrl.engines.vllm_engine:VLLMRolloutServer")
BACKENDS.add("openai", "asyncrl.engines.openai_server:OpenAIRolloutServer")
BACKENDS.add("cost_model", "asyncrl.engines.cost_model:CostModelServer")
