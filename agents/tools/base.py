"""Tools an agent may call: the `Tool` base class and a registry by name.

A tool has a `name`, a `description` and a JSON-schema `parameters` object (what a chat
template shows the model), and `async __call__(**arguments) -> str`. It may raise: the agent
loop turns any exception or timeout into an error message for the model (`call_tool`),
so a failing tool never ends a rollout; except `ToolUnavailable` (this host cannot run the tool
at all, e.g. the sandbox cannot isolate code), which propagates: no model could fix it. Tools are chosen by name from config
(`get_tool("python", wall_s=5)`) or by import path (`package.module:ClassName`) through `TOOLS`, an
`asyncrl.registry.Registry`.
"""

from __future__ import annotations

import abc
import asyncio
from typing import Any, Callable

from asyncrl.registry import Registry


class ToolUnavailable(RuntimeError):
    """The host cannot run this tool at all (not the model's fault): `call_tool` lets it propagate."""


class Tool(abc.ABC):
    name: str = ""
    description: str = ""
    parameters: dict[str, Any] = {"type": "object", "properties": {}}
    """JSON schema of the arguments, as in OpenAI / Qwen function specs."""

    @abc.abstractmethod
    async def __call__(self, **arguments: Any) -> str: ...

    def spec(self) -> dict[str, Any]:
        """The function spec a chat template puts in the system prompt."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


TOOLS: Registry[Callable[..., Tool]] = Registry("tool", "agent.kwargs.tools")


def register_tool(name: str) -> Callable[[Callable[..., Tool]], Callable[..., Tool]]:
    """Class decorator: `@register_tool("calculator")` makes the tool buildable by name (a name is taken once)."""
    return TOOLS.register(name)


def get_tool(name: str, **kwargs: Any) -> Tool:
    """Build a registered tool, or a `module:ClassName` import path, with its keyword settings."""
    return TOOLS.get(name)(**kwargs)


def build_tools(specs: list[Any]) -> dict[str, Tool]:
    """Tools from config: each a `Tool`, a name / import path, or `{"name": ..., **kwargs}`."""
    out: dict[str, Tool] = {}
    for s in specs:
        if isinstance(s, str):
            tool = get_tool(s)
        elif isinstance(s, dict):
            kwargs = dict(s)
            if "name" not in kwargs:
                typo = any(":" in str(k) for k in kwargs)  # YAML reads `{name:python}` as one key `name:python`
                raise ValueError(f"a tool mapping needs a 'name', got {s!r}" + (" (YAML wants a space after each colon: "
                                 "{name: python})" if typo else ""))
            tool = get_tool(kwargs.pop("name"), **kwargs)
        elif isinstance(s, Tool):
            tool = s
        else:
            raise ValueError(f"tool spec must be a Tool, a name or a mapping with 'name', got {s!r}")
        if tool.name in out:
            raise ValueError(f"two tools named {tool.name!r}")
        out[tool.name] = tool
    return out


async def call_tool(tool: Tool | None, name: str, arguments: dict[str, Any], timeout_s: float) -> tuple[str, bool]:
    """Run one call; returns (text for the model, ok). Every failure becomes an error text."""
    if tool is None:
        return f"Error: unknown tool {name!r}", False
    try:
        async with asyncio.timeout(timeout_s):  # not wait_for: on 3.11 it can swallow a cancel
            out = await tool(**arguments)
    except ToolUnavailable:
        raise
    except asyncio.TimeoutError:
        return f"Error: tool {name!r} timed out after {timeout_s:g}s", False
    except TypeError as e:  # wrong or missing arguments
        return f"Error: bad arguments for tool {name!r}: {e}", False
    except Exception as e:  # a tool's own failure: the model reads it and may retry
        return f"Error: tool {name!r} failed: {type(e).__name__}: {e}", False
    return str(out), not str(out).startswith("Error:")
