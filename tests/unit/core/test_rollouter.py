"""The Rollouter under admission control, with a scripted LLM (stands in for a model whose outputs we
control): each sample runs an agent against it and writes the trajectory into a local data plane, as a
server's host does; the rollouter sees the queue records only."""

import asyncio

import pytest

from agents.single_turn import SingleTurnAgent
from asyncrl.data.datasets import Prompt, PromptSet, PromptStream
from asyncrl.engines.base import GenerateOutput, SamplingParams
from asyncrl.rollout.rollouter import Rollouter
from asyncrl.staleness import StalenessManager
from asyncrl.trajectory_queue import from_record, trajectory_sample
from transfer_queue.storage.local import LocalStorage


def _runner(agent, llm, plane):
    async def run(sample):
        return trajectory_sample(plane, await agent.run(sample, llm))

    return run


async def _discard(group):
    return None


class ScriptedLLM:
    async def generate(self, prompt_ids, sampling, session_id=None):
        await asyncio.sleep(0.001)
        return GenerateOutput("r", [7, 8], [-0.5, -0.25], [0, 0], "stop")


def test_failing_rewards_are_counted_and_the_rollouter_keeps_going():
    def reward(response, answer):
        if answer == "bad":
            raise RuntimeError("reward crashed")
        return 1.0

    plane = LocalStorage(inline_max_bytes=0)

    async def go():
        prompts = PromptSet([Prompt(i, "q", [1, 2], "bad" if i % 2 else "ok") for i in range(6)])
        staleness = StalenessManager(batch_groups=4, eta=0)
        queued = []

        async def sink(group):
            queued.append(group)

        agent = SingleTurnAgent(decode=lambda ids: "x", reward_fn=reward, sampling=SamplingParams())
        freed = []

        async def discard(group):
            freed.append(group)

        r = Rollouter(run_sample=_runner(agent, ScriptedLLM(), plane), prompts=PromptStream(prompts, seed=0), staleness=staleness,
                      sink=sink, discard=discard, group_size=3)
        task = asyncio.create_task(r.run())
        while len(queued) < 4:  # failed groups free their admission slot, so good ones keep coming
            await asyncio.sleep(0.01)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return r, staleness, queued, freed

    r, staleness, queued, freed = asyncio.run(go())
    assert staleness.dropped["reward_failed"] >= 1 and r.reward_failures >= 3
    assert len(freed) == staleness.dropped["reward_failed"] and all("failed" in m.meta["reward_info"] for g in freed for m in g)
    assert all(m.meta["reward"] == 1.0 and "failed" not in m.meta["reward_info"] for g in queued for m in g)
    m = queued[0][0]
    t = from_record(m.meta, dict(zip(m.handles, plane.read(list(m.handles.values())))))
    assert t.response_ids == [7, 8] and t.loss_mask == [1, 1] and t.behavior_logprobs == [-0.5, -0.25]
    assert all(h["plane"] == "local" for h in m.handles.values())  # every array went to the plane, none inline


def test_an_agent_loop_error_stops_the_rollouter_loudly():
    class Broken:
        async def run(self, sample, llm):
            raise ValueError("agent bug")

    async def go():
        prompts = PromptSet([Prompt(0, "q", [1], "a")])
        r = Rollouter(run_sample=_runner(Broken(), ScriptedLLM(), LocalStorage()), prompts=PromptStream(prompts, seed=0),
                      staleness=StalenessManager(batch_groups=2, eta=0), sink=None, discard=_discard, group_size=2)
        await asyncio.wait_for(r.run(), 5)

    try:
        asyncio.run(go())
    except ValueError as e:
        assert "agent bug" in str(e)
    else:
        raise AssertionError("the rollouter swallowed an agent error")


def test_admission_waits_for_a_free_fleet_slot():
    class Gate:
        """An LLM whose requests run until released; records how many run at once."""

        def __init__(self):
            self.running, self.most = 0, 0
            self.release = asyncio.Event()

        async def generate(self, prompt_ids, sampling, session_id=None):
            self.running += 1
            self.most = max(self.most, self.running)
            await self.release.wait()
            self.running -= 1
            return GenerateOutput("r", [7], [-0.5], [0], "stop")

    async def go():
        prompts = PromptSet([Prompt(i, "q", [1, 2], "ok") for i in range(8)])
        staleness = StalenessManager(batch_groups=8, eta=0)  # the staleness rule alone admits 8 groups
        queued = []

        async def sink(group):
            queued.append(group)

        llm = Gate()
        agent = SingleTurnAgent(decode=lambda ids: "x", reward_fn=lambda r, a: 1.0, sampling=SamplingParams())
        r = Rollouter(run_sample=_runner(agent, llm, LocalStorage()), prompts=PromptStream(prompts, seed=0), staleness=staleness,
                      sink=sink, discard=_discard, group_size=2, max_running_samples=3)
        task = asyncio.create_task(r.run())
        await asyncio.sleep(0.05)
        started_while_full = staleness.running
        llm.release.set()
        while len(queued) < 8:
            await asyncio.sleep(0.01)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return started_while_full, llm.most, r.running_samples

    started, most, left = asyncio.run(go())
    assert started == 2 and most == 4  # a group starts while a slot is free: 2 + 2 samples on 3 slots
    assert left == 0


class _RewardByAnswer:
    """An agent whose reward is scripted per prompt: answer "same" gives every sample 1.0 (no
    advantage signal), "mixed" gives index_in_group % 2 (a group with signal)."""

    async def run(self, sample, llm):
        from asyncrl.types import Trajectory

        await asyncio.sleep(0.001)
        r = 1.0 if sample.answer == "same" else float(sample.index_in_group % 2)
        return Trajectory(uid=sample.uid, group_id=sample.group_id, index_in_group=sample.index_in_group,
                          group_size=sample.group_size, prompt_ids=list(sample.prompt_ids), response_ids=[7, 8],
                          behavior_logprobs=[-0.5, -0.25], loss_mask=[1, 1], token_versions=[0, 0],
                          min_version=0, max_version=0, reward=r)


def _run_until_queued(filter_groups, groups):
    plane = LocalStorage(inline_max_bytes=0)

    async def go():
        prompts = PromptSet([Prompt(i, "q", [1, 2], "same" if i % 2 else "mixed") for i in range(6)])
        staleness = StalenessManager(batch_groups=groups, eta=0)  # version 0 stays: admission stops at `groups` accepted
        queued, freed = [], []

        async def sink(group):
            queued.append(group)

        async def discard(group):
            freed.append(group)

        r = Rollouter(run_sample=_runner(_RewardByAnswer(), None, plane), prompts=PromptStream(prompts, seed=0),
                      staleness=staleness, sink=sink, discard=discard, group_size=2, filter_groups=filter_groups)
        task = asyncio.create_task(r.run())
        while len(queued) < groups:
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.05)  # nothing more may start once the batch is full
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return staleness, queued, freed

    return asyncio.run(go())


@pytest.mark.timeout(20)
def test_filter_groups_drops_equal_reward_groups_counted_and_refills_the_batch():
    staleness, queued, freed = _run_until_queued(filter_groups=True, groups=3)
    # 3 "mixed" groups fill the batch; every "same" group met on the way was dropped, freed and counted
    assert len(queued) == 3 and staleness.accepted == 3
    assert all([m.meta["reward"] for m in g] == [0.0, 1.0] for g in queued)
    assert staleness.dropped["filtered"] >= 1 and len(freed) == staleness.dropped["filtered"]
    assert all(m.meta["reward"] == 1.0 for g in freed for m in g)
    # without the filter the same prompts put equal-reward groups into the batch (all 6 prompts, 3 of them "same")
    staleness, queued, freed = _run_until_queued(filter_groups=False, groups=6)
    assert sum(all(m.meta["reward"] == 1.0 for m in g) for g in queued) == 3 and not freed
    assert staleness.dropped["filtered"] == 0


def test_filter_groups_refuses_groups_of_one():
    with pytest.raises(ValueError, match="algorithm.filter_groups"):
        Rollouter(run_sample=None, prompts=None, staleness=None, sink=None, discard=_discard, group_size=1, filter_groups=True)


def test_a_new_group_runs_in_one_group_call_and_a_resumed_one_sample_by_sample():
    """`run_group` (Ray fleets): a new group's samples go in one call and their records land in order; a group
    taken back from a checkpoint runs each remaining sample with its saved state (`run_sample`)."""
    plane = LocalStorage(inline_max_bytes=0)
    agent = SingleTurnAgent(decode=lambda ids: "x", reward_fn=lambda response, answer: 1.0, sampling=SamplingParams())
    single = _runner(agent, ScriptedLLM(), plane)
    group_calls, sample_calls = [], []

    async def run_group(samples):
        group_calls.append([s.index_in_group for s in samples])
        return [await single(s) for s in samples]

    async def run_sample(sample, saved=None):
        sample_calls.append((sample.uid, saved))
        return await single(sample)

    async def go():
        prompts = PromptSet([Prompt(i, "q", [1, 2], "ok") for i in range(4)])
        queued = []

        async def sink(group):
            queued.append(group)

        r = Rollouter(run_sample=run_sample, run_group=run_group, prompts=PromptStream(prompts, seed=0),
                      staleness=StalenessManager(batch_groups=2, eta=0), sink=sink, discard=_discard, group_size=3,
                      max_running_samples=6)
        r.resume("g-old", 0, Prompt(9, "q", [1, 2], "ok"), done={}, saved={"g-old-1": "saved-1"})
        task = asyncio.create_task(r.run())
        while len(queued) < 2:
            await asyncio.sleep(0.01)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return queued, r

    queued, r = asyncio.run(go())
    assert sorted(sample_calls) == [("g-old-0", None), ("g-old-1", "saved-1"), ("g-old-2", None)]
    assert group_calls and all(c == [0, 1, 2] for c in group_calls)
    for group in queued:
        assert [rec.uid.rsplit("-", 1)[1] for rec in group] == ["0", "1", "2"] and len({rec.group_id for rec in group}) == 1
    assert r.running_samples >= 0
