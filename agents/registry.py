"""Agent loops by name or import path, built from config with keyword settings.

`build_agent("tool", encode=..., decode=..., sampling=..., reward="math_answer",
tools=["python", {"name": "calculator"}])` builds a `ToolAgent`; `"single_turn"` a
`SingleTurnAgent`; `"my_pkg.agents:MyLoop"` any class or factory returning an `AgentLoop`.
A `reward` given as a name or import path (with `reward_kwargs`) is resolved through
`agents.rewards.get_reward` and passed on as `reward_fn` (and its name as `reward_name`, to
factories that take it, so errors such as `RewardBroken` name it as configured), so config can
stay plain data.
Register more with `@register_agent("name")`. `AGENTS` is an `asyncrl.registry.Registry` (the
`module:attr` lookup and the unknown-name error naming `agent.name` live there).
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

from agents.base import AgentLoop
from agents.rewards import get_reward
from agents.single_turn import SingleTurnAgent
from agents.tool_agent import ToolAgent
from asyncrl.registry import Registry

AGENTS: Registry[Callable[..., AgentLoop]] = Registry("agent", "agent.name")
AGENTS.add("single_turn", SingleTurnAgent)
AGENTS.add("tool", ToolAgent)


def register_agent(name: str) -> Callable[[Callable[..., AgentLoop]], Callable[..., AgentLoop]]:
    """Decorator: `@register_agent("my_loop")` makes a class or factory selectable by name (a name is taken once)."""
    return AGENTS.register(name)


def accepts(factory: Callable[..., Any], key: str) -> bool:
    """Whether `factory` takes keyword `key` (by name or through `**kwargs`)."""
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return False
    return key in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def build_agent(name_or_path: str, **kwargs: Any) -> AgentLoop:
    """Build an agent loop; `reward` (+ `reward_kwargs`) becomes `reward_fn`."""
    factory = AGENTS.get(name_or_path)
    if "reward" in kwargs:
        if "reward_fn" in kwargs:
            raise ValueError("give an agent either 'reward' (a name or import path) or 'reward_fn', not both")
        name = kwargs.pop("reward")
        kwargs["reward_fn"] = get_reward(name, **kwargs.pop("reward_kwargs", {}))
        if accepts(factory, "reward_name"):
            kwargs.setdefault("reward_name", name)
    elif "reward_kwargs" in kwargs:
        raise ValueError("'reward_kwargs' given without 'reward'")
    agent = factory(**kwargs)
    if not isinstance(agent, AgentLoop):
        raise TypeError(f"agent {name_or_path!r} built a {type(agent).__name__}, not an AgentLoop")
    return agent
