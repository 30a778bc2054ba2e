"""The `rollout.autoscale` rule on hand-made windows (`asyncrl/rollout/autoscale.py`)."""

from __future__ import annotations

import pytest

from asyncrl.config import ConfigError, load
from asyncrl.config.rollout import AutoscaleConfig
from asyncrl.rollout.autoscale import Autoscaler, Window


def window(servers: int, trainer_idle: float, slot_use: float) -> Window:
    return Window(seconds=10.0, trainer_wait_s=10.0 * trainer_idle, slot_use=slot_use, servers=servers)


def test_a_starved_trainer_with_busy_servers_grows_the_fleet_after_patience_windows():
    a = Autoscaler(AutoscaleConfig(enabled=True, patience=2, cooldown_s=30), configured_servers=4)
    assert a.decide(window(4, 0.4, 0.95), now=10) is None  # one window is not a trend
    assert a.last["bottleneck"] == "rollout"
    assert a.decide(window(4, 0.4, 0.95), now=20) == 7  # supply 0.6 of demand: 4 / 0.6 -> 7
    assert a.decide(window(7, 0.4, 0.95), now=30) is None and a.decide(window(7, 0.4, 0.95), now=40) is None  # cooldown
    assert a.decide(window(7, 0.3, 0.95), now=55) == 10


def test_idle_servers_beside_a_fed_trainer_shrink_to_what_the_running_requests_need():
    a = Autoscaler(AutoscaleConfig(enabled=True, patience=2, cooldown_s=0), configured_servers=8)
    assert a.decide(window(8, 0.0, 0.3), now=10) is None
    assert a.decide(window(8, 0.0, 0.3), now=20) == 3  # 2.4 servers' worth of requests at 0.9 use -> 3
    assert a.last["bottleneck"] == "trainer"


def test_balanced_held_by_admission_and_bounds():
    a = Autoscaler(AutoscaleConfig(enabled=True, patience=1, cooldown_s=0, min_servers=2, max_servers=5), configured_servers=4)
    assert a.decide(window(4, 0.02, 0.9), now=1) is None and a.last["bottleneck"] == "balanced"
    assert a.decide(window(4, 0.5, 0.3), now=2) is None  # the trainer waits but the servers idle: admission holds it, not capacity
    assert a.decide(window(4, 0.9, 0.99), now=3) == 5  # capped at max_servers
    assert a.decide(window(3, 0.0, 0.05), now=4) == 2  # floored at min_servers
    assert a.decide(window(2, 0.0, 0.05), now=5) is None  # already at the floor


def test_autoscale_keys_are_checked_by_name():
    with pytest.raises(ConfigError, match="rollout.autoscale.max_servers"):
        load(None, ["rollout.autoscale.min_servers=4", "rollout.autoscale.max_servers=2"])
    with pytest.raises(ConfigError, match="trainer.cost_model_schedule"):
        load(None, ["trainer.cost_model_schedule=[[1]]"])
    cfg = load(None, ["rollout.autoscale.enabled=true", "trainer.cost_model_schedule=[[10,0.002]]"])
    assert cfg.rollout.autoscale.enabled and cfg.trainer.cost_model_schedule == [[10, 0.002]]


def test_the_split_from_the_runs_own_rates():
    from asyncrl.rollout.autoscale import split_from_rates

    w = window(4, 0.5, 0.5)  # the trainer worked 5 of 10 s; 4 servers at half their slots
    got = split_from_rates(w, generated=4000, trained=5000)
    # trainer 1000 tok/s; a server 100 tok/s at half its slots, 200 at full: 5 servers keep the trainer fed
    assert got == {"trainer_tokens_per_s": 1000.0, "server_tokens_per_s_full": 200.0, "servers_for_trainer": 5}
    assert split_from_rates(w, generated=0, trained=5000) == {}
