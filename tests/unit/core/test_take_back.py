"""`launch.take_back` (`ray.detached` resume) decides from what Ray still holds of the run: the ranks and
placement groups are needed, a server is not (its fleet starts it anew), and a resume that cannot take
the actors back says why before it ends them. Ray's lookups are stood in for (no cluster here): the
real ones run in tests/integration/test_resume_reattach.py."""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")


@pytest.fixture
def world(monkeypatch):
    """What the lookups find: rank handles, the trainer's placement group, server handles and fleet placement."""
    import asyncrl.rollout.server_actor as sa
    from asyncrl.trainer.actor import TrainerGroup

    state = {"ranks": ["r0", "r1"], "placement": "pg-trainer", "answered": True, "servers": {0: "s0", 1: "s1"}, "fleet_pg": "pg-main",
             "killed": [], "removed": []}
    monkeypatch.setattr(TrainerGroup, "find", classmethod(lambda cls, names, n: (state["ranks"], state["placement"], state["answered"])))
    monkeypatch.setattr(TrainerGroup, "attach", classmethod(lambda cls, ranks, placement, t: type("G", (), {"secret": lambda self: "s3cret"})()))
    monkeypatch.setattr(sa, "find_server", lambda names, fleet, i: state["servers"].get(i))
    monkeypatch.setattr(sa, "find_placement", lambda name: state["fleet_pg"])
    monkeypatch.setattr(ray, "kill", lambda h, no_restart=True: state["killed"].append(h))
    monkeypatch.setattr(ray.util, "remove_placement_group", lambda pg: state["removed"].append(pg))
    return state


def _cfg():
    from asyncrl.config import load

    return load(None, ["ray.enabled=true", "ray.address=127.0.0.1:6379", "ray.detached=true", "resume=true", "trainer.num_ranks=2", "rollout.num_servers=2"])


def test_a_gone_server_does_not_cost_the_ranks(world, capsys):
    from asyncrl.launch import take_back

    world["servers"] = {1: "s1"}
    cfg = _cfg()
    assert take_back(cfg) is not None and cfg.weights.secret == "s3cret"
    assert "took back the run's 2 trainer ranks and 1 servers (ray.detached); 1 server gone, started anew" in capsys.readouterr().out
    assert world["killed"] == [] and world["removed"] == []


@pytest.mark.parametrize("case, why", [
    ("rank gone", "1 of 2 trainer ranks are gone"),
    ("rank silent", "a trainer rank did not answer"),
    ("fleet placement gone", "the placement group of fleet 'main' is gone"),
])
def test_a_resume_that_starts_anew_says_why(world, capsys, case, why):
    from asyncrl.launch import take_back

    if case == "rank gone":
        world["ranks"], world["answered"] = ["r0"], False
    elif case == "rank silent":
        world["answered"] = False
    else:
        world["fleet_pg"] = None
    assert take_back(_cfg()) is None
    out = capsys.readouterr().out
    assert f"the run's actors are not taken back ({why}" in out and "starting them anew" in out
    assert set(world["killed"]) == set(world["ranks"]) | {"s0", "s1"} and "pg-trainer" in world["removed"]
