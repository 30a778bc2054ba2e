"""The elastic benchmark's analysis: metrics.jsonl / fleet_events.jsonl rows -> phase figures (no Ray)."""

import pytest

from asyncrl.bench.elastic import (Load, event_counts, join_records, join_windows, phase_figures, publish_split, rate,
                                   seconds_to_rate, seconds_to_size, start_windows, targets, total_steps, trained_curve)


def _rows(t0, rates, step_s=1.0, publish_s=0.05):
    """A step-0 row at t0, then one step every `step_s` at each of `rates` (tokens/s), one rate per step."""
    rows = [{"step": 0, "time": t0}]
    for i, r in enumerate(rates, start=1):
        rows.append({"step": i, "time": t0 + i * step_s, "train/tokens": r * step_s, "weights/publish_s": publish_s,
                     "fleet/size_main": 4.0})
    return rows


def test_the_rate_interpolates_between_steps():
    curve = trained_curve(_rows(100.0, [400.0] * 10))
    assert curve[0] == (100.0, 0.0) and curve[-1] == (110.0, 4000.0)
    assert rate(curve, 100.5, 103.5) == pytest.approx(400.0)  # windows that cut steps in the middle
    assert rate(curve, 109.0, 111.0) is None  # past the last step: not measured
    assert rate(curve, 103.0, 103.0) is None


def test_seconds_to_rate_is_the_start_of_the_first_window_at_the_rate():
    curve = trained_curve(_rows(0.0, [100.0] * 10 + [400.0] * 20))  # the rate goes up at t = 10
    assert seconds_to_rate(curve, 10.0, 30.0, 0.9 * 400) == 0.0
    assert seconds_to_rate(curve, 5.0, 30.0, 0.9 * 400) == 4.5  # [9.5, 14.5]: 0.5 s at 100, 4.5 s at 400 = 370 >= 360
    assert seconds_to_rate(curve, 0.0, 10.0, 0.9 * 400) is None


def test_phases_take_their_steady_rate_after_the_settle_time_and_compare_it_with_capacity():
    load = Load(token_cost_s=0.02, max_concurrency=2)  # 100 tokens/s per server
    rates = [100.0] * 10 + [380.0] * 30 + [190.0] * 30  # 1 server, then 4, then 2
    rows = _rows(0.0, rates)
    events = [{"time": 10.0, "kind": "join", "size": {"main": 4}}, {"time": 40.5, "kind": "drain", "size": {"main": 2}}]
    phases = phase_figures(rows, events, [(1, 0.0), (4, 10.0), (2, 40.0)], end=70.0, load=load, settle_s=5.0)
    assert [p["servers"] for p in phases] == [1, 4, 2]
    assert [(p["start_s"], p["end_s"]) for p in phases] == [(0.0, 10.0), (10.0, 40.0), (40.0, 70.0)]
    assert [p["trained_tokens_per_s"] for p in phases] == [100.0, 380.0, 190.0]
    assert [p["capacity_tokens_per_s"] for p in phases] == [100.0, 400.0, 200.0]
    assert [p["ratio"] for p in phases] == [1.0, 0.95, 0.95]
    assert [p["seconds_to_size"] for p in phases] == [0.0, 0.0, 0.5]
    assert phases[1]["seconds_to_new_rate"] == 0.0 and phases[2]["seconds_to_new_rate"] == 0.0  # a shrink meets ">= new" at once
    assert [p["steps"] for p in phases] == [9, 30, 31]  # a step at a change's time is the new phase's; the last one counts and phases[0]["publish_s_mean"] == 0.05
    assert phases[2]["routed_at_end"] == 4


def test_a_grow_that_takes_its_time_shows_in_seconds_to_size_and_to_new_rate():
    load = Load(token_cost_s=0.02, max_concurrency=2)
    rows = _rows(0.0, [100.0] * 28 + [400.0] * 32)  # asked at 20 s, at the new rate from 28 s
    events = [{"time": 26.0, "kind": "start", "size": {"main": 1}}, {"time": 27.0, "kind": "join", "size": {"main": 2}},
              {"time": 27.5, "kind": "join", "size": {"main": 3}}, {"time": 28.0, "kind": "join", "size": {"main": 4}}]
    phases = phase_figures(rows, events, [(1, 0.0), (4, 20.0)], end=60.0, load=load, settle_s=1.0)
    assert phases[1]["seconds_to_size"] == 8.0
    assert phases[1]["trained_tokens_per_s"] == 400.0  # from 29 s: the ramp is not in the steady rate
    assert phases[1]["seconds_to_new_rate"] == 7.5  # [27.5, 32.5]: 0.5 s at 100, 4.5 s at 400 = 370 >= 360
    assert phases[1]["seconds_to_new_rate_after_start"] == 1.5  # the same window, from the processes up at 26 s
    assert phases[0]["seconds_to_new_rate_after_start"] is None
    assert seconds_to_size(events, 20.0, 5) is None


def test_a_publish_overlapping_a_join_or_the_first_publish_after_it_counts_as_during_the_join():
    rows = [{"step": 0, "time": 0.0}] + [{"step": i, "time": float(i), "weights/publish_s": 0.1} for i in range(1, 11)]
    rows[5]["weights/publish_s"] = 0.4  # publish over [4.6, 5.0]
    events = [
        {"time": 4.8, "kind": "start", "server": "main-4"}, {"time": 4.9, "kind": "join", "server": "main-4", "via": "peer", "seconds": 0.1},
        {"time": 7.95, "kind": "start", "server": "main-5"}, {"time": 8.0, "kind": "join", "server": "main-5", "via": "publish", "seconds": 0.05},
    ]
    windows = join_windows(events, rows)
    assert windows == [(4.8, 6.0), (7.95, 9.0)]  # to the end of the first publish that began after the join
    got = publish_split(rows, {"join": windows, "starting": [(2.95, 3.0)]})
    assert got["join"] == [0.4, 0.1, 0.1, 0.1]  # steps 5, 6 (the first after main-4's join), 8 (overlaps), 9
    assert got["starting"] == [0.1] and len(got["without"]) == 5


def test_start_windows_run_from_a_grows_request_to_its_start_events():
    events = [{"time": 12.0, "kind": "start"}, {"time": 12.0, "kind": "start"}, {"time": 31.0, "kind": "drain"},
              {"time": 47.0, "kind": "start"}]
    assert start_windows(events, [(4, 0.0), (8, 2.0), (2, 30.0), (6, 35.0)]) == [(2.0, 12.0), (35.0, 47.0)]


def test_join_records_find_each_servers_first_sample_in_the_snapshots_even_when_a_name_comes_back():
    events = [
        {"time": 10.0, "kind": "start", "server": "main-2"}, {"time": 10.2, "kind": "join", "server": "main-2", "via": "peer", "seconds": 0.2},
        {"time": 30.0, "kind": "drain", "server": "main-2"},
        {"time": 50.0, "kind": "start", "server": "main-2"}, {"time": 50.1, "kind": "join", "server": "main-2", "via": "peer", "seconds": 0.1},
        {"time": 60.0, "kind": "start", "server": "main-3"}, {"time": 60.1, "kind": "join", "server": "main-3", "via": "trainer", "seconds": 0.1},
        {"time": 61.0, "kind": "start", "server": "main-4"}, {"time": 62.5, "kind": "join", "server": "main-4", "via": "publish"},
    ]
    snapshots = [(11.0, {"main-2": 0}), (12.5, {"main-2": 64}), (49.0, {"main-0": 900}), (51.0, {"main-2": 0}), (53.0, {"main-2": 70})]
    got = join_records(events, snapshots)
    assert [(j["server"], j["via"], j["first_sample_s"]) for j in got[:3]] == [("main-2", "peer", 2.5), ("main-2", "peer", 3.0), ("main-3", "trainer", None)]
    assert [j["seconds"] for j in got] == [0.2, 0.1, 0.1, 1.5]  # a join via a publish has no `seconds`: start to join


def test_event_counts_say_what_the_fleet_recorded():
    events = [{"kind": "join", "via": "peer"}] * 3 + [{"kind": "join", "via": "publish"}, {"kind": "drain"}, {"kind": "drain"},
                                                       {"kind": "preempt", "replaced": False}, {"kind": "preempt", "replaced": True}, {"kind": "restart"}]
    assert event_counts(events) == {"joins_by_source": {"peer": 3, "publish": 1, "trainer": 0}, "drains": 2,
                                    "preemptions": {"total": 2, "replaced": 1}, "restarts": 1}


def test_targets():
    phases = [{"seconds_to_new_rate": 40.0}] + [{"seconds_to_new_rate": s, "seconds_to_new_rate_after_start": u}
                                                 for s, u in ((6.0, 2.0), (0.0, None), (9.5, 3.0))]  # 4 -> 8 -> 2 -> 6
    res = {"phases": phases, "publish_s_during_join": 0.1, "publish_s_without": 0.05, "lost": 0, "trained_twice": 0}
    t = targets(res)
    assert all(v["met"] for v in t.values())  # 0.1 <= 1.1 * 0.05 + 0.05; the first phase (the run's start) is not a change
    res.update(publish_s_during_join=0.2, lost=None, phases=phases[:-1] + [{"seconds_to_new_rate": None, "seconds_to_new_rate_after_start": 12.0}])
    t = targets(res)
    assert not any(v["met"] for v in t.values() if v is not t["trained_twice"]) and t["trained_twice"]["met"]
    assert targets({**res, "publish_s_during_join": None})["join_publish"]["met"] is None


def test_total_steps_are_what_the_phases_train_at_capacity_and_the_grows_while_their_servers_start():
    load = Load()  # 100 tokens/s per server, 512 tokens per step
    tokens = 50.0 * (400 + 800 + 200 + 600) + 15.0 * (400 + 200)  # the two grows: 15 s at the old size each
    assert total_steps(50.0, load) == 213 and 212 * 512 < tokens <= 213 * 512
