import asyncio

import pytest

from asyncrl.data.datasets import PromptSet, Prompt, PromptStream
from asyncrl.engines.base import GenerateOutput, SamplingParams
from asyncrl.rollout.router import Router
from asyncrl.staleness import StalenessManager
from asyncrl.types import Trajectory, WireError


def test_admission_rule_sync_trace():
    async def go():
        s = StalenessManager(batch_groups=2, eta=0)
        v = await s.acquire(); await s.acquire()
        assert not s.can_start() and v == 0
        await s.finish(accepted=True, version=v); await s.finish(accepted=True, version=v)
        assert not s.can_start()  # must wait for the next version
        await s.set_version(1)
        assert s.can_start()
        v = await s.acquire()
        await s.finish(accepted=False, cause="reward_failed", version=v)
        assert s.dropped["reward_failed"] == 1 and s.can_start()
        with pytest.raises(ValueError):
            await s.set_version(0)

    asyncio.run(go())


def test_admission_bounds_staleness_by_eta():
    # simulate: rollouts as fast as allowed, trainer takes B groups per version
    async def go(eta):
        s = StalenessManager(batch_groups=3, eta=eta)
        started_at = []
        for version in range(6):
            while s.can_start():
                started_at.append(await s.acquire())
                await s.finish(accepted=True, version=version)
            trained = started_at[version * 3 : version * 3 + 3]
            assert all(version - v <= eta for v in trained)
            await s.set_version(version + 1)
        return started_at

    assert asyncio.run(go(0))[:6] == [0, 0, 0, 1, 1, 1]
    assert asyncio.run(go(2))[:9] == [0] * 9


def test_prompt_stream_resumes_same_sequence():
    ps = PromptSet([Prompt(i, str(i), [i], str(i)) for i in range(5)])
    a = PromptStream(ps, seed=3)
    seq = [next(a).index for _ in range(12)]
    assert sorted(seq[:5]) == list(range(5))
    b = PromptStream(ps, seed=3)
    b.restore(7)
    assert [next(b).index for _ in range(5)] == seq[7:12]


class FakeServer:
    """Scripted stand-in for a RolloutServer (no model): records what it served."""

    def __init__(self):
        self.served = []

    async def generate(self, prompt_ids, sampling, request_id=None):
        self.served.append(tuple(prompt_ids))
        await asyncio.sleep(0.01)
        return GenerateOutput("r", [1], [0.0], [0], "stop")


def test_router_least_in_flight_and_sticky():
    async def go():
        servers = [FakeServer(), FakeServer()]
        r = Router(servers)
        sp = SamplingParams()
        await asyncio.gather(*(r.generate([i], sp) for i in range(10)))
        assert len(servers[0].served) == 5 and len(servers[1].served) == 5
        for turn in range(4):
            await asyncio.gather(r.generate([100 + turn], sp, session_id="a"), r.generate([200 + turn], sp))
        first = 0 if (100,) in servers[0].served else 1
        assert all((100 + t,) in servers[first].served for t in range(4))

    asyncio.run(go())


def _traj(**kw):
    base = dict(uid="u", group_id="g", index_in_group=0, group_size=2, prompt_ids=[1, 2], response_ids=[3, 4, 5],
                behavior_logprobs=[-0.1, -0.2, 0.0], loss_mask=[1, 1, 0], token_versions=[3, 4, -1], min_version=3, max_version=4)
    base.update(kw)
    return Trajectory(**base)


def test_trajectory_roundtrip_and_invariants():
    t = _traj(reward=1.0, reward_info={"exact": 1.0}, meta={"turns": 2})
    back = Trajectory.from_bytes(t.to_bytes())
    assert back.response_ids == t.response_ids and back.token_versions == t.token_versions
    assert back.behavior_logprobs == pytest.approx(t.behavior_logprobs) and back.meta == {"turns": 2}
    assert back.staleness(6) == 3 and back.num_generated_tokens == 2
    with pytest.raises(WireError):
        _traj(loss_mask=[1]).validate()
    for bad in (b"\x00garbage", b"", t.to_bytes()[:-3]):
        with pytest.raises(WireError):
            Trajectory.from_bytes(bad)
