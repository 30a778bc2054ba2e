"""`asyncrl bench controller`: a case's row from two fake runs, the flatness, the table, a failed run's error
(pure), and the `--quick` path once for real (two cost-model runs of 2 and 6 steps, about 15 s)."""

from __future__ import annotations

import json
import math

import pytest

from asyncrl.bench import controller as bc

ROW_KEYS = {"servers", "group", "trajectories", "trajectories_per_s", "controller_cpu_ms_per_trajectory",
            "samples_in_flight_max", "event_loop_lag_ms", "event_loop_lag_ms_max", "wall_s"}


def _run(servers: int, trajectories: int, loop_s: float, cpu_s: float, group: int = 8) -> dict:
    return {"servers": servers, "group": group, "trajectories": trajectories, "loop_s": loop_s, "cpu_s": cpu_s,
            "samples_in_flight_max": servers * 16, "event_loop_lag_ms": 0.5, "event_loop_lag_ms_max": 12.0}


def test_a_row_is_the_difference_of_the_long_and_the_short_run():
    r = bc.case_row(_run(16, 512, 1.0, 5.0), _run(16, 2560, 3.0, 5.2))
    assert set(r) == ROW_KEYS and r["trajectories"] == 2048 and r["wall_s"] == 3.0
    assert r["trajectories_per_s"] == pytest.approx(2560 / 3.0)  # the long run's own loop: start-up is not in it
    assert r["controller_cpu_ms_per_trajectory"] == pytest.approx(0.2 / 2048 * 1000)
    assert r["event_loop_lag_ms"] == 0.5 and r["event_loop_lag_ms_max"] == 12.0 and r["samples_in_flight_max"] == 256


def test_a_long_run_with_no_more_trajectories_is_an_error():
    with pytest.raises(RuntimeError, match="S2 > S1"):
        bc.case_row(_run(4, 512, 1.0, 5.0), _run(4, 512, 1.0, 5.0))


def test_flat_ratio_is_over_server_counts_at_group_8_only():
    rows = [bc.case_row(_run(n, 512, 1.0, 5.0, g), _run(n, 1536, 2.0, 5.0 + cpu, g))
            for n, g, cpu in ((4, 8, 0.1), (16, 8, 0.11), (64, 1, 1.0))]
    assert bc.flat_ratio(rows) == pytest.approx(1.1)
    assert bc.flat_ratio(rows[:1]) is None and bc.flat_ratio(rows, group=1) is None
    res = {"rows": rows, "mode": "embedded", "cores": 2, "steps": [4, 16], "flat_ratio_group8": bc.flat_ratio(rows)}
    text = bc.table(res)
    assert "| 4 | 8 | 1024 | 768 | 0.0977 | 2.0 | 64 | 0.50 / 12.0 | 2.0 |" in text
    assert "64 servers, group 1: 19.5 times the target of 0.05 ms per trajectory (missed)" in text
    assert "(max / min, target 1.2): 1.10 (met)" in text


def test_a_failed_run_raises_with_its_command_and_last_lines(tmp_path, monkeypatch):
    monkeypatch.setattr(bc, "COMMON", ("rollout.no_such_key=1",))
    with pytest.raises(RuntimeError) as e:
        bc.train_once(4, 8, 2, False, tmp_path, "bad")
    msg = str(e.value)
    assert "run bad failed (exit" in msg and "rollout.no_such_key=1" in msg and "asyncrl.cli train" in msg


def test_quick_runs_two_real_cost_model_runs(tmp_path, capsys):
    """The real path: `asyncrl train` at 4 servers, group 8, for 2 then 6 steps; about 15 s on 2 cores."""
    assert bc.main(["--quick", "--json", "--out", str(tmp_path)]) == 0
    res = json.loads(capsys.readouterr().out)
    assert {"rows", "target_cpu_ms_per_trajectory", "flat_ratio_group8", "cores", "mode"} <= set(res)
    assert res["target_cpu_ms_per_trajectory"] == 0.05 and res["mode"] == "embedded" and res["cores"] >= 1
    assert res["flat_ratio_group8"] is None  # one server count
    (row,) = res["rows"]
    assert set(row) == ROW_KEYS and (row["servers"], row["group"]) == (4, 8)
    assert row["trajectories"] == 4 * 256  # 4 more steps of 32 prompts x 8
    cpu = row["controller_cpu_ms_per_trajectory"]
    assert math.isfinite(cpu) and cpu > 0
    assert row["trajectories_per_s"] > 0 and row["samples_in_flight_max"] > 0
    assert 0 <= row["event_loop_lag_ms"] <= row["event_loop_lag_ms_max"]  # the run logged its loop's lag per step
    short, long = res["runs"]
    # each run's own figures (no order between the two: under a loaded host a 2-step run can take longer than a 6-step one)
    assert (short["steps"], long["steps"]) == (2, 6) and short["cpu_s"] > 0 and long["cpu_s"] > 0
    assert short["loop_s"] > 0 and 0 < long["loop_s"] <= long["summary_wall_s"] + 0.1
    assert json.loads((tmp_path / "results.json").read_text())["rows"] == res["rows"]
