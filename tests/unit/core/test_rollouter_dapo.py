"""DAPO on the rollout side, through the real Rollouter: overlong shaping of queued records (an agent's
real trajectory written into a local data plane, as a server's host does) and the stop after too many
filtered groups in a row. The LLM is scripted (stands in for a model whose lengths we control)."""

import asyncio

import pytest

from agents.single_turn import SingleTurnAgent
from asyncrl.config import ConfigError, load
from asyncrl.data.datasets import Prompt
from asyncrl.engines.base import GenerateOutput, SamplingParams
from asyncrl.rollout.rollouter import EndlessFiltering, Rollouter
from asyncrl.rollout.shaping import OverlongShaping, overlong_metrics
from asyncrl.staleness import StalenessManager
from asyncrl.trajectory_queue import from_record, trajectory_sample
from transfer_queue.storage.local import LocalStorage


class LengthByIndex:
    """Sample i of a group answers with `lengths[i]` tokens (the prompt's answer picks nothing)."""

    def __init__(self, lengths):
        self.lengths, self.calls = lengths, 0

    async def generate(self, prompt_ids, sampling, session_id=None):
        await asyncio.sleep(0.001)
        n = self.lengths[int(session_id.rsplit("-", 1)[1])]
        return GenerateOutput("r", [5] * n, [-0.1] * n, [0] * n, "length" if n >= 10 else "stop")


def _run(prompts, *, reward_fn, lengths, groups, group_size=2, max_batches=0, shaping=None, filter_groups=False, until=None):
    """Run the rollouter on `prompts` (in order, one group at a time) until `groups` are queued or it raises."""
    plane = LocalStorage(inline_max_bytes=0)
    agent = SingleTurnAgent(decode=lambda ids: str(len(ids)), reward_fn=reward_fn, sampling=SamplingParams())
    llm = LengthByIndex(lengths)

    async def run_sample(sample):
        return trajectory_sample(plane, await agent.run(sample, llm))

    async def go():
        staleness = StalenessManager(batch_groups=groups, eta=0)
        queued, freed = [], []

        async def sink(group):
            queued.append(group)

        async def discard(group):
            freed.append(group)

        r = Rollouter(run_sample=run_sample, prompts=iter(prompts), staleness=staleness, sink=sink, discard=discard,
                      group_size=group_size, max_running_samples=1,  # one group at a time: a scripted order
                      filter_groups=filter_groups, filter_groups_max_batches=max_batches, shaping=shaping)
        task = asyncio.create_task(r.run())
        error = None
        while len(queued) < groups and not task.done():
            await asyncio.sleep(0.005)
        if task.done():
            error = task.exception()
        else:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        return r, staleness, queued, freed, error

    out = asyncio.run(go())
    return (*out, plane)


@pytest.mark.timeout(20)
def test_overlong_shaping_of_queued_records_is_hand_computed_and_keeps_the_score():
    # max length 10, buffer 4: the penalty starts after 6 tokens and reaches -2.0 (factor) at 10
    shaping = OverlongShaping(buffer_len=4, max_response_length=10, penalty_factor=2.0)
    prompts = [Prompt(i, "q", [1, 2], "a") for i in range(4)]
    r, _, queued, _, error, plane = _run(prompts, reward_fn=lambda resp, ans: 1.0 if resp != "9" else 0.0,
                                         lengths=[5, 8, 9, 10], groups=1, group_size=4, shaping=shaping)
    assert error is None and len(queued) == 1
    (group,) = queued
    # 5 tokens: none; 8: 2 into the buffer -> -2/4*2 = -1.0; 9 (reward 0): -1.5; 10: -2.0
    assert [m.meta["reward"] for m in group] == pytest.approx([1.0, 0.0, -1.5, -1.0])
    assert [m.meta["reward_info"]["score"] for m in group] == [1.0, 1.0, 0.0, 1.0]
    assert [m.meta["reward_info"]["overlong_penalty"] for m in group] == pytest.approx([0.0, -1.0, -1.5, -2.0])
    m = group[3]  # the record read back as a trajectory carries the shaped reward
    t = from_record(m.meta, dict(zip(m.handles, plane.read(list(m.handles.values())))))
    assert len(t.response_ids) == 10 and t.reward == pytest.approx(-1.0) and t.reward_info["score"] == 1.0
    assert overlong_metrics(group) == pytest.approx({"rollout/overlong_penalty": -4.5 / 4, "rollout/overlong_penalised": 0.75})
    assert overlong_metrics([]) == {}


@pytest.mark.timeout(20)
def test_the_filter_compares_unshaped_scores_and_failed_rewards_are_not_shaped():
    shaping = OverlongShaping(buffer_len=4, max_response_length=10)

    def reward(resp, ans):
        if ans == "fail" and resp == "10":
            raise RuntimeError("reward crashed")
        return 1.0

    # group 0: both correct, lengths 5 and 10: shaped rewards would differ (1.0, 0.0) but the scores are equal -> filtered
    # group 1 ("fail"): the long sample's reward fails; the short one keeps 1.0: unequal (0 failed vs 1) -> queued
    prompts = [Prompt(0, "q", [1], "ok"), Prompt(1, "q", [1], "fail")]
    _, staleness, queued, freed, error, _ = _run(prompts, reward_fn=reward, lengths=[5, 10], groups=1,
                                                 shaping=shaping, filter_groups=True)
    assert error is None and staleness.dropped["filtered"] == 1 and len(freed) == 1
    assert all("overlong_penalty" not in m.meta["reward_info"] for m in freed[0])  # dropped before shaping
    short, long = queued[0]
    assert short.meta["reward"] == 1.0 and short.meta["reward_info"] == {"score": 1.0, "overlong_penalty": 0.0}
    assert long.meta["reward"] == 0.0 and "failed" in long.meta["reward_info"] and "score" not in long.meta["reward_info"]


def _scripted(pattern):
    """Prompts whose answers follow `pattern`: "same" gives both samples 1.0 (filtered), "mixed" 0 and 1."""
    return [Prompt(i, "q", [1], a) for i, a in enumerate(pattern)]


def _by_answer(resp, ans):
    return 1.0 if ans == "same" else float(resp == "3")  # lengths [2, 3]: the second sample of a "mixed" group scores


@pytest.mark.timeout(20)
def test_filtered_groups_in_a_row_stop_the_run_after_exactly_the_limit():
    # 2 groups per batch, max 2 batches: the limit is 4 filtered groups in a row; a queued group resets the count
    pattern = ["same"] * 3 + ["mixed"] + ["same"] * 4 + ["mixed"] * 4
    r, staleness, queued, freed, error, _ = _run(_scripted(pattern), reward_fn=_by_answer, lengths=[2, 3], groups=2,
                                                 max_batches=2, filter_groups=True)
    assert isinstance(error, EndlessFiltering)
    assert len(queued) == 1 and staleness.dropped["filtered"] == 7 == len(freed) and r.filtered_in_a_row == 4
    msg = str(error)
    assert "algorithm.filter_groups_max_batches=2" in msg and "4 groups in a row" in msg and "every reward 1" in msg
    # one fewer filtered group before the mixed ones: no stop, the batch fills
    pattern = ["same"] * 3 + ["mixed"] + ["same"] * 3 + ["mixed"] * 4
    r, staleness, queued, _, error, _ = _run(_scripted(pattern), reward_fn=_by_answer, lengths=[2, 3], groups=2,
                                             max_batches=2, filter_groups=True)
    assert error is None and len(queued) == 2 and staleness.dropped["filtered"] == 6 and r.filtered_in_a_row == 0
    # 0 = no limit: 12 filtered groups in a row and the run goes on
    pattern = ["same"] * 12 + ["mixed"] * 2
    _, staleness, queued, _, error, _ = _run(_scripted(pattern), reward_fn=_by_answer, lengths=[2, 3], groups=2,
                                             max_batches=0, filter_groups=True)
    assert error is None and len(queued) == 2 and staleness.dropped["filtered"] == 12


@pytest.mark.timeout(30)
@pytest.mark.parametrize("overrides, key", [
    (["agent.overlong_buffer_len=4"], "agent.overlong_buffer_len"),  # rollout.max_tokens is 4 in the demo
    (["agent.overlong_buffer_len=-1"], "agent.overlong_buffer_len"),
    (["agent.overlong_buffer_len=2", "agent.overlong_penalty_factor=-1"], "agent.overlong_penalty_factor"),
    (["agent.overlong_buffer_len=2", "agent.name=tool"], "agent.kwargs.max_response_tokens"),
    (["agent.overlong_buffer_len=64", "agent.name=tool", "agent.kwargs.max_response_tokens=64"], "agent.overlong_buffer_len"),
    (["algorithm.filter_groups_max_batches=-1"], "algorithm.filter_groups_max_batches"),
])
def test_config_errors_name_the_keys(overrides, key):
    with pytest.raises(ConfigError) as e:
        load(None, overrides)
    assert str(e.value).startswith(f"{key}:"), str(e.value)
    if "max response length" in str(e.value):
        assert "rollout.max_tokens" in str(e.value) or "agent.kwargs.max_response_tokens" in str(e.value)


@pytest.mark.timeout(30)
def test_shaping_from_config():
    assert OverlongShaping.from_config(load(None, [])) is None
    s = OverlongShaping.from_config(load(None, ["rollout.max_tokens=16", "agent.overlong_buffer_len=4", "agent.overlong_penalty_factor=0.5"]))
    assert s == OverlongShaping(buffer_len=4, max_response_length=16, penalty_factor=0.5) and s.penalty(14) == pytest.approx(-0.25)
    s = OverlongShaping.from_config(load(None, ["agent.name=tool", "agent.kwargs.max_response_tokens=64", "agent.overlong_buffer_len=16"]))
    assert s.max_response_length == 64
