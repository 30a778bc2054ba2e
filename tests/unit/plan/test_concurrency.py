"""The per-token cost that grows with a server's requests in flight (`Costs.token_cost_slope_s`):
slope 0 leaves the simulator exactly as it was; a slope prices each token by the server's active count."""

from __future__ import annotations

import pytest

from asyncrl.plan.costs import Costs
from asyncrl.plan.demo import DemoCosts, with_concurrency
from asyncrl.plan.engine_sweep import fit_line
from asyncrl.plan.sim import Schedule, Simulator
from asyncrl.engines.cost_model import LongTail

FIXED = LongTail(short_tokens=10, long_fraction=0.0, jitter=0.0)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("case, tokens_per_s, step_s, events, t_sum", [
    # numbers of the simulator before per-server clocks existed (one global rollout clock), same seed,
    # which routed every sample alone (no `group_affinity`)
    ("contention", 4926.8417502151715, 0.403021875, 393, 864.6333214285713),
    ("bench", 4831.237870221924, 0.2962749999999999, 240, 356.3799999999999),
])
def test_slope_zero_reproduces_the_single_clock_simulator(case, tokens_per_s, step_s, events, t_sum):
    if case == "contention":
        c = Costs(servers=2, max_concurrency=8, token_cost_s=0.001, lengths=LongTail(short_tokens=40), trainer_tokens_per_s=0.7 * 16 / 0.001,
                  groups=4, group_size=8, publish_s=0.005, contention=2.0, request_overhead_s=0.0003)
    else:
        c = Costs(servers=4, max_concurrency=4, token_cost_s=0.002, lengths=LongTail(short_tokens=30, long_fraction=0.2),
                  trainer_tokens_per_s=5000, groups=4, group_size=4, publish_s=0.01, length_seed=0, requests_before=1)
    r = Simulator(c, Schedule(mode="fully_async", steps=8, warmup=2, group_affinity=False), seed=1, record=True).run()
    assert (r.trained_tokens_per_s, r.step_s, len(r.trace)) == (tokens_per_s, step_s, events)
    assert sum(e.t for e in r.trace) == t_sum


def _sync(samples: int, slope: float, lengths: LongTail = FIXED) -> Simulator:
    c = Costs(servers=1, max_concurrency=64, token_cost_s=0.001, token_cost_slope_s=slope, lengths=lengths,
              trainer_tokens_per_s=1e6, groups=1, group_size=samples, publish_s=0.0)
    sim = Simulator(c, Schedule(mode="sync", steps=2, warmup=1), seed=3)
    sim.run()
    return sim


@pytest.mark.timeout(30)
def test_fewer_requests_in_flight_pay_less_per_token_as_the_formula_says():
    """Sync, one server, all samples start together: the batch is ready after 10 tokens at
    `token_cost_s + slope x active`; with 1 in flight that is 16x cheaper in slope terms than with 16."""
    slope = 1e-4
    for samples in (1, 16):
        first_ready = _sync(samples, slope).steps[0][0]
        assert first_ready == pytest.approx(10 * (0.001 + slope * samples), rel=1e-9)
    assert _sync(1, slope).steps[0][0] < _sync(16, slope).steps[0][0]
    assert _sync(16, 0.0).steps[0][0] == pytest.approx(10 * 0.001, rel=1e-12)  # no slope: concurrency is free


@pytest.mark.timeout(30)
def test_a_server_speeds_up_when_a_request_on_it_ends():
    """Two samples of different lengths share a server: both run at cost(2) until the shorter ends,
    then the longer one's remaining tokens run at cost(1) (its clock re-timed at the end)."""
    slope = 5e-4
    sim = _sync(2, slope, LongTail(short_tokens=20, long_fraction=0.0, jitter=0.5))
    (t1, n1), (t2, n2) = sim.completions[:2]
    assert n1 < n2
    cost = lambda a: 0.001 + slope * a
    assert t1 == pytest.approx(n1 * cost(2), rel=1e-9)
    assert t2 == pytest.approx(n1 * cost(2) + (n2 - n1) * cost(1), rel=1e-9)


@pytest.mark.timeout(10)
def test_the_sweep_line_is_scaled_to_the_sync_runs_own_cost():
    points = {c: 0.0008 + 4e-5 * c for c in (2, 8, 32, 64)}
    base, slope = fit_line(points)
    assert base == pytest.approx(0.0008) and slope == pytest.approx(4e-5)
    assert fit_line({2: 0.002, 64: 0.001})[1] == 0.0  # a falling cost is noise: no negative slope
    cal = DemoCosts(token_cost_s=0.007, trainer_s_per_token=1e-3, publish_s=0.0, step_overhead_s=0.0, response_tokens=4, groups=8, group_size=8)
    c = with_concurrency(cal, points).costs()
    assert c.token_cost_at(64) == pytest.approx(0.007)  # the sync batch (8 x 8 in flight) keeps its measured cost
    assert c.token_cost_at(2) / c.token_cost_at(64) == pytest.approx(points[2] / points[64])  # the sweep's shape
    with pytest.raises(ValueError, match="costs.token_cost_slope_s"):
        Costs(servers=1, max_concurrency=1, token_cost_s=0.001, token_cost_slope_s=-1e-5, lengths=FIXED,
              trainer_tokens_per_s=1.0, groups=1, group_size=1)
