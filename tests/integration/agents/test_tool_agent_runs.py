"""ToolAgent end to end: against the real torch engine (tiny model), and many loops whose tools misbehave.

The tiny random model never writes a valid tool call, so the first turn is scripted (a
calculator call) and every later turn comes from the real `TorchRolloutServer`: the point
is that the real engine path works across turns and the trajectory invariants hold, with
the engine's log-probs equal to a teacher-forced forward over the whole multi-turn context.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import torch

from agents.base import LLMClient
from agents.rewards import get_reward
from agents.tool_agent import ToolAgent
from asyncrl.engines.base import GenerateOutput, SamplingParams
from asyncrl.engines.torch_engine import TorchRolloutServer
from tests.unit.agents.scripted import ScriptedLLM, Turn, decode, encode, make_sample, tool_call

FIRST_TURN = "I will use the calculator. " + tool_call("calculator", expression="12*12")


class EngineClient:
    """`LLMClient` over one server (what the fleet's router provides in a run)."""

    def __init__(self, server: TorchRolloutServer) -> None:
        self.server = server

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams, session_id: str | None = None) -> GenerateOutput:
        return await self.server.generate(prompt_ids, sampling)


class ScriptedThenReal:
    """First call answered by `first` (a scripted tool call), every later call by `real`."""

    def __init__(self, first: ScriptedLLM, real: LLMClient) -> None:
        self.first, self.real, self.calls = first, real, 0

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams, session_id: str | None = None) -> GenerateOutput:
        self.calls += 1
        llm = self.first if self.calls == 1 else self.real
        return await llm.generate(prompt_ids, sampling, session_id)


def test_tool_agent_against_the_torch_engine(tiny_model: Path):
    from asyncrl.data.tiny_model import build_tokenizer
    from transformers import AutoModelForCausalLM

    tok = build_tokenizer()
    tok_encode = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    tok_decode = lambda ids: tok.decode(ids)  # noqa: E731
    agent = ToolAgent(encode=tok_encode, decode=tok_decode, reward_fn=get_reward("math_answer"),
                      sampling=SamplingParams(max_tokens=128, temperature=1.0, seed=7), tools=["calculator"],
                      max_turns=3, max_response_tokens=400)
    sample = make_sample("Q: what is 12*12?\nA: ", answer="144")
    sample.prompt_ids = tok_encode("Q: what is 12*12?\nA: ")

    async def go():
        server = TorchRolloutServer(tiny_model, seed=0, threads=1)
        try:
            llm = ScriptedThenReal(ScriptedLLM([Turn(FIRST_TURN)], tokenize=tok_encode), EngineClient(server))
            first = await agent.run(sample, llm)
            llm = ScriptedThenReal(ScriptedLLM([Turn(FIRST_TURN)], tokenize=tok_encode), EngineClient(server))
            second = await agent.run(sample, llm)
            return first, second
        finally:
            await server.close()

    traj, again = asyncio.run(go())
    traj.validate()
    n1 = len(tok_encode(FIRST_TURN))
    tool_ids = tok_encode("\n<tool_response>\n144\n</tool_response>\n")
    assert traj.response_ids[:n1] == tok_encode(FIRST_TURN)
    assert traj.response_ids[n1 : n1 + len(tool_ids)] == tool_ids
    assert traj.loss_mask[:n1] == [1] * n1 and traj.loss_mask[n1 : n1 + len(tool_ids)] == [0] * len(tool_ids)
    rest = slice(n1 + len(tool_ids), None)
    assert traj.loss_mask[rest] == [1] * len(traj.response_ids[rest]) and len(traj.response_ids[rest]) >= 1
    assert traj.token_versions[n1 : n1 + len(tool_ids)] == [-1] * len(tool_ids)
    assert set(traj.token_versions[rest]) == {0} and (traj.min_version, traj.max_version) == (0, 0)
    assert traj.meta["turns"] >= 2 and traj.meta["tool_calls"] >= 1 and traj.meta["tool_errors"] == 0
    assert (again.response_ids, again.behavior_logprobs) == (traj.response_ids, traj.behavior_logprobs)  # seeded

    # the engine's log-probs of turn 2 are those of the model over prompt + turn 1 + tool turn
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32).eval()
    turn2 = traj.response_ids[rest][:128]
    context = traj.prompt_ids + traj.response_ids[: n1 + len(tool_ids)]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([context + turn2])).logits[0, len(context) - 1 : -1]
    ref = torch.log_softmax(logits, -1).gather(1, torch.tensor(turn2).unsqueeze(1)).squeeze(1)
    got = torch.tensor(traj.behavior_logprobs[n1 + len(tool_ids) :][: len(turn2)])
    assert torch.allclose(got, ref, atol=1e-4)
    assert tok_decode(traj.response_ids).startswith(FIRST_TURN)


BOMBS = {
    "loop": "while True:\n    pass",
    "memory": "x = []\nwhile True:\n    x.append(bytearray(50 * 2**20))",
    "fork": "import os\nwhile True:\n    try:\n        os.fork()\n    except Exception:\n        pass",
    "network": "import socket\nsocket.create_connection(('10.255.255.1', 80), timeout=30)",
}


def test_many_loops_with_misbehaving_tools_keep_going():
    limits = {"name": "python", "wall_s": 2.0, "cpu_s": 1, "memory_mb": 256, "max_processes": 4}
    agent = ToolAgent(encode=encode, decode=decode, reward_fn=get_reward("math_answer"),
                      sampling=SamplingParams(max_tokens=400), tools=[limits], max_turns=3)

    async def go():
        runs = []
        for i, code in enumerate([*BOMBS.values(), "print(6 * 7)"]):
            llm = ScriptedLLM([Turn(tool_call("python", code=code)), Turn("so #### 42")])
            runs.append(agent.run(make_sample(uid=f"s{i}", index=i, size=len(BOMBS) + 1), llm))
        return await asyncio.gather(*runs)

    t = time.monotonic()
    trajs = asyncio.run(go())
    assert time.monotonic() - t < 15.0  # concurrent, each bounded by its 2 s wall clock
    for traj, name in zip(trajs, [*BOMBS, "ok"]):
        tool_text = decode([t for t, m in zip(traj.response_ids, traj.loss_mask) if m == 0])
        assert traj.meta["turns"] == 2 and traj.reward == 1.0, name
        if name == "ok":
            assert traj.meta["tool_errors"] == 0 and "42" in tool_text
        else:
            assert traj.meta["tool_errors"] == 1 and "Error:" in tool_text, (name, tool_text)
