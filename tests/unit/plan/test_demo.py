"""The demo calibration reads back the costs a run's metrics were made of, and its prediction of
that run is the run's measured throughput (the real runs are tests/integration/test_plan_validate.py)."""

from __future__ import annotations

import json

import pytest

from asyncrl.plan.demo import calibrate, mean_costs, measure, read_metrics
from asyncrl.plan.sim import Schedule, simulate


def sync_rows(steps: int, wait: float, train_per_token: float, publish: float, other: float, tokens: int = 256) -> list[dict]:
    """Rows as the controller logs them for a sync run whose every step costs the same."""
    t, rows = 100.0, []
    for s in range(1, steps + 1):
        t += wait + tokens * train_per_token + publish + other
        rows.append({"step": s, "time": t, "time/wait_rollout_s": wait, "time/train_s": tokens * train_per_token,
                     "weights/publish_s": publish, "train/tokens": tokens, "rollout/response_length": 4.0})
    return rows


@pytest.mark.timeout(30)
def test_calibrate_recovers_the_components_and_predicts_the_run(tmp_path):
    rows = sync_rows(12, wait=0.06, train_per_token=0.001, publish=0.02, other=0.005)
    path = tmp_path / "run"
    path.mkdir()
    (path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in [{"step": 0, "time": 99.0, "eval/reward": 0.0}, *rows[::-1]]))
    rows = read_metrics(path)
    assert [r["step"] for r in rows] == list(range(1, 13))  # the eval-only row 0 is left out, steps sorted
    c = calibrate(rows, groups=8, group_size=8, warmup=3)
    assert c.token_cost_s == pytest.approx(0.015) and c.trainer_s_per_token == pytest.approx(0.001)
    assert c.publish_s == pytest.approx(0.02) and c.step_overhead_s == pytest.approx(0.005, abs=1e-6) and c.response_tokens == 4
    m = measure(rows, warmup=3)
    assert m["step_s"] == pytest.approx(0.341) and m["trained_tokens_per_s"] == pytest.approx(256 / 0.341)
    p = simulate(c.costs(), Schedule(mode="sync", steps=8, warmup=3), seeds=1)
    assert p["trained_tokens_per_s"] == pytest.approx(m["trained_tokens_per_s"], rel=0.02)
    # overlapped, the same components predict a faster run: the trainer (0.256 s/step) is then the bound
    fa = simulate(c.costs(), Schedule(mode="fully_async", eta=4, steps=8, warmup=3), seeds=1)
    assert fa["trained_tokens_per_s"] > 1.2 * p["trained_tokens_per_s"]
    assert fa["trained_tokens_per_s"] <= 1.01 * 256 / (0.256 + 0.005)


@pytest.mark.timeout(30)
def test_calibration_runs_are_averaged_component_by_component():
    """A slow calibration run (every part 1.5x) moves the costs half as far when averaged with a normal one."""
    normal = calibrate(sync_rows(12, wait=0.06, train_per_token=0.001, publish=0.02, other=0.004), groups=8, group_size=8, warmup=3)
    slow = calibrate(sync_rows(12, wait=0.09, train_per_token=0.0015, publish=0.03, other=0.006), groups=8, group_size=8, warmup=3)
    c = mean_costs([normal, slow])
    assert c.token_cost_s == pytest.approx(0.01875) and c.trainer_s_per_token == pytest.approx(0.00125)
    assert c.publish_s == pytest.approx(0.025) and c.step_overhead_s == pytest.approx(0.005, abs=1e-6)
    assert (c.response_tokens, c.groups, c.group_size) == (4, 8, 8)


@pytest.mark.timeout(30)
def test_too_short_a_run_names_the_key():
    with pytest.raises(ValueError, match="trainer.total_steps"):
        measure(sync_rows(5, 0.06, 0.001, 0.02, 0.005), warmup=3)


@pytest.mark.timeout(30)
def test_contention_slows_only_overlapped_modes_and_is_fitted_back():
    """Sync never overlaps generation and training, so contention leaves it alone; one_step_off
    overlaps them, so it slows; `fit_contention` recovers the factor a prediction was made with."""
    from dataclasses import replace

    from asyncrl.plan.demo import fit_contention

    c = calibrate(sync_rows(12, wait=0.06, train_per_token=0.001, publish=0.02, other=0.005), groups=8, group_size=8, warmup=3)
    sync, off = Schedule(mode="sync", steps=8, warmup=3), Schedule(mode="one_step_off", steps=8, warmup=3)
    base = {s.mode: simulate(c.costs(), s, seeds=1)["trained_tokens_per_s"] for s in (sync, off)}
    slow = {s.mode: simulate(replace(c, contention=2.5).costs(), s, seeds=1)["trained_tokens_per_s"] for s in (sync, off)}
    assert slow["sync"] == pytest.approx(base["sync"], rel=1e-6)
    assert slow["one_step_off"] < 0.9 * base["one_step_off"]
    assert fit_contention(c, off, slow["one_step_off"]) == pytest.approx(2.5, rel=0.02)
    assert fit_contention(c, off, 1.1 * base["one_step_off"]) == 1.0  # faster than no contention: none fitted
