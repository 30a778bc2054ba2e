"""Partial rollouts in the simulator: a sample interrupted by a publish continues under the new
version (its tokens counted at their versions), `abort` pays the prefill again, `wait` drains
first, and staleness is read as the pipeline reads it (group: oldest token; token: newest)."""

from __future__ import annotations

import pytest

from asyncrl.plan.costs import Costs
from asyncrl.plan.sim import Schedule, Simulator, simulate
from asyncrl.plan.versions import GroupVersions, version_runs
from asyncrl.engines.cost_model import LongTail


@pytest.mark.timeout(10)
def test_version_runs_split_a_sample_at_its_servers_publishes():
    pubs = [(5.0, 1), (15.0, 3), (32.0, 4), (50.0, 5)]  # (own time, new version); 5.0 is before the start
    assert version_runs(10.0, 30, 1.0, 1, pubs) == [(1, 5.0), (3, 17.0), (4, 8.0)]
    assert version_runs(10.0, 3, 1.0, 1, pubs) == [(1, 3.0)]  # ended before the next publish
    assert version_runs(15.0, 3, 1.0, 3, pubs) == [(3, 3.0)]  # started during the publish to v3: all v3
    g = GroupVersions()
    g.add([(1, 5.0), (3, 17.0), (4, 8.0)])
    g.add([(3, 10.0)])
    assert (g.oldest, g.newest, g.partial, g.max_span) == (1, 4, 1, 3)
    assert g.queue_version("group") == 1 and g.queue_version("token") == 4
    assert g.ages(step=7, eta=4) == (40.0, 5.0, 6 * 5 + 4 * 27 + 3 * 8)  # at step 7 only v1's tokens are older than eta 4


def one_server(mode: str, prefill_token_cost_s: float = 0.01) -> Simulator:
    """One slot, 100-token samples at 0.01 s/token (1 s each), a trainer step of 0.4 s, a 0.5 s publish:
    A runs [0, 1]; B starts at 1 when A ends and A trains [1, 1.4]; the publish pauses the server
    over [1.4, 1.9] with B 40 tokens in."""
    c = Costs(servers=1, max_concurrency=1, token_cost_s=0.01, lengths=LongTail(short_tokens=100, long_fraction=0.0, jitter=0.0),
              trainer_tokens_per_s=250.0, groups=1, group_size=1, publish_s=0.5, prefill_token_cost_s=prefill_token_cost_s, prompt_tokens=50)
    sim = Simulator(c, Schedule(mode="fully_async", eta=4, admission="bound", steps=1, warmup=1, update_mode=mode))
    sim.run()
    return sim


@pytest.mark.timeout(10)
def test_keep_continues_abort_prefills_again_wait_drains():
    keep = one_server("keep")
    assert keep.completions[:2] == [(1.0, 100), (pytest.approx(2.5), 100)]  # B: 1 s of tokens + the 0.5 s pause
    assert (keep.partial, keep.max_span) == (1, 1)  # B: 40 tokens of v0, 60 of v1
    abort = one_server("abort")
    # after the publish B's server prefills its prompt and 40 tokens again: (50 + 40) x 0.01 = 0.9 s, then 60 tokens
    assert abort.completions[1] == (pytest.approx(1.9 + 0.9 + 0.6), 100) and abort.partial == 1
    assert abort.prefill_stall[0] == pytest.approx(0.9)
    free = one_server("abort", prefill_token_cost_s=0.0)
    assert free.completions[:2] == keep.completions[:2]  # a free prefill: abort is keep
    wait = one_server("wait")
    # the publish waits for B (ends at 2.0), then pauses 0.5 s; B is trained after it, every token of v0
    assert wait.completions[1] == (pytest.approx(2.0), 100) and wait.partial == 0
    assert wait.steps[1][0] == pytest.approx(2.5) and wait.steps[1][1] == pytest.approx(2.9)


@pytest.mark.timeout(30)
def test_token_level_keeps_the_long_groups_that_group_level_drops():
    """A long tail at eta 1: group level drops the groups whose first token is too old by the time
    their long sample ends; token level files them under their newest token and trains them, its
    too-old tokens counted as masked."""
    c = Costs(servers=4, max_concurrency=8, token_cost_s=0.001, lengths=LongTail(short_tokens=40, long_fraction=0.1, long_factor=10.0),
              trainer_tokens_per_s=20000.0, groups=4, group_size=8, publish_s=0.005)
    rows = {level: simulate(c, Schedule(mode="fully_async", eta=1, steps=16, warmup=4, staleness_level=level), seeds=2)
            for level in ("group", "token")}
    assert rows["group"]["dropped_fraction"] > 0.02 and rows["group"]["stale_token_fraction"] == 0.0
    assert rows["token"]["dropped_fraction"] < rows["group"]["dropped_fraction"] and rows["token"]["stale_token_fraction"] > 0
    assert rows["token"]["partial_fraction"] > 0 and rows["token"]["staleness_max"] > 1  # oldest-token staleness beyond eta, masked


@pytest.mark.timeout(10)
def test_bad_update_mode_and_staleness_level_name_the_key():
    with pytest.raises(ValueError, match="rollout.update_mode"):
        Schedule(update_mode="drop")
    with pytest.raises(ValueError, match="trainer.staleness_level"):
        Schedule(staleness_level="sample")
