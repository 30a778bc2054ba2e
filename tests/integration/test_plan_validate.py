"""`asyncrl plan --validate` against the real cost-model bench (quick loads, ~20 s) and one real
demo run (a sync calibration run, then a fully_async run predicted from it, 10 steps each, ~20 s;
the engine sweep that prices concurrency runs on its own in its quick form, ~6 s; the
one_step_off calibration run that fits the contention is left to `--validate-kind demo_run`
and its fit to tests/unit/plan/test_demo.py)."""

from __future__ import annotations

import json

import pytest

from asyncrl.cli import main


@pytest.mark.timeout(120)
def test_validate_prints_every_case_with_its_error(capsys):
    assert main(["plan", "--validate", "--validate-kind", "cost_model_bench", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    rows = out["validation"]
    assert len(rows) == 6 and {r["kind"] for r in rows} == {"cost_model_bench"}
    for r in rows:
        assert {"case", "predicted", "measured", "rel_error"} <= set(r) and r["measured"] > 0
        assert r["rel_error"] == pytest.approx(abs(r["predicted"] - r["measured"]) / r["measured"], abs=1e-3)
    assert out["max_rel_error"] == max(r["rel_error"] for r in rows)
    assert out["max_rel_error"] < 0.5  # the 2-core host is noisy; the target (0.10) is reported, not asserted


@pytest.mark.timeout(240)
def test_a_real_demo_run_is_predicted_from_a_separate_calibration_run(tmp_path):
    from asyncrl.plan.demo import DEMO_TARGET, WARMUP, demo_cases

    (row,) = demo_cases(("fully_async",), root=tmp_path, steps=WARMUP + 5, overlap_run=False, concurrency=False,
                        seeds=(1,))
    assert row["kind"] == "demo_run" and row["target"] == DEMO_TARGET and row["measured"] > 0 and row["predicted"] > 0
    assert (tmp_path / "calibration" / "sync-seed1" / "metrics.jsonl").is_file()  # the calibration is its own run
    assert (tmp_path / "validation" / "fully_async-seed2" / "metrics.jsonl").is_file()
    assert not (tmp_path / "calibration" / "one_step_off-seed1").exists() and row["detail"]["costs"]["contention"] == 1.0
    costs = row["detail"]["costs"]
    assert costs["response_tokens"] == 4 and 0 < costs["trainer_s_per_token"] < 0.1 and costs["token_cost_s"] > 0
    assert costs["token_cost_slope_s"] == 0.0 and "engine_sweep_s_per_token" not in row["detail"]["calibration"]
    # a shared 2-core host swings a run's speed by 2x between runs; the target (0.15) is reported, not asserted
    assert row["rel_error"] < 3.0


@pytest.mark.timeout(120)
def test_the_real_engine_pays_more_per_token_with_more_requests_in_flight():
    """The torch engine alone in its own process (`engine_sweep --quick`): a batch of 64 costs each
    request's token clearly more than a batch of 2 (measured 3-4x here), so the fitted slope is > 0."""
    from asyncrl.plan.engine_sweep import fit_line, run_sweep

    points = run_sweep(quick=True)
    assert sorted(points) == [2, 64] and all(v > 0 for v in points.values())
    assert points[64] > 1.5 * points[2] and fit_line(points)[1] > 0
