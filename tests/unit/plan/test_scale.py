"""What makes `asyncrl plan` fast at 1,024 GPUs keeps its answers: the least-in-flight heap, the
simulated slice of a homogeneous fleet, and the bench's length draws lined up with the real server's."""

from __future__ import annotations

import time

import pytest

from asyncrl.plan.costs import Costs, load_profile
from asyncrl.plan.search import best_split
from asyncrl.plan.sim import Schedule, Simulator, simulate
from asyncrl.engines.base import SamplingParams
from asyncrl.engines.cost_model import CostModelServer, LongTail


def fleet(servers: int = 8, groups: int = 16, **kw) -> Costs:
    args = dict(servers=servers, max_concurrency=4, token_cost_s=0.001, lengths=LongTail(short_tokens=30, long_fraction=0.0, jitter=0.0),
                trainer_tokens_per_s=servers * 4 / 0.001 * 0.8, groups=groups, group_size=4, publish_s=0.002)
    args.update(kw)
    return Costs(**args)


@pytest.mark.timeout(30)
def test_least_inflight_heap_picks_what_min_over_servers_picks():
    """Every pick of a long-tail run with queueing is checked against the linear scan it replaces
    (samples routed one by one: without `group_affinity` every sample is a pick)."""
    picks = []

    class Checked(Simulator):
        def _least_inflight(self) -> int:
            srv = super()._least_inflight()
            assert srv == min(range(self.c.servers), key=self.inflight.__getitem__), (srv, self.inflight)
            picks.append(srv)
            return srv

    Checked(fleet(servers=5, groups=6, lengths=LongTail(short_tokens=30)), Schedule(mode="fully_async", steps=10, warmup=2, group_affinity=False), seed=3).run()
    assert len(picks) > 200 and len(set(picks)) == 5


@pytest.mark.timeout(30)
def test_slice_factor_divides_servers_and_groups():
    assert fleet(servers=8, groups=16).slice_factor(4) == 4
    assert fleet(servers=8, groups=16).slice_factor(16) == 1
    assert fleet(servers=6, groups=16).slice_factor(4) == 2  # gcd 2: the smallest slice that fits is not reachable
    assert fleet(servers=7, groups=16).slice_factor(4) == 1
    with pytest.raises(ValueError, match="costs.servers"):
        fleet(servers=6, groups=16).sliced(4)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("mode", ["sync", "fully_async"])
def test_a_slice_predicts_the_whole_fleet(mode):
    """Equal lengths: a quarter of the servers, groups and trainer runs the same steps, so the
    scaled tokens/s is the whole run's."""
    whole = simulate(fleet(), Schedule(mode=mode, steps=8, warmup=2), seeds=1)
    part = simulate(fleet(), Schedule(mode=mode, steps=8, warmup=2), seeds=1, max_groups=4)
    assert whole["slice"] == 1 and part["slice"] == 4
    assert part["trained_tokens_per_s"] == pytest.approx(whole["trained_tokens_per_s"], rel=0.02)
    assert part["step_s"] == pytest.approx(whole["step_s"], rel=0.02)


@pytest.mark.timeout(60)
def test_public_profile_split_search_at_1024_gpus_is_fast():
    prof = load_profile("qwen2.5-math-7b-h800")
    t = time.perf_counter()
    found = best_split(prof, 1024, steps=8, warmup=2)
    took = time.perf_counter() - t
    assert len(found["candidates"]) <= 20 and {r["slice"] for r in found["candidates"]} == {8}
    assert found["best"]["rollout_gpus"] + found["best"]["trainer_gpus"] == 1024
    assert took < 30, took  # minutes before the heap and the slice


@pytest.mark.timeout(30)
def test_requests_before_lines_the_draws_up_with_the_cost_model_server():
    """The bench's step-0 evaluation is server 0's first request: with `requests_before=1` the
    simulator's first rollout draw on server 0 is the real server's second one."""
    lengths = LongTail(short_tokens=40, long_fraction=0.3)
    server = CostModelServer(token_cost_s=0.001, max_concurrency=4, lengths=lengths, seed=7)
    real = [server._target([1, 2, 3], SamplingParams())[0] for _ in range(4)]
    for before in (0, 1):
        sim = Simulator(fleet(servers=2, lengths=lengths, length_seed=7, requests_before=before), Schedule())
        assert [sim._draw(0) for _ in range(4 - before)] == real[before:]
