"""Rewards that raise, lie about their type, or hang: counted failures, a bounded pool, and a clean stop.

Real threads and real event loops; the agents talk to a scripted LLM (the reward is what is under test).
"""

from __future__ import annotations

import asyncio
import dataclasses
import pickle
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from agents.scoring import RewardBroken, RewardPool, Scorer, score
from agents.single_turn import SingleTurnAgent
from agents.tool_agent import ToolAgent
from asyncrl.config import AgentConfig
from asyncrl.engines.base import SamplingParams
from asyncrl.rollout.host_spec import make_agent
from tests.unit.agents.scripted import ScriptedLLM, Turn, decode, encode, make_sample


def always_raises(response: str, answer: str) -> float:
    raise RuntimeError("grader down")


def returns_string(response: str, answer: str) -> str:
    return "0.5"


@pytest.mark.timeout(30)
def test_reward_that_always_raises_stops_after_exactly_n():
    scorer = Scorer(always_raises, timeout_s=1.0, max_failures=5, pool=RewardPool(2))

    async def go() -> tuple[list[dict], RewardBroken]:
        infos = []
        for _ in range(4):
            infos.append((await scorer("x", "y"))[1])
        with pytest.raises(RewardBroken) as e:
            await scorer("x", "y")
        return infos, e.value

    infos, err = asyncio.run(go())
    assert infos == [{"failed": "RuntimeError: grader down"}] * 4  # the first N-1 are counted failures
    msg = str(err)
    assert "tests.faults.test_rewards:always_raises" in msg and "5 times in a row" in msg
    assert "agent.max_reward_failures" in msg and "RuntimeError: grader down" in msg
    assert (err.count, err.limit) == (5, 5)
    back = pickle.loads(pickle.dumps(err))  # how Ray carries an actor's exception (not one of our wires)
    assert type(back) is RewardBroken and str(back) == msg


@pytest.mark.timeout(30)
def test_any_success_resets_the_streak():
    calls = iter(["fail"] * 4 + ["ok"] + ["fail"] * 4 + ["ok"])

    def flaky(response: str, answer: str) -> float:
        if next(calls) == "fail":
            raise ValueError("flaky")
        return 1.0

    scorer = Scorer(flaky, name="flaky", max_failures=5, pool=RewardPool(1))

    async def go() -> list[float]:
        return [(await scorer("x", "y"))[0] for _ in range(10)]

    out = asyncio.run(go())  # never five failures in a row: no RewardBroken
    assert out == [0.0] * 4 + [1.0] + [0.0] * 4 + [1.0] and scorer.failures_in_a_row == 0


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "value, cause",
    [("0.5", "bad return: str '0.5'"), (None, "bad return: NoneType None"), ((0.5,), "a tuple must be (number, dict)"),
     ((0.5, 1), "a tuple must be (number, dict)"), (("0.5", {}), "bad return: str '0.5'"),
     ((1.0, {"x": 1}, 2), "a tuple must be (number, dict)"), (float("inf"), "not finite: inf"),
     (float("-inf"), "not finite: -inf"), (float("nan"), "not finite: nan"), (10**400, "is not a float"),
     ([1.0], "bad return: list"), ((1.0, {1: "a"}), "info keys must be str"), ((1.0, {"o": object()}), "info does not encode")],
)
def test_bad_return_values_are_counted_failures_with_their_cause(value, cause):
    reward, info = asyncio.run(score(lambda r, a: value, "x", "y", 1.0, pool=RewardPool(1)))
    assert reward == 0.0 and set(info) == {"failed"} and cause in info["failed"]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("value, expected", [(True, (1.0, {})), (False, (0.0, {})), (3, (3.0, {})),
                                             (np.float32(0.25), (0.25, {})), ((1, {"n": [1, 2]}), (1.0, {"n": [1, 2]}))])
def test_real_numbers_pass(value, expected):
    assert asyncio.run(score(lambda r, a: value, "x", "y", 1.0, pool=RewardPool(1))) == expected


@pytest.mark.timeout(30)
def test_agents_never_crash_on_a_bad_return_and_raise_reward_broken_out_of_run():
    single = SingleTurnAgent(decode=decode, reward_fn=returns_string, sampling=SamplingParams(max_tokens=50),
                             max_reward_failures=3, reward_name="my_reward")
    tool = ToolAgent(encode=encode, decode=decode, reward_fn=returns_string, sampling=SamplingParams(max_tokens=50),
                     max_reward_failures=3)
    for agent in (single, tool):
        async def go() -> list:
            trajs = [await agent.run(make_sample(uid=f"s{i}"), ScriptedLLM([Turn("the answer is 42")])) for i in range(2)]
            with pytest.raises(RewardBroken) as e:  # the third failure in a row: never swallowed into a reward
                await agent.run(make_sample(uid="s2"), ScriptedLLM([Turn("the answer is 42")]))
            return trajs + [e.value]

        *trajs, err = asyncio.run(go())
        assert [t.reward for t in trajs] == [0.0, 0.0]
        assert all(t.reward_info["failed"].startswith("bad return: str '0.5'") for t in trajs)
        name = "my_reward" if agent is single else "tests.faults.test_rewards:returns_string"
        assert f"reward {name} failed 3 times" in str(err)


@pytest.mark.timeout(30)
def test_make_agent_threads_the_reward_keys():
    cfg = dataclasses.asdict(AgentConfig(max_reward_failures=7, reward_workers=3, reward_timeout_s=2.5))
    agent = make_agent(cfg, "tests.faults.test_rewards:always_raises", encode, decode, SamplingParams())
    assert isinstance(agent, SingleTurnAgent)
    s = agent.scorer
    assert (s.max_failures, s.timeout_s, s.name) == (7, 2.5, "tests.faults.test_rewards:always_raises")
    assert s.pool.workers >= 3
    tool = make_agent(dataclasses.asdict(AgentConfig(name="tool", max_reward_failures=2)), "math_answer", encode, decode,
                      SamplingParams())
    assert isinstance(tool, ToolAgent) and (tool.scorer.max_failures, tool.scorer.name) == (2, "math_answer")


@pytest.mark.timeout(60)
def test_one_in_four_hanging_calls_never_starve_the_healthy_ones():
    release = threading.Event()

    def reward(response: str, answer: str) -> float:
        if response.startswith("hang"):
            release.wait(20)  # hung until the test ends
            return 1.0
        time.sleep(0.05)
        return 0.75

    pool = RewardPool(2)  # fewer threads than hung calls: only replacement keeps the healthy ones going
    scorer = Scorer(reward, timeout_s=0.5, max_failures=100, pool=pool)
    responses = [("hang" if i % 4 == 0 else "ok") + str(i) for i in range(24)]

    async def go() -> list[tuple[float, dict]]:
        return await asyncio.gather(*(scorer(r, "a") for r in responses))

    try:
        t = time.monotonic()
        out = asyncio.run(go())
        elapsed = time.monotonic() - t
        assert pool.abandoned == 6 and not pool.exhausted  # every hung call's thread was given up on, and replaced
    finally:
        release.set()
    healthy = [o for r, o in zip(responses, out) if r.startswith("ok")]
    hung = [o for r, o in zip(responses, out) if r.startswith("hang")]
    assert healthy == [(0.75, {})] * 18  # no healthy call timed out behind a hung one
    assert hung == [(0.0, {"failed": "timeout"})] * 6
    assert elapsed < 15  # bounded (6 hangs of 0.5 s over 2 workers, plus 18 x 0.05 s of work)
    deadline = time.monotonic() + 10
    while pool.abandoned and time.monotonic() < deadline:  # released threads end; the pool is whole again
        time.sleep(0.02)
    assert pool.abandoned == 0


@pytest.mark.timeout(60)
def test_calls_hanging_past_the_cap_break_the_reward_then_the_pool_heals():
    release = threading.Event()

    def hang(response: str, answer: str) -> float:
        release.wait(20)
        return 1.0

    pool = RewardPool(1, max_abandoned=2)
    scorer = Scorer(hang, name="hang", timeout_s=0.2, max_failures=100, pool=pool)

    async def go() -> tuple[list, RewardBroken]:
        out = [await scorer("x", "y") for _ in range(2)]  # two abandoned threads: at the cap, still whole
        with pytest.raises(RewardBroken) as e:
            await scorer("x", "y")  # the third is past it
        return out, e.value

    try:
        out, err = asyncio.run(go())
        assert out == [(0.0, {"failed": "timeout"})] * 2
        assert "reward hang" in str(err) and "pool exhausted" in str(err) and "agent.reward_workers" in str(err)
        assert pool.exhausted
    finally:
        release.set()
    deadline = time.monotonic() + 10
    while pool.exhausted and time.monotonic() < deadline:
        time.sleep(0.02)
    assert asyncio.run(score(lambda r, a: 0.5, "x", "y", 1.0, pool=pool)) == (0.5, {})


@pytest.mark.timeout(30)
def test_rewards_never_use_the_loops_default_executor():
    blocker = threading.Event()

    async def go() -> tuple[float, dict]:
        loop = asyncio.get_running_loop()
        loop.set_default_executor(ThreadPoolExecutor(max_workers=1))
        stuck = loop.run_in_executor(None, blocker.wait, 10)  # the default executor's only thread is taken
        try:
            return await score(lambda r, a: 0.5, "x", "y", 2.0, pool=RewardPool(1))
        finally:
            blocker.set()
            await stuck

    assert asyncio.run(go()) == (0.5, {})


@pytest.mark.timeout(30)
def test_async_rewards_time_out_and_count_toward_the_streak():
    async def hang(response: str, answer: str) -> float:
        await asyncio.sleep(30)
        return 1.0

    scorer = Scorer(hang, name="async_hang", timeout_s=0.1, max_failures=2)

    async def go() -> None:
        assert await scorer("x", "y") == (0.0, {"failed": "timeout"})
        with pytest.raises(RewardBroken, match="reward async_hang failed 2 times in a row"):
            await scorer("x", "y")

    t = time.monotonic()
    asyncio.run(go())
    assert time.monotonic() - t < 5
