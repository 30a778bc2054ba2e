"""ToolAgent loop mechanics against a scripted engine: exact tokens, masks, versions, log-probs, limits."""

from __future__ import annotations

import asyncio
import time

import pytest

from agents.rewards import get_reward
from agents.tool_agent import ToolAgent
from agents.tools import Tool
from asyncrl.engines.base import SamplingParams
from asyncrl.types import Trajectory
from tests.unit.agents.scripted import ScriptedLLM, Turn, decode, encode, make_sample, tool_call

CALL = "Let me compute. " + tool_call("calculator", expression="6*7")
FINAL = "The answer is \\boxed{42}."


def make_agent(**kwargs: object) -> ToolAgent:
    kwargs.setdefault("sampling", SamplingParams(max_tokens=200))
    kwargs.setdefault("tools", ["calculator"])
    kwargs.setdefault("reward_fn", get_reward("math_answer"))
    return ToolAgent(encode=encode, decode=decode, **kwargs)


def run(agent: ToolAgent, llm: ScriptedLLM, **kwargs: object) -> Trajectory:
    return asyncio.run(agent.run(make_sample(**kwargs), llm))


def test_one_tool_call_masks_versions_logprobs_exactly():
    llm = ScriptedLLM([Turn(CALL, version=3), Turn(FINAL, version=4)])
    traj = run(make_agent(), llm)
    t1, tool, t2 = encode(CALL), encode("\n<tool_response>\n42\n</tool_response>\n"), encode(FINAL)
    assert traj.response_ids == t1 + tool + t2
    assert traj.loss_mask == [1] * len(t1) + [0] * len(tool) + [1] * len(t2)
    assert traj.token_versions == [3] * len(t1) + [-1] * len(tool) + [4] * len(t2)
    assert traj.behavior_logprobs == pytest.approx(
        ScriptedLLM.logprobs_of_call(0, len(t1)) + [0.0] * len(tool) + ScriptedLLM.logprobs_of_call(1, len(t2)))
    assert (traj.min_version, traj.max_version) == (3, 4)
    assert llm.contexts[1] == encode("Q: 6*7?\n") + t1 + tool  # the second turn sees everything before it
    assert traj.reward == 1.0 and traj.finish_reason == "stop"
    assert {k: traj.meta[k] for k in ("turns", "tool_calls", "tool_errors", "stop")} == {
        "turns": 2, "tool_calls": 1, "tool_errors": 0, "stop": "done"}
    assert traj.meta["tool_tokens"] == len(tool) == len(traj.loss_mask) - traj.num_generated_tokens
    assert {"generate", "tools", "reward", "created"} <= set(traj.timings)
    back = Trajectory.from_bytes(traj.to_bytes())  # the wire record keeps the invariants
    assert (back.response_ids, back.loss_mask, back.token_versions) == (traj.response_ids, traj.loss_mask, traj.token_versions)
    assert back.behavior_logprobs == pytest.approx(traj.behavior_logprobs) and back.meta == traj.meta


def test_turn_limit_stops_before_running_the_last_call():
    llm = ScriptedLLM([Turn(CALL, version=v) for v in range(10)])
    traj = run(make_agent(max_turns=3), llm)
    assert len(llm.contexts) == 3
    assert traj.meta["turns"] == 3 and traj.meta["tool_calls"] == 2 and traj.meta["stop"] == "max_turns"
    assert traj.finish_reason == "length"
    n = len(encode(CALL))
    assert traj.loss_mask[-n:] == [1] * n  # the last turn's call got no tool turn
    assert sorted(set(traj.token_versions)) == [-1, 0, 1, 2]


def test_per_turn_budget_caps_each_generate():
    llm = ScriptedLLM([Turn("x" * 50)])
    traj = run(make_agent(sampling=SamplingParams(max_tokens=10)), llm)
    assert llm.samplings[0].max_tokens == 10 and len(traj.response_ids) == 10
    assert traj.meta["stop"] == "turn_budget" and traj.finish_reason == "length"


def test_per_turn_budget_still_runs_a_complete_call():
    llm = ScriptedLLM([Turn(CALL + " and more words after it"), Turn(FINAL)])
    traj = run(make_agent(sampling=SamplingParams(max_tokens=len(encode(CALL)) + 3)), llm)
    assert traj.meta["tool_calls"] == 1 and traj.meta["turns"] == 2 and traj.reward == 1.0


def test_total_budget_counts_tool_tokens_and_shrinks_later_turns():
    n1, ntool = len(encode(CALL)), len(encode("\n<tool_response>\n42\n</tool_response>\n"))
    llm = ScriptedLLM([Turn(CALL), Turn(FINAL)])
    traj = run(make_agent(max_response_tokens=n1 + ntool + 5), llm)
    assert llm.samplings[1].max_tokens == 5  # what was left after turn 1 and the tool turn
    assert len(traj.response_ids) == n1 + ntool + 5
    assert traj.meta["stop"] == "total_budget" and traj.finish_reason == "length"
    # a budget that ends inside the tool turn: tool tokens cut, still masked
    llm = ScriptedLLM([Turn(CALL), Turn(FINAL)])
    traj = run(make_agent(max_response_tokens=n1 + 4), llm)
    assert len(llm.contexts) == 1 and traj.loss_mask == [1] * n1 + [0] * 4 and traj.token_versions[-4:] == [-1] * 4
    assert traj.meta["stop"] == "total_budget"


@pytest.mark.parametrize(
    "text, error",
    [
        ('<tool_call>{"name": "calculator", "arguments": {"expression": </tool_call>', "Error: invalid JSON"),
        ('<tool_call>{"arguments": {}}</tool_call>', 'Error: a tool call must be a JSON object with a "name"'),
        ('<tool_call>{"name": "calculator", "arguments": [1]}</tool_call>', 'Error: "arguments" must be a JSON object'),
        ('<tool_call>{"name": "calculator"', "Error: tool call not closed"),
        (tool_call("nope", x=1), "Error: unknown tool 'nope'; available: ['calculator']"),
        (tool_call("calculator", expr="1"), "Error: bad arguments for tool 'calculator'"),
        (tool_call("calculator", expression="__import__('os')"), "Error: ValueError: unsupported expression"),
    ],
)
def test_malformed_calls_become_error_responses(text, error):
    llm = ScriptedLLM([Turn(text), Turn(FINAL)])
    traj = run(make_agent(), llm)
    tool_text = decode([t for t, m in zip(traj.response_ids, traj.loss_mask) if m == 0])
    assert error in tool_text
    assert traj.meta["tool_errors"] == 1 and traj.meta["turns"] == 2 and traj.reward == 1.0


class Boom(Tool):
    name = "boom"

    async def __call__(self, **arguments: object) -> str:
        raise RuntimeError("tool exploded")


class Slow(Tool):
    name = "slow"

    async def __call__(self, s: float = 0.3) -> str:
        await asyncio.sleep(s)
        return f"slept {s}"


def test_raising_and_hanging_tools_become_errors_and_calls_run_concurrently():
    llm = ScriptedLLM([Turn(tool_call("boom") + tool_call("slow", s=30) + tool_call("slow") + tool_call("slow")), Turn(FINAL)])
    agent = make_agent(tools=[Boom(), Slow()], tool_timeout_s=0.6, sampling=SamplingParams(max_tokens=1000))
    t = time.monotonic()
    traj = run(agent, llm)
    assert time.monotonic() - t < 2.0  # 0.6 s timeout and two 0.3 s calls side by side, not 30.9 s
    tool_text = decode([t for t, m in zip(traj.response_ids, traj.loss_mask) if m == 0])
    assert "Error: tool 'boom' failed: RuntimeError: tool exploded" in tool_text
    assert "Error: tool 'slow' timed out after 0.6s" in tool_text
    assert tool_text.count("slept 0.3") == 2
    assert traj.meta["tool_calls"] == 4 and traj.meta["tool_errors"] == 2


def test_too_many_calls_in_one_turn_are_refused():
    llm = ScriptedLLM([Turn(tool_call("calculator", expression="1+1") * 3), Turn(FINAL)])
    traj = run(make_agent(max_tool_calls_per_turn=2, sampling=SamplingParams(max_tokens=1000)), llm)
    tool_text = decode([t for t, m in zip(traj.response_ids, traj.loss_mask) if m == 0])
    assert tool_text.count("\n2\n") == 2 and "more than 2 tool calls" in tool_text


def test_abort_ends_the_rollout_as_abort():
    llm = ScriptedLLM([Turn("partial", finish_reason="abort")])
    traj = run(make_agent(), llm)
    assert traj.finish_reason == "abort" and traj.meta["stop"] == "abort" and len(llm.contexts) == 1


def test_reward_failures_inside_the_loop_are_counted():
    def boom(response: str, answer: str) -> float:
        raise ValueError("bad reward")

    async def hang(response: str, answer: str) -> float:
        await asyncio.sleep(30)
        return 1.0

    traj = run(make_agent(reward_fn=boom), ScriptedLLM([Turn(FINAL)]))
    assert traj.reward == 0.0 and traj.reward_info == {"failed": "ValueError: bad reward"}
    t = time.monotonic()
    traj = run(make_agent(reward_fn=hang, reward_timeout_s=0.2), ScriptedLLM([Turn(FINAL)]))
    assert traj.reward_info == {"failed": "timeout"} and time.monotonic() - t < 2.0


def test_last_turn_reward_text_and_per_sample_tools():
    seen: list[str] = []
    llm = ScriptedLLM([Turn(tool_call("slow", s=0.01)), Turn("done 42")])
    agent = make_agent(reward_fn=lambda r, a: seen.append(r) or 1.0, reward_text="last_turn")
    traj = asyncio.run(agent.run(make_sample(), llm, tools=[Slow()]))
    assert seen == ["done 42"] and traj.meta["tool_errors"] == 0


def test_bad_settings_name_the_key():
    with pytest.raises(ValueError, match="max_turns"):
        make_agent(max_turns=0)
    with pytest.raises(ValueError, match="two tools named"):
        make_agent(tools=["calculator", {"name": "calculator"}])
