"""`asyncrl status` on a host whose clock disagrees with the run's: a heartbeat is aged on the writer's
clock where the reader knows its offset (`clock_offset_s`, from the Redis key's TTL), so a live run on
another host is not judged dead."""

from __future__ import annotations

import time

import pytest

from asyncrl.observe.command import judge, read_redis
from asyncrl.observe.reporter import RedisStatus

HOUR = 3600.0


def _remote_snap(now: float, behind: float) -> dict:
    """A running run's snapshot written just now on another host whose clock is `behind` s behind this one."""
    t = now - behind
    return {"time": t, "state": "running", "interval_s": 1.0, "heartbeats": {"status": t, "trainer": t - 2.0},
            "run": {"pid": 4242, "host": "another-host.invalid"}}


def test_a_heartbeat_an_hour_behind_with_its_offset_is_alive_and_fresh():
    now = time.time()
    j = judge(dict(_remote_snap(now, HOUR), clock_offset_s=HOUR), now)
    assert j["status"] == "running" and j["alive"]
    assert j["heartbeat_age_s"] < 1.0
    assert j["component_age_s"] == {"status": 0.0, "trainer": 2.0}


def test_the_same_heartbeat_without_the_offset_is_judged_dead():
    now = time.time()
    j = judge(_remote_snap(now, HOUR), now)
    assert j["status"] == "dead" and not j["alive"] and j["heartbeat_age_s"] >= HOUR


@pytest.fixture
def redis_url(tmp_path):
    from tests.integration.transfer_queue._redis import RedisServer, redis_binary

    try:
        redis_binary()
    except RuntimeError as e:
        pytest.skip(str(e))
    server = RedisServer(str(tmp_path), appendonly=False)
    yield server.url
    server.stop()


@pytest.mark.timeout(20)
@pytest.mark.parametrize("behind", [0.0, HOUR])
def test_read_redis_measures_the_writers_clock_offset_by_the_keys_ttl(redis_url, behind):
    writer = RedisStatus(redis_url, "skew-run", ttl_s=10)
    try:
        writer.write(_remote_snap(time.time(), behind))
    finally:
        writer.close()
    snap = read_redis(redis_url, "skew-run")
    assert snap["clock_offset_s"] == pytest.approx(behind, abs=0.5)
    j = judge(snap)
    assert j["alive"] and j["heartbeat_age_s"] < 1.0
