"""Tool-call parsers: find the tool calls in one model turn's text.

A parser turns text into a list of `ToolCall`s. A call that cannot be understood (bad
JSON, no name, arguments not an object) is still returned, with `error` set: the agent
loop answers it with an error message to the model instead of failing the rollout.

Built in: `hermes` (Qwen2.5 / Qwen3 / Hermes chat templates)::

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "2 + 3"}}
    </tool_call>

More formats: subclass `ToolParser` and decorate with `@register_parser("name")`, or
give an import path (`package.module:MyParser`) in config (both through `PARSERS`, an
`asyncrl.registry.Registry`).
"""

from __future__ import annotations

import abc
import json
import re
from dataclasses import dataclass, field
from typing import Any, Callable

from asyncrl.registry import Registry


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    """Why the call could not be parsed; the loop sends it back to the model as the tool response."""


class ToolParser(abc.ABC):
    @abc.abstractmethod
    def parse(self, text: str) -> list[ToolCall]:
        """Every tool call in `text` (one model turn), in order; [] when there is none."""


PARSERS: Registry[Callable[..., ToolParser]] = Registry("tool parser", "agent.kwargs.parser")


def register_parser(name: str) -> Callable[[Callable[..., ToolParser]], Callable[..., ToolParser]]:
    """Class decorator: `@register_parser("my_format")` makes the parser selectable by name (a name is taken once)."""
    return PARSERS.register(name)


def get_parser(name: str, **kwargs: Any) -> ToolParser:
    """A registered parser name, or a `module:ClassName` import path, built with `kwargs`."""
    return PARSERS.get(name)(**kwargs)


def call_from_json(payload: str) -> ToolCall:
    """`{"name": ..., "arguments": {...}}` (arguments may also be a JSON string, as some models write)."""
    try:
        obj = json.loads(payload)
    except json.JSONDecodeError as e:
        return ToolCall(name="", error=f"invalid JSON in tool call: {e.msg} at position {e.pos}")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return ToolCall(name="", error='a tool call must be a JSON object with a "name" string')
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            return ToolCall(name=obj["name"], error=f"arguments are not valid JSON: {e.msg}")
    if not isinstance(args, dict):
        return ToolCall(name=obj["name"], error='"arguments" must be a JSON object')
    return ToolCall(name=obj["name"], arguments=args)


@register_parser("hermes")
class HermesParser(ToolParser):
    """`<tool_call>{json}</tool_call>` blocks; an opened block that is never closed counts as a malformed call."""

    def __init__(self, start: str = "<tool_call>", end: str = "</tool_call>") -> None:
        self.start, self.end = start, end
        self._block = re.compile(re.escape(start) + r"(.*?)" + re.escape(end), re.DOTALL)

    def parse(self, text: str) -> list[ToolCall]:
        calls = [call_from_json(m.group(1).strip()) for m in self._block.finditer(text)]
        tail = text[text.rfind(self.end) + len(self.end):] if self.end in text else text
        if self.start in tail:
            calls.append(ToolCall(name="", error=f"tool call not closed with {self.end}"))
        return calls


PARSERS.add("qwen", HermesParser)
