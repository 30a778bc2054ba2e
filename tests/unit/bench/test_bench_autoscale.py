"""`asyncrl bench elastic --autoscale`'s analysis: autoscale.jsonl windows and metrics.jsonl rows -> per-phase figures."""

from asyncrl.bench.autoscale import phase_figures, targets


def _w(t, trainer_idle, rollout_idle, servers, decided=None):
    return {"time": t, "seconds": 5.0, "trainer_idle": trainer_idle, "rollout_idle": rollout_idle, "servers": servers,
            **({"decided": decided} if decided is not None else {"decided": None})}


def test_each_phase_is_measured_from_one_window_after_its_last_change_to_its_end():
    rows = [{"step": 0, "time": 100.0}, {"step": 40, "time": 160.0}, {"step": 66, "time": 220.0}]
    windows = [_w(100, 0.7, 0.0, 1), _w(105, 0.66, 0.0, 1, decided=3),  # grows at 110
               _w(110, 0.3, 0.1, 3), _w(115, 0.02, 0.05, 3), _w(120, 0.04, 0.03, 3), _w(125, 0.0, 0.0, 3),
               _w(130, 0.01, 0.02, 3), _w(135, 0.0, 0.04, 3), _w(140, 0.0, 0.03, 3), _w(145, 0.03, 0.01, 3),
               _w(150, 0.0, 0.02, 3), _w(155, 0.0, 0.2, 3),  # ends at 160, the slow phase's start
               _w(160, 0.0, 0.4, 3), _w(165, 0.0, 0.41, 3, decided=2),  # shrinks at 170
               _w(170, 0.0, 0.2, 2), _w(175, 0.0, 0.1, 2), _w(180, 0.1, 0.12, 2), _w(185, 0.0, 0.1, 2)]
    fast, slow = phase_figures(windows, rows, slow_at=40, interval_s=5.0)
    assert (fast["start_s"], fast["end_s"], slow["start_s"], slow["end_s"]) == (0.0, 60.0, 60.0, 120.0)
    assert fast["changes"] == [{"t_s": 10.0, "to": 3}] and fast["settled_s"] == 15.0
    assert fast["windows"] == 9 and fast["servers_settled"] == [3]  # 115 .. 155: the one just after the change is left out
    assert fast["trainer_idle"] == round((0.02 + 0.04 + 0.01 + 0.03) / 9, 3)
    assert slow["changes"] == [{"t_s": 70.0, "to": 2}] and slow["settled_s"] == 75.0
    assert slow["windows"] == 3 and slow["rollout_idle"] == round((0.1 + 0.12 + 0.1) / 3, 3)
    assert fast["needed_servers"] == 2.9 and slow["needed_servers"] == 1.8
    assert all(v["met"] for v in targets([fast, slow]).values())  # trainer idle 0.011 and 0.033, slots 0.0x and 0.107
    starved = phase_figures(windows[:-1] + [_w(185, 0.2, 0.1, 2)], rows, slow_at=40, interval_s=5.0)
    assert starved[1]["trainer_idle"] == 0.1
    t = targets(starved)
    assert not t["trainer_idle_settled"]["met"] and t["rollout_idle_settled"]["met"]
    assert not any(v["met"] for v in targets(starved[:1]).values())  # a run that never slowed down: not measured
