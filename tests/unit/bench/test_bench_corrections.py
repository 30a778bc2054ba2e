"""`asyncrl bench corrections`: rows, ratios against `none`, the table and the skipped settings from fake run
outputs (pure), and the `--quick` path once for real (two demo runs of 6 steps, about 25 s)."""

from __future__ import annotations

import json
import math

import pytest

from asyncrl.bench import corrections as bc


def _summary(final: float, drops: int = 0, wall_s: float = 10.0, steps: int = 4) -> dict:
    return {"steps": steps, "trained_samples": 1000, "final_eval_reward": final, "wall_s": wall_s,
            "drops": {"stale": drops} if drops else {}, "curve": [[0, 0.0], [2, final / 2], [4, final]],
            "staleness_mean": 3.0}


def _metrics(masked: float, clipped: float = 0.0, train_s: float = 0.5, mismatch: bool = True) -> list[dict]:
    rows = [{"step": 0, "eval/reward": 0.0}]  # an eval-only row: no train/tokens, left out
    for step, tokens in ((1, 100.0), (2, 300.0)):
        r = {"step": step, "train/tokens": tokens, "train/correction/masked_frac": masked * step,
             "train/correction/clip_frac": clipped, "time/train_s": train_s}
        if mismatch:
            r.update({"train/mismatch/ess": 0.8, "train/mismatch/logprob_gap_mean": 0.2})
        rows.append(r)
    return rows


def test_run_row_defines_dropped_share_from_stale_groups_and_masked_tokens():
    r = bc.run_row("mis", "eta8", 0, _summary(0.6, drops=5), _metrics(0.1), group_size=8)
    stale = 40 / 1040
    masked = (100 * 0.1 + 300 * 0.2) / 400  # token-weighted over the steps
    assert r["stale_share"] == pytest.approx(stale) and r["masked_share"] == pytest.approx(masked)
    assert r["dropped_share"] == pytest.approx(1 - (1 - stale) * (1 - masked))
    assert r["eval_mean"] == pytest.approx(0.45) and r["step_s"] == pytest.approx(2.5) and r["train_s"] == 0.5
    assert r["ess"] == pytest.approx(0.8) and r["logprob_gap_mean"] == pytest.approx(0.2) and not r["nan"]


def test_mismatch_metrics_are_optional_and_nans_are_flagged():
    r = bc.run_row("none", "eta4", 0, _summary(0.5), _metrics(0.0, mismatch=False), group_size=8)
    assert r["ess"] is None and r["logprob_gap_mean"] is None and r["dropped_share"] == 0.0
    bad = _metrics(0.0)
    bad[1]["train/loss"] = math.nan
    assert bc.run_row("tis", "eta4", 0, _summary(0.5), bad, group_size=8)["nan"]


def test_aggregate_averages_seeds_and_compares_with_none_of_the_same_setting():
    runs = [bc.run_row(c, s, seed, _summary(final), _metrics(0.0), group_size=8)
            for s, c, seed, final in (("eta4", "none", 0, 0.4), ("eta4", "none", 1, 0.6), ("eta4", "tis", 0, 0.75),
                                      ("eta4", "bypass", 0, 0.45), ("eta8", "none", 0, 0.2), ("eta8", "tis", 0, 0.3))]
    runs.append({"correction": "m2po", "setting": "eta8", "seed": 0, "error": "RuntimeError: boom"})
    res = bc.aggregate(runs)
    by = {(r["setting"], r["correction"]): r for r in res["rows"]}
    assert by["eta4", "none"]["final_eval_reward"] == pytest.approx(0.5) and by["eta4", "none"]["seeds"] == 2
    assert by["eta4", "none"]["final_eval_reward_std"] == pytest.approx(math.sqrt(0.02))
    assert by["eta4", "tis"]["reward_vs_none"] == pytest.approx(1.5)
    assert by["eta8", "tis"]["reward_vs_none"] == pytest.approx(1.5) and by["eta8", "none"]["reward_vs_none"] == 1.0
    assert by["eta8", "m2po"]["error"] == "RuntimeError: boom" and by["eta8", "m2po"]["reward_vs_none"] is None
    assert res["noise"] == {"eta4": {"final_eval_reward": pytest.approx(0.05), "eval_mean": pytest.approx(0.0375)}}
    res["skipped"] = {"bf16_rollout": "rollout.dtype: unknown key"}
    text = bc.table(res)
    lines = text.splitlines()
    assert lines[0].startswith("| setting | correction | held-out final | vs none |") and set(lines[1]) == {"|", "-"}
    assert "| eta4 | tis | 0.750 | 1.50 |" in text and "failed: RuntimeError: boom" in text
    assert "skipped setting bf16_rollout: rollout.dtype: unknown key" in text and "noise floor in eta4" in text


def test_a_setting_the_config_refuses_is_skipped_with_its_message():
    assert bc.setting_problem(bc.SETTINGS["eta8"]) == ""
    refused = bc.Setting("x", "", ("rollout.no_such_key=1",))
    assert "rollout.no_such_key" in bc.setting_problem(refused)


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    runs = [bc.run_row(c, "eta4", 0, _summary(f), _metrics(0.1), group_size=8) for c, f in (("none", 0.4), ("tis", 0.5))]
    assert bc.plot(bc.aggregate(runs), tmp_path / "c.png")
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"


def test_quick_runs_two_real_demo_runs(tmp_path, capsys):
    """The real path: two `asyncrl train` subprocesses (none, tis at eta 4, 6 steps); about 25 s on 2 cores."""
    assert bc.main(["--quick", "--json", "--out", str(tmp_path)]) == 0
    res = json.loads(capsys.readouterr().out)
    assert [(r["setting"], r["correction"]) for r in res["rows"]] == [("eta4", "none"), ("eta4", "tis")]
    for r in res["rows"]:
        assert 0 <= r["final_eval_reward"] <= 1 and r["trained_samples"] > 0 and r["step_s"] > 0 and not r["nan"]
        assert 0 <= r["dropped_share"] <= 1
    assert res["rows"][0]["reward_vs_none"] == 1.0
    assert json.loads((tmp_path / "results.json").read_text())["steps"] == 6
