"""`asyncrl bench learn`: the runs it plans, each run's curve and figures, parity with sync at equal trained
samples, reading a finished run from its directory, the table and the plot, all from fake run outputs (pure:
no training run)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from asyncrl.bench import learn as bl


def _rows(accs: list[float], per_step: int = 64, eval_every: int = 2, key: str = "eval/reward", t0: float = 1000.0,
          step_s: float = 10.0, samples: bool = True) -> list[dict]:
    """metrics.jsonl of a run: the step-0 evaluation, then a row per step, an evaluation every `eval_every` steps."""
    rows = [{"step": 0, "time": t0, key: accs[0], "eval/reward": accs[0]}]
    for step in range(1, eval_every * (len(accs) - 1) + 1):
        r = {"step": step, "time": t0 + 5.0 + step * step_s, "train/tokens": 100.0}
        if samples:
            r["trained_samples"] = step * per_step
        if step % eval_every == 0:
            acc = accs[step // eval_every]
            r.update({key: acc, "eval/reward": acc})
        rows.append(r)
    return rows


def _summary(steps: int, wall_s: float = 50.0) -> dict:
    return {"steps": steps, "trained_samples": steps * 64, "wall_s": wall_s, "staleness_mean": 1.5,
            "curve": [], "final_eval_reward": 0.0}


def _gens(steps: list[int], k: int = 4) -> list[dict]:
    return [{"step": s, "version": s, "uid": f"eval-{i}", "prompt": f"q{i}", "response": f"#### {s}", "answer": "1",
             "reward": float(s > 0), "finish_reason": "stop", "response_length": 3} for s in steps for i in range(k)]


def test_plan_runs_labels_modes_then_the_ablation():
    assert bl.plan_runs(["sync", "fully_async"], False, "decoupled_ppo") == [
        ("sync", ["trainer.mode=sync"]), ("fully_async", ["trainer.mode=fully_async"])]
    runs = dict(bl.plan_runs(["fully_async"], True, "decoupled_ppo"))
    assert list(runs) == ["fully_async", "eta4_decoupled_ppo", "eta4_none", "eta8_decoupled_ppo", "eta8_none"]
    assert runs["eta8_none"] == ["trainer.mode=fully_async", "trainer.max_staleness=8", "trainer.admission=bound",
                                 "algorithm.correction=none"]
    assert [k for k, _ in bl.plan_runs([], True, "none")] == ["eta4_none", "eta8_none"]  # `none` once


def test_curve_points_use_exact_when_logged_and_the_first_row_as_time_zero():
    rows = _rows([0.1, 0.2, 0.4], key="eval/exact")
    rows[1]["eval/reward"] = 0.99  # a non-eval row's reward is not a point
    pts = bl.curve_points(rows)
    assert [(p["step"], p["trained_samples"], p["wall_s"], p["accuracy"]) for p in pts] == [
        (0, 0, 0.0, 0.1), (2, 128, 25.0, 0.2), (4, 256, 45.0, 0.4)]
    assert bl.accuracy_key(rows) == "eval/exact" and bl.accuracy_key(_rows([0.1, 0.2])) == "eval/reward"


def test_curve_points_fall_back_to_steps_times_samples_per_step():
    pts = bl.curve_points(_rows([0.0, 0.5], samples=False), per_step=32)
    assert [p["trained_samples"] for p in pts] == [0, 64]
    assert [p["trained_samples"] for p in bl.curve_points(_rows([0.0, 0.5], samples=False))] == [0, None]
    assert bl.curve_points([]) == []


def test_run_figures_final_is_the_mean_of_the_last_three_evaluations_after_step_0():
    r = bl.run_figures(_summary(10), _rows([0.1, 0.2, 0.3, 0.4, 0.5, 0.6]), _gens([0, 4, 10]))
    assert r["untrained_accuracy"] == 0.1 and r["final_accuracy"] == pytest.approx(0.5)
    assert r["gain"] == pytest.approx(0.4) and r["target_gain_met"] is True
    assert (r["staleness_mean"], r["wall_s"], r["trained_samples"], len(r["points"])) == (1.5, 50.0, 640, 6)
    assert [g["step"] for g in r["samples"]["first"]] == [0, 0, 0] and [g["step"] for g in r["samples"]["last"]] == [10] * 3
    assert set(r["samples"]["last"][0]) == {"step", "prompt", "response", "reward"}
    short = bl.run_figures(_summary(2), _rows([0.3, 0.4]), [])  # --quick: one evaluation after step 0
    assert short["final_accuracy"] == 0.4 and short["target_gain_met"] is False
    assert short["samples"] == {"first": [], "last": []}
    none = bl.run_figures(_summary(0), _rows([0.3]), [])
    assert none["final_accuracy"] is None and none["gain"] is None and none["target_gain_met"] is None


def test_interp_is_linear_between_points_and_flat_beyond_them():
    pts = [{"trained_samples": x, "accuracy": y} for x, y in ((100, 0.5), (0, 0.1), (200, 0.3))]
    assert bl.interp(pts, 50) == pytest.approx(0.3) and bl.interp(pts, 150) == pytest.approx(0.4)
    assert bl.interp(pts, -5) == 0.1 and bl.interp(pts, 500) == 0.3 and bl.interp(pts, 100) == 0.5


def test_parity_compares_at_equal_trained_samples_and_interpolates_a_different_grid():
    sync = {"points": bl.curve_points(_rows([0.1, 0.2, 0.3, 0.4, 0.5]))}  # an evaluation every 128 samples
    same = {"points": bl.curve_points(_rows([0.1, 0.2, 0.35, 0.45, 0.55]))}
    assert bl.parity(sync, same) == pytest.approx(0.05)
    fine = {"points": bl.curve_points(_rows([0.1] + [0.5] * 8, eval_every=1))}  # every 64: sync interpolated
    assert bl.parity(sync, fine) == pytest.approx(0.5 - (0.4 + 0.45 + 0.5) / 3)  # at 384, 448, 512 samples
    assert bl.parity(sync, {"points": bl.curve_points(_rows([0.1]))}) is None


def test_aggregate_sets_the_targets_and_leaves_parity_out_without_both_modes():
    sync = {"points": bl.curve_points(_rows([0.1, 0.5, 0.5, 0.5])), "wall_s": 90.0}
    fa = {"points": bl.curve_points(_rows([0.1, 0.45, 0.46, 0.47])), "wall_s": 60.0}
    res = bl.aggregate({"sync": sync, "fully_async": fa})
    assert res["fully_async_minus_sync"] == pytest.approx(-0.04) and res["target_parity_met"] is False
    assert res["fully_async_speedup"] == pytest.approx(1.5)
    assert res["targets"] == {"gain_min": 0.25, "fully_async_within": 0.03}
    fa["points"][-1]["accuracy"] = 0.52
    assert bl.aggregate({"sync": sync, "fully_async": fa})["target_parity_met"] is True
    alone = bl.aggregate({"fully_async": fa})
    assert alone["fully_async_minus_sync"] is None and alone["target_parity_met"] is None
    failed = bl.aggregate({"sync": {"error": "boom"}, "fully_async": fa})
    assert failed["fully_async_minus_sync"] is None


def _write_run(run: Path, steps: int, accs: list[float]) -> None:
    run.mkdir(parents=True)
    (run / "summary.json").write_text(json.dumps(_summary(steps)))
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _rows(accs)))
    (run / "generations.jsonl").write_text("".join(json.dumps(g) + "\n" for g in _gens([0, steps])))


def test_a_finished_run_with_the_requested_steps_is_read_not_rerun(tmp_path, monkeypatch):
    _write_run(tmp_path / "sync", 4, [0.1, 0.3, 0.6])
    monkeypatch.setattr(bl.subprocess, "Popen", lambda *a, **k: pytest.fail("reran a finished run"))
    r = bl.train_once("sync", ["trainer.mode=sync"], [], tmp_path, 4, None)
    assert r["reused"] and r["label"] == "sync" and r["final_accuracy"] == pytest.approx(0.45)
    assert bl.read_run(tmp_path / "sync")["untrained_accuracy"] == 0.1
    assert not bl._done(tmp_path / "sync", 6) and not bl._done(tmp_path / "missing", 4)


def test_table_and_plot_from_a_result(tmp_path):
    sync = bl.run_figures(_summary(6, wall_s=90.0), _rows([0.1, 0.3, 0.4, 0.5]), [])
    fa = bl.run_figures(_summary(6, wall_s=60.0), _rows([0.1, 0.3, 0.4, 0.49]), [])
    runs = {"sync": sync, "fully_async": fa, "eta4_none": {"label": "eta4_none", "error": "Killed"}}
    res = {"runs": runs, **bl.aggregate(runs)}
    text = bl.table(res)
    assert "| sync | 0.100 | 0.400 | +0.300 | yes |" in text and "failed: Killed" in text
    assert "fully_async - sync at equal trained samples: -0.003 (target >= -0.03: met)" in text
    assert "sync wall / fully_async wall: 1.50x" in text and "met by 2 of 2 runs" in text
    pytest.importorskip("matplotlib")
    assert bl.plot(res, tmp_path / "learn.png") and (tmp_path / "learn.png").stat().st_size > 1000


def test_recipe_and_command_line():
    assert bl.RECIPE.name == "smollm2_arith.yaml" and bl.RECIPE.parent.name == "configs"
    with pytest.raises(SystemExit):
        bl.main(["--modes", "sync,nope"])
