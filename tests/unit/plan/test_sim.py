"""The simulator: its admission is the real manager's, and its predictions keep the pipeline's invariants."""

from __future__ import annotations

import asyncio
import types

import pytest

from asyncrl.plan.costs import Costs, Profile
from asyncrl.plan.search import best_split
from asyncrl.plan.sim import Schedule, Simulator, simulate
from asyncrl.engines.cost_model import LongTail
from asyncrl.staleness import StalenessManager


def costs(ratio: float = 1.0) -> Costs:
    cap = 2 * 8 / 0.001
    return Costs(servers=2, max_concurrency=8, token_cost_s=0.001, lengths=LongTail(short_tokens=40), trainer_tokens_per_s=ratio * cap,
                 groups=4, group_size=8, publish_s=0.005)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("mode", ["sync", "one_step_off", "fully_async"])
def test_admission_equals_the_real_manager_on_the_simulated_trace(mode):
    """Replay the simulator's calls on a fresh manager inside a real asyncio loop (its clock made
    the simulated one): every admission decision, the limit and the pace agree event by event."""
    sim = Simulator(costs(0.7), Schedule(mode=mode, steps=8, warmup=2), seed=1, record=True)
    sim.run()
    assert len(sim.trace) > 50 and sum(e.admitted for e in sim.trace) > 20
    clock = types.SimpleNamespace(t=0.0)
    mgr = StalenessManager.for_rule(Schedule(mode=mode).rule, batch_groups=4, clock=lambda: clock.t)
    pace = mgr.pace
    assert (pace is None) == (mode != "fully_async")

    async def replay() -> int:
        versions: list[int] = []  # versions of running groups, in start order per version as the simulator finishes them
        checked = 0
        for e in sim.trace:
            clock.t = e.t
            if e.op == "finish":
                await mgr.finish(True, version=e.args[0])
            elif e.op == "drop":
                await mgr.drop_accepted("stale", e.args[0])
            elif e.op == "took":
                await mgr.took(e.args[0])
            elif e.op == "step_done":
                await mgr.step_done(*e.args)
            elif e.op == "set_version":
                await mgr.set_version(e.args[0])
            for _ in range(e.admitted):
                assert mgr.can_start(), f"the simulator admitted a group the manager refuses at t={e.t} ({e.op})"
                versions.append(await asyncio.wait_for(mgr.acquire(), 1))
            if e.op != "sample":  # a freed slot: the manager's state did not change
                assert mgr.can_start() == e.can_start, (e, mgr.accepted, mgr.running)
                assert mgr.admission_limit() == e.limit, e
            checked += 1
        return checked

    assert asyncio.run(replay()) == len(sim.trace)
    assert mgr.accepted == sim.mgr.accepted and mgr.taken == sim.mgr.taken and dict(mgr.dropped) == dict(sim.mgr.dropped)
    if pace is not None:
        assert pace.latency_s == pytest.approx(sim.mgr.pace.latency_s) and pace.busy_s == pytest.approx(sim.mgr.pace.busy_s)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("ratio", [1.0, 0.4])
def test_invariants_on_a_balanced_and_a_trainer_bound_load(ratio):
    c = costs(ratio)
    rows = {m: simulate(c, Schedule(mode=m, eta=3, steps=12, warmup=3), seeds=2) for m in ("sync", "one_step_off", "fully_async")}
    assert rows["sync"]["staleness_max"] == 0
    assert rows["one_step_off"]["staleness_max"] <= 1
    assert rows["fully_async"]["staleness_max"] <= 3
    for r in rows.values():
        assert 0 < r["trained_tokens_per_s"] <= 1.001 * min(c.rollout_capacity, c.trainer_tokens_per_s)
        assert 0 <= r["trainer_idle_ratio"] <= 1 and 0 <= r["rollout_idle_ratio"] <= 1
    assert rows["sync"]["trained_tokens_per_s"] < rows["one_step_off"]["trained_tokens_per_s"] < rows["fully_async"]["trained_tokens_per_s"]
    if ratio < 1:  # trainer-bound: fully_async keeps the trainer busy
        assert rows["fully_async"]["trainer_idle_ratio"] < 0.1
        assert rows["fully_async"]["ratio_to_bound"] > 0.9


@pytest.mark.timeout(30)
def test_split_search_finds_the_balanced_split():
    """No long tail, lots of slots: throughput = min(rollout, trainer) capacity, so the best split of
    64 GPUs balances them: a rollout GPU makes 3x a trainer GPU's tokens/s -> 16:48."""
    prof = Profile(name="known", gpus_per_server=1, max_concurrency=16, token_cost_s=16 / 3000, trainer_tokens_per_s_per_gpu=1000.0,
                   lengths=LongTail(short_tokens=50, long_fraction=0.0, jitter=0.0), groups=32, group_size=4, base_gpus=64, eta=4,
                   split_step=4)
    found = best_split(prof, 64, steps=10, warmup=3, coarse=16)
    assert found["best"]["rollout_gpus"] == 16, [(r["rollout_gpus"], r["trained_tokens_per_s"]) for r in found["candidates"]]
    assert found["best"]["ratio_to_bound"] > 0.9


@pytest.mark.timeout(30)
@pytest.mark.parametrize("affinity", [True, False])
def test_group_affinity_runs_a_group_on_the_server_its_first_sample_went_to(affinity):
    """`rollout.group_affinity` (the default): the router sends every sample of a group where its first
    went, the least loaded server then; without it each sample goes to the least loaded server on its own."""
    where: dict[int, set[int]] = {}

    class Watched(Simulator):
        def _run_waiting(self, srv: int) -> None:
            for gid, _ in self.waiting[srv]:
                where.setdefault(gid, set()).add(srv)
            super()._run_waiting(srv)

    Watched(costs(0.7), Schedule(mode="one_step_off", steps=6, warmup=1, group_affinity=affinity), seed=1).run()
    assert len(where) > 20
    spread = [len(s) for s in where.values()]
    if affinity:
        assert set(spread) == {1}
        assert {srv for s in where.values() for srv in s} == {0, 1}  # groups still spread over the servers
    else:
        assert max(spread) == 2  # 8 samples of a group over 2 servers
