"""The rollout engines: `RolloutServer` (base.py) and its backends, one module each (torch, vLLM,
OpenAI-compatible servers, the simulated cost model), named in registry.py and built by backends.py.

Below `agents` (docs/layers.md): an AgentLoop talks to a `RolloutServer` and hands out `Sample`s, so
this package knows nothing of agents, hosts, fleets or routing (those are `asyncrl/rollout/`'s).
Import-free on purpose: `asyncrl.engines.registry` sits two layers lower and is imported by config.
"""
