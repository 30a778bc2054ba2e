"""`asyncrl.hosts.check_placement`: a placement the planes cannot serve is a ConfigError naming the key;
with `may`, only one that fails wherever the roles land."""

from __future__ import annotations

import pytest

from asyncrl.config import ConfigError, load
from asyncrl.hosts import check_placement, placement_errors

CROSSING = ["queue.storage=zmq", "weights.backend=gloo"]
A, B, C = "10.0.0.1", "10.0.0.2", "10.0.0.3"


def test_shm_with_the_trainer_and_servers_on_two_hosts_names_queue_storage_and_both_hosts():
    cfg = load(None, ["queue.storage=shm"])
    with pytest.raises(ConfigError) as e:
        check_placement(cfg, trainer={A}, servers={B}, controller=A)
    msg = str(e.value)
    assert "queue.storage=shm" in msg and A in msg and B in msg


def test_planes_that_cross_hosts_with_auto_listeners_serve_three_hosts():
    cfg = load(None, [*CROSSING, "weights.host=auto", "queue.bind_host=auto"])
    assert placement_errors(cfg, {A}, {B}, C) == []
    check_placement(cfg, trainer={A}, servers={B}, controller=C)


def test_a_loopback_weights_host_across_hosts_names_weights_host():
    cfg = load(None, [*CROSSING, "queue.bind_host=auto"])
    with pytest.raises(ConfigError, match=r"^weights\.host=127\.0\.0\.1"):
        check_placement(cfg, trainer={A}, servers={B}, controller=A)


def test_a_loopback_queue_listener_with_the_controller_elsewhere_names_queue_bind_host():
    cfg = load(None, [*CROSSING, "weights.host=auto"])
    errors = placement_errors(cfg, {A}, {A}, B)
    assert len(errors) == 1 and errors[0].startswith("queue.bind_host=127.0.0.1") and B in errors[0]
    with pytest.raises(ConfigError, match=r"^queue\.bind_host"):
        check_placement(cfg, trainer={A}, servers={A}, controller=B)


def test_may_with_a_host_both_roles_may_land_on_is_no_error():
    cfg = load(None, ["queue.storage=shm"])
    check_placement(cfg, trainer={A, B}, servers={B, C}, controller=B, may=True)


def test_may_with_no_host_both_roles_may_land_on_says_where_they_can_only_run():
    cfg = load(None, ["queue.storage=shm"])
    with pytest.raises(ConfigError) as e:
        check_placement(cfg, trainer={A}, servers={B}, controller=A, may=True)
    assert "can only run" in str(e.value) and "queue.storage=shm" in str(e.value)


def test_one_host_serves_shm_planes_and_loopback_listeners():
    cfg = load(None, [])
    assert (cfg.queue.crosses_hosts, cfg.weights.host, cfg.queue.bind_host) == (False, "127.0.0.1", "127.0.0.1")
    assert placement_errors(cfg, {A}, {A}, A) == []
    check_placement(cfg, trainer={A}, servers={A}, controller=A)


def test_a_loopback_cidr_weights_host_across_hosts_names_weights_host():
    cfg = load(None, [*CROSSING, "queue.bind_host=auto", "weights.host=127.0.0.0/8"])
    with pytest.raises(ConfigError, match=r"^weights\.host"):
        check_placement(cfg, trainer={A}, servers={B}, controller=A)
