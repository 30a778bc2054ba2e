"""`asyncrl bench pipeline --quick --json`: the figures' structure and the invariants no schedule may break."""

import json

import pytest

from asyncrl.bench import pipeline
from asyncrl.engines.cost_model import LongTail

MODE_ETA = {"sync": 0, "one_step_off": 1}


@pytest.mark.timeout(120)
def test_quick_bench_respects_bound_and_staleness(capsys):
    assert pipeline.main(["--quick", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    bound = res["bound_tokens_per_s"]
    assert bound == min(res["rollout_capacity_tokens_per_s"], res["trainer_capacity_tokens_per_s"]) > 0
    assert set(res["modes"]) == set(pipeline.MODES)
    eta = res["load"]["eta"]
    for mode, r in res["modes"].items():
        assert r["measured_steps"] == res["load"]["steps"][mode] and r["steps"] == r["measured_steps"] + res["load"]["warmup"][mode]
        assert 0 < r["trained_tokens_per_s"] <= bound * 1.05, (mode, r)
        assert r["ratio_to_bound"] == pytest.approx(r["trained_tokens_per_s"] / bound, abs=2e-3)
        assert 0 <= r["trainer_idle_ratio"] < 1 and r["rollout_idle_ratio"] < 1, (mode, r)
        assert r["staleness_max"] <= MODE_ETA.get(mode, eta), (mode, r)
        assert r["drops"] == sum(r["drops_by_cause"].values()) and 0 <= r["dropped_fraction"] < 1
        assert 0 <= r["trained_long_fraction"] <= 1 and r["generated_tokens_per_s"] > 0
    assert res["modes"]["sync"]["staleness_max"] == 0 and res["modes"]["sync"]["drops"] == 0
    assert res["modes"]["sync"]["speedup_vs_sync"] == 1.0
    # the long tail leaves sync's trainer waiting for most of each step
    assert res["modes"]["sync"]["trainer_idle_ratio"] > 0.5
    assert res["targets"]["speedup_vs_sync"]["measured"] == res["modes"]["fully_async"]["speedup_vs_sync"]


def test_long_tail_draws_match_its_mean():
    import random

    lt = LongTail(short_tokens=40)
    rng = random.Random(0)
    xs = [lt.draw(rng) for _ in range(20000)]
    assert max(xs) <= lt.max
    assert sum(x > 40 * 5 for x in xs) / len(xs) == pytest.approx(0.05, abs=0.01)
    assert sum(xs) / len(xs) == pytest.approx(lt.mean, rel=0.05)


def test_cost_model_server_pause_modes_and_versions(monkeypatch):
    """The server's clock is the test's (`FakeTime`): each pause lands after exactly 10 of 40 tokens, however
    long the loop is kept from running (with wall time, a loaded host let the request finish before its pause)."""
    import asyncio

    from asyncrl.engines import cost_model
    from asyncrl.engines.base import SamplingParams
    from asyncrl.engines.cost_model import CostModelServer
    from asyncrl.rollout.router import Router

    class FakeTime:
        now = 100.0

        @classmethod
        def monotonic(cls) -> float:
            return cls.now

    monkeypatch.setattr(cost_model, "time", FakeTime)
    cost = 0.25  # a binary fraction: token times are exact

    async def go():
        lt = LongTail(short_tokens=40, long_fraction=0.0, jitter=0.0)
        s = CostModelServer(token_cost_s=cost, max_concurrency=4, lengths=lt, seed=0, update_cost_s=0.0)
        sp = SamplingParams(max_tokens=lt.max)

        async def running() -> None:  # the request holds its slot: its clock started
            for _ in range(1000):
                if s.running:
                    return
                await asyncio.sleep(0)
            raise AssertionError("the request never started")

        def advance(tokens: int) -> None:
            FakeTime.now += tokens * cost
            s._wake_all()  # its wait is on the loop's real clock: look at the server's again

        # keep: the request continues under the new weights; its later tokens carry version 1
        t = asyncio.create_task(s.generate([1, 2], sp))
        await running()
        advance(10)
        await s.pause("keep")
        await s.update_weights([], 1)
        await s.resume()
        advance(100)
        out = await t
        assert len(out.token_ids) == 40 and out.finish_reason == "stop"
        assert out.versions == [0] * 10 + [1] * 30
        # abort: the router resubmits prompt + partial tokens; the response still has its drawn length
        router = Router([s])
        t = asyncio.create_task(router.generate([1, 2], sp))
        await running()
        advance(10)
        await s.pause("abort")
        await s.update_weights([], 2)
        await s.resume()
        await asyncio.sleep(0)  # the aborted call returns its 10 tokens
        await running()  # the resubmitted rest
        advance(100)
        out = await t
        assert len(out.token_ids) == 40 and out.finish_reason == "stop" and router.resubmits == 1
        assert out.versions == [1] * 10 + [2] * 30
        # wait: the pause returns once the running request finished
        t = asyncio.create_task(s.generate([3], sp))
        await running()
        pause = asyncio.create_task(s.pause("wait"))
        await asyncio.sleep(0)
        assert not pause.done()  # the request still runs
        advance(100)
        await pause
        assert t.done() and s.running == 0
        await s.resume()

    asyncio.run(go())
