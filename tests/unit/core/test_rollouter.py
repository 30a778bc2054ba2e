"""The Rollouter under admission control, with a scripted LLM (stands in for a model whose outputs we control)."""

import asyncio

from agents.single_turn import SingleTurnAgent
from asyncrl.data.datasets import Prompt, PromptSet, PromptStream
from asyncrl.rollout.base import GenerateOutput, SamplingParams
from asyncrl.rollout.rollouter import Rollouter
from asyncrl.staleness import StalenessManager


class ScriptedLLM:
    async def generate(self, prompt_ids, sampling, session_id=None):
        await asyncio.sleep(0.001)
        return GenerateOutput("r", [7, 8], [-0.5, -0.25], [0, 0], "stop")


def test_failing_rewards_are_counted_and_the_rollouter_keeps_going():
    def reward(response, answer):
        if answer == "bad":
            raise RuntimeError("reward crashed")
        return 1.0

    async def go():
        prompts = PromptSet([Prompt(i, "q", [1, 2], "bad" if i % 2 else "ok") for i in range(6)])
        staleness = StalenessManager(batch_groups=4, eta=0)
        queued = []

        async def sink(group):
            queued.append(group)

        agent = SingleTurnAgent(decode=lambda ids: "x", reward_fn=reward, sampling=SamplingParams())
        r = Rollouter(agent=agent, llm=ScriptedLLM(), prompts=PromptStream(prompts, seed=0), staleness=staleness,
                      sink=sink, group_size=3)
        task = asyncio.create_task(r.run())
        while len(queued) < 4:  # failed groups free their admission slot, so good ones keep coming
            await asyncio.sleep(0.01)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return r, staleness, queued

    r, staleness, queued = asyncio.run(go())
    assert staleness.dropped["reward_failed"] >= 1 and r.reward_failures >= 3
    assert all(t.reward == 1.0 and "failed" not in t.reward_info for g in queued for t in g)
    t = queued[0][0]
    assert t.response_ids == [7, 8] and t.loss_mask == [1, 1] and t.behavior_logprobs == [-0.5, -0.25]


def test_an_agent_loop_error_stops_the_rollouter_loudly():
    class Broken:
        async def run(self, sample, llm):
            raise ValueError("agent bug")

    async def go():
        prompts = PromptSet([Prompt(0, "q", [1], "a")])
        r = Rollouter(agent=Broken(), llm=ScriptedLLM(), prompts=PromptStream(prompts, seed=0),
                      staleness=StalenessManager(batch_groups=2, eta=0), sink=None, group_size=2)
        await asyncio.wait_for(r.run(), 5)

    try:
        asyncio.run(go())
    except ValueError as e:
        assert "agent bug" in str(e)
    else:
        raise AssertionError("the rollouter swallowed an agent error")
