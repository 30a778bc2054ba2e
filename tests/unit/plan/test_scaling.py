"""What grows with the cluster (`asyncrl/plan/scale.py`): the weight broadcast with the servers,
the gradient all-reduce with the trainer's ranks, and through them the projection's speedup."""

from __future__ import annotations

import math

import pytest

from asyncrl.plan.costs import Profile, load_profile
from asyncrl.plan.scale import Scaling
from asyncrl.plan.search import projection, schedule_for
from asyncrl.plan.sim import simulate
from asyncrl.engines.cost_model import LongTail

GB = 1e9


@pytest.mark.timeout(10)
def test_publish_follows_the_tree_and_the_ring_formulas():
    tree = Scaling(weight_bytes=10 * GB, publish_gb_per_s=20.0)  # one hop: 0.5 s
    assert [tree.publish_s(n) for n in (1, 2, 3, 7, 8, 64)] == pytest.approx([0.5, 1.0, 1.0, 1.5, 2.0, 3.5])
    assert tree.publish_s(512) == pytest.approx(0.5 * math.ceil(math.log2(513)))
    ring = Scaling(weight_bytes=10 * GB, publish_gb_per_s=20.0, publish_topology="ring", publish_hop_latency_s=0.01)
    # NCCL's pipelined ring: every link carries the weights once (0.5 s), each receiver adds its fill
    assert ring.publish_s(10) == pytest.approx(0.5 + 0.1) and ring.publish_s(100) == pytest.approx(0.5 + 1.0)
    t = ring.publish_terms(100)
    assert t["transfer_s"] == pytest.approx(0.5) and t["fanout_s"] == pytest.approx(1.0) and "ring" in t["model"]
    assert tree.publish_terms(8)["fanout_s"] == pytest.approx(1.5) and "tree" in tree.publish_terms(8)["model"]
    assert Scaling().publish_s(1000) == 0.0  # no weight_bytes: the profile's fixed publish_s only
    with pytest.raises(ValueError, match="scaling.publish_topology"):
        Scaling(publish_topology="star")


@pytest.mark.timeout(10)
def test_collective_bandwidth_term_saturates_and_latency_term_grows_with_ranks():
    s = Scaling(grad_bytes=40 * GB, collective_gb_per_s=40.0, collective_hop_latency_s=1e-4, collectives_per_sync=10, grad_syncs_per_step=2)
    assert s.collective_s(1) == 0.0
    for n in (2, 8, 64, 512):
        assert s.collective_s(n) == pytest.approx(2 * (2 * (n - 1) / n * 1.0 + 10 * 2 * (n - 1) * 1e-4))
    bw_only = Scaling(grad_bytes=40 * GB, collective_gb_per_s=40.0)
    assert bw_only.collective_s(512) / bw_only.collective_s(64) == pytest.approx((511 / 512) / (63 / 64))  # < 1.02
    assert s.collective_s(512) > 1.5 * s.collective_s(8)  # the latency term: 2 x 10 x 511 hops of 0.1 ms
    with pytest.raises(ValueError, match="scaling.grad_syncs_per_step"):
        Scaling(grad_syncs_per_step=0)


def small(**scaling: float) -> Profile:
    return Profile(name="small", gpus_per_server=1, max_concurrency=4, token_cost_s=0.01, trainer_tokens_per_s_per_gpu=2000.0,
                   lengths=LongTail(short_tokens=50, long_fraction=0.0, jitter=0.0), groups=8, group_size=4, base_gpus=16, eta=2,
                   publish_s=0.1, split_step=4, scaling=Scaling(**scaling))


@pytest.mark.timeout(30)
def test_a_split_costs_its_broadcast_and_collective_and_a_sync_step_grows_by_them():
    """Equal lengths, sync: a step is generation + training + publish exactly, so doubling the
    cluster (weak scaling: same per-GPU work) adds the formulas' growth and nothing else."""
    p = small(weight_bytes=2 * GB, publish_gb_per_s=10.0, grad_bytes=4 * GB, collective_gb_per_s=10.0,
              collective_hop_latency_s=1e-3, collectives_per_sync=4)
    c = p.costs(8, 8)
    assert c.publish_s == pytest.approx(0.1 + 0.2 * math.ceil(math.log2(9)))
    assert c.step_overhead_s == pytest.approx(2 * 7 / 8 * 0.4 + 4 * 2 * 7 * 1e-3)
    assert p.colocated(16).publish_s == pytest.approx(0.1)  # colocated weights move within each GPU: no broadcast
    step = {g: simulate(p.costs(g // 2, g // 2), schedule_for(p, "sync", 4, 1), seeds=1)["step_s"] for g in (16, 64)}
    grown = (p.scaling.publish_s(32) - p.scaling.publish_s(8)) + (p.scaling.collective_s(32) - p.scaling.collective_s(8))
    assert grown > 0.3 and step[64] - step[16] == pytest.approx(grown, rel=0.02)


@pytest.mark.timeout(60)
def test_projection_speedup_falls_with_size_once_the_broadcast_grows():
    """Equal lengths: without scaling costs the projection is flat (weak scaling); a broadcast
    that grows with the servers slows only the split pipeline (colocated sync reshards in place)."""
    flat = projection(small(), [16, 64, 256], steps=4, warmup=1)
    assert len({r["speedup_vs_sync"] for r in flat}) == 1 and flat[0]["speedup_vs_sync"] > 1
    grows = projection(small(weight_bytes=0.25 * GB, publish_gb_per_s=10.0), [16, 64, 256], steps=4, warmup=1)
    speedups = [r["speedup_vs_sync"] for r in grows]
    assert speedups[0] > speedups[1] > speedups[2], speedups
    assert grows[-1]["step_s"] > 1.15 * grows[0]["step_s"] and grows[-1]["sync_step_s"] == flat[-1]["sync_step_s"]


@pytest.mark.timeout(10)
def test_public_profile_scaling_grows_slowly_from_its_reference_split():
    s = load_profile("qwen2.5-math-7b-h800").scaling
    # NCCL's ring: 15.23 GB over one 40 GB/s link once, plus 72 us of pipeline fill per rollout GPU
    assert 0.38 < s.publish_s(64) < s.publish_s(512) < 0.45
    assert 6.0 < s.collective_s(64) < s.collective_s(512) < 1.25 * s.collective_s(64)


@pytest.mark.timeout(10)
def test_longest_of_n_draws_grows_with_n_up_to_the_cap():
    import random

    from asyncrl.plan.scale import longest_tokens, straggler_terms

    lengths = LongTail(short_tokens=600, long_fraction=0.025, long_factor=32.0)
    rng = random.Random(0)
    for n, trials in ((16, 5000), (256, 400)):  # n=16: a third of the trials hold a long sample (the mean's error ~2%)
        mc = sum(max(lengths.draw(rng) for _ in range(n)) for _ in range(trials)) / trials
        assert longest_tokens(lengths, n) == pytest.approx(mc, rel=0.05)  # exact vs Monte Carlo
    grows = [longest_tokens(lengths, n) for n in (1, 16, 256, 4096, 65536)]
    assert grows == sorted(grows) and grows[0] == pytest.approx(lengths.mean, rel=1e-6) and grows[-1] <= lengths.max
    assert longest_tokens(LongTail(short_tokens=50, long_fraction=0.0, jitter=0.0), 1000) == pytest.approx(50)  # no spread: no straggler
    t = straggler_terms(lengths, 8192, 2048, 0.01)
    assert t["seconds"] == pytest.approx((longest_tokens(lengths, 8192) - longest_tokens(lengths, 2048)) * 0.01) and t["seconds"] > 0


@pytest.mark.timeout(60)
def test_projection_rows_carry_their_terms_and_the_limits_where_they_bite():
    from asyncrl.plan.search import limits

    p = small(weight_bytes=2 * GB, publish_gb_per_s=10.0, publish_topology="ring", publish_hop_latency_s=1e-3,
              grad_bytes=4 * GB, collective_gb_per_s=10.0, collective_hop_latency_s=1e-3, collectives_per_sync=4)
    rows = projection(p, [16, 64], steps=4, warmup=1)
    for r in rows:
        t = r["terms"]
        assert t["publish_fanout"]["receivers"] == r["rollout_gpus"] and "ring" in t["publish_fanout"]["model"]
        assert t["publish_fanout"]["fanout_s"] == pytest.approx(r["rollout_gpus"] * 1e-3)
        assert t["all_reduce"]["ranks"] == r["trainer_gpus"] and t["all_reduce"]["seconds"] == pytest.approx(p.scaling.collective_s(r["trainer_gpus"]))
        assert t["sync_all_reduce"]["ranks"] == r["gpus"] and "seconds" in t["straggler"]
    assert rows[0]["weak_scaling_efficiency"] == 1.0 and 0 < rows[1]["weak_scaling_efficiency"] <= 1.0
    lim = limits(p, rows[0], upto=1 << 16)
    # the all-reduce's latency term, 4 x 2 x (n - 1) ms per step, first reaches 10% of the first row's step at a larger budget
    assert lim["all_reduce_gpus"] is not None and lim["all_reduce_gpus"] > rows[0]["gpus"]
    n = lim["all_reduce_gpus"] * rows[0]["trainer_gpus"] // rows[0]["gpus"]
    assert p.scaling.collective_s(n) - p.scaling.collective_s(rows[0]["trainer_gpus"]) >= 0.1 * rows[0]["version_s"]
    assert lim["sync_straggler_gpus"] is None  # equal lengths: the longest of N is the shortest
