"""Parsers, the calculator, and choosing agents / tools / parsers / rewards by name or import path."""

from __future__ import annotations

import asyncio
import functools

import pytest

from agents.registry import build_agent, register_agent
from agents.rewards import get_reward
from agents.rewards.math import math_answer
from agents.single_turn import SingleTurnAgent
from agents.tool_agent import ToolAgent
from agents.tool_parsers import HermesParser, ToolCall, get_parser
from agents.tools import Calculator, PythonTool, build_tools, get_tool
from agents.tools.calculator import evaluate
from asyncrl.engines.base import SamplingParams
from tests.unit.agents.scripted import decode, encode


def test_hermes_parser_finds_every_call_in_order():
    text = ('think <tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call> then '
            '<tool_call>{"name": "b", "arguments": "{\\"y\\": [2]}"}</tool_call> done')
    assert HermesParser().parse(text) == [ToolCall("a", {"x": 1}), ToolCall("b", {"y": [2]})]
    assert HermesParser().parse("no calls here") == []
    bad = HermesParser().parse('<tool_call>{"name": "a", </tool_call><tool_call>{"name": "c"}')
    assert [c.error is not None for c in bad] == [True, True] and "not closed" in bad[1].error
    assert get_parser("qwen").parse('<tool_call>{"name": "z"}</tool_call>') == [ToolCall("z", {})]
    custom = get_parser("agents.tool_parsers:HermesParser", start="<call>", end="</call>")
    assert custom.parse('<call>{"name": "q"}</call>') == [ToolCall("q", {})]
    with pytest.raises(ValueError, match="unknown tool parser"):
        get_parser("nope")


@pytest.mark.parametrize(
    "expr, value",
    [("1 + 2 * 3", 7), ("(1 + 2) * 3", 9), ("2 ** 10", 1024), ("7 // 2", 3), ("-7 % 3", 2), ("sqrt(16)", 4.0),
     ("round(pi, 3)", 3.142), ("max(1, 5, 3)", 5), ("1 / 4", 0.25)],
)
def test_calculator_values(expr, value):
    assert evaluate(expr) == value


@pytest.mark.parametrize(
    "expr, error",
    [("__import__('os').system('true')", "unsupported"), ("().__class__", "unsupported"), ("'a' * 3", "unsupported"),
     ("9 ** 9 ** 9", "too large"), ("1 / 0", "ZeroDivisionError"), ("1 +", "SyntaxError"), ("x", "unsupported"),
     ("factorial(100000)", "too large")],
)
def test_calculator_refuses(expr, error):
    out = asyncio.run(Calculator()(expression=expr))
    assert out.startswith("Error:") and error in out


def test_tool_registry_and_specs():
    tools = build_tools(["calculator", {"name": "python", "wall_s": 3}])
    assert sorted(tools) == ["calculator", "python"] and tools["python"].limits.wall_s == 3
    assert isinstance(get_tool("agents.tools.calculator:Calculator"), Calculator)
    assert tools["calculator"].spec()["function"]["parameters"]["required"] == ["expression"]
    with pytest.raises(ValueError, match="unknown tool"):
        get_tool("nope")
    with pytest.raises(TypeError):
        PythonTool(not_a_limit=1)


def test_get_reward_binds_kwargs():
    from agents.rewards.reward_model import reward_model

    fn = get_reward("reward_model", url="http://127.0.0.1:1/score")
    assert isinstance(fn, functools.partial) and fn.func is reward_model and fn.keywords == {"url": "http://127.0.0.1:1/score"}
    with pytest.raises(TypeError, match="math_answer"):
        get_reward("math_answer", unused=1)  # an unknown keyword is an error, not swallowed
    assert get_reward("math_answer") is math_answer
    assert get_reward("agents.rewards.math:math_answer") is math_answer


def test_build_agent_by_name_and_import_path():
    common = dict(decode=decode, sampling=SamplingParams(max_tokens=8))
    agent = build_agent("tool", encode=encode, reward="math_answer", tools=["calculator"], max_turns=2, **common)
    assert isinstance(agent, ToolAgent) and agent.reward_fn is math_answer and list(agent.tools) == ["calculator"]
    agent = build_agent("agents.tool_agent:ToolAgent", encode=encode, reward="reward_model",
                        reward_kwargs={"url": "http://127.0.0.1:1/x"}, **common)
    assert agent.reward_fn.keywords == {"url": "http://127.0.0.1:1/x"}
    assert isinstance(build_agent("single_turn", reward="reverse_digits", **common), SingleTurnAgent)

    @register_agent("test_custom")
    def custom(**kwargs: object) -> SingleTurnAgent:
        return SingleTurnAgent(**kwargs)

    assert isinstance(build_agent("test_custom", reward_fn=math_answer, **common), SingleTurnAgent)
    with pytest.raises(ValueError, match="unknown agent"):
        build_agent("nope")
    with pytest.raises(ValueError, match="either 'reward'"):
        build_agent("single_turn", reward="math_answer", reward_fn=math_answer, **common)
    with pytest.raises(TypeError, match="not an AgentLoop"):
        build_agent("agents.tools.calculator:Calculator")
