"""The redis backend's round trips per verb, pinned: the queue's rate on a real Redis is bounded by them.

Counted on the client (`asyncrl.bench.redis_tools.RoundTrips`: every command, script call or pipeline the
store sends) and cross-checked on the server (`INFO commandstats`), against a real redis-server.
"""

from __future__ import annotations

import threading
import time

import pytest

from asyncrl.bench.redis_tools import RoundTrips
from tests.integration.transfer_queue._redis import RedisServer
from transfer_queue import Record, TransferQueueConfig, connect


@pytest.fixture
def server(tmp_path):
    s = RedisServer(str(tmp_path), appendonly=False)
    yield s
    s.stop()


def _records(start: int, n: int = 64, group_size: int = 4) -> list[Record]:
    """The bench's workload: groups of 4 records with ~900 bytes of meta."""
    return [Record(f"s{i}", f"g{i // group_size}", group_size=group_size, version=0,
                   meta={"reward": 1.0, "payload": "x" * 900}) for i in range(start, start + n)]


def _warm(q) -> None:
    """One uncounted cycle: redis-py loads each script on its first call (EVALSHA, SCRIPT LOAD, EVALSHA)."""
    q.put(_records(10_000))
    assert q.ack(q.get("trainer", num_groups=16, timeout=2)) == 64


def _server_calls(q) -> tuple[int, int]:
    """(script calls, all commands run, those inside scripts included) as the server counted them."""
    info = q.metadata.r.info("commandstats")
    return info["cmdstat_evalsha"]["calls"], sum(v["calls"] for k, v in info.items() if k != "cmdstat_config")


@pytest.mark.timeout(30)
def test_put_get_ack_cycle_is_one_round_trip_each(server):
    q = connect(TransferQueueConfig(metadata="redis", redis_url=server.url, capacity=1024, run_id="rt"))
    _warm(q)
    rt = RoundTrips(q.metadata)
    for cycle in range(3):
        q.put(_records(64 * cycle))
        b = q.get("trainer", num_groups=16, timeout=2, allow_partial=True)
        assert len(b) == 64 and len(b.group_ids) == 16
        assert q.ack(b) == 64
    assert rt.calls == {"put": 3, "get": 3, "ack": 3}
    assert dict(rt.counts) == {"put": 3, "get": 3, "ack": 3}, rt.counts  # one script call each, nothing else
    s = q.stats()
    assert s.put == 64 + 192 and s.acked["trainer"] == 64 + 192 and s.resident == 0
    q.metadata.r.config_resetstat()
    q.put(_records(1000))
    q.ack(q.get("trainer", num_groups=16, timeout=2))
    scripts, commands = _server_calls(q)
    # the server agrees, and the scripts work per group, not per record (the layout before: ~9 per record)
    assert scripts == 3 and commands < 4 * 64, (scripts, commands)
    q.close()


@pytest.mark.timeout(30)
def test_a_get_that_waits_costs_at_most_two_more(server):
    """An empty queue: READ finds nothing, a blocking XREADGROUP waits for the put, READ loads what it returned."""
    q = connect(TransferQueueConfig(metadata="redis", redis_url=server.url, capacity=1024, run_id="rt-wait"))
    _warm(q)
    rt = RoundTrips(q.metadata)
    late = threading.Timer(0.3, lambda: q.put(_records(0)))
    late.start()
    t0 = time.monotonic()
    b = q.get("trainer", num_groups=16, timeout=5)
    late.join()
    assert len(b) == 64 and time.monotonic() - t0 < 3
    assert rt.counts["get"] == 3 and rt.counts["put"] == 1, rt.counts
    assert q.ack(b) == 64 and rt.counts["ack"] == 1
    q.close()


@pytest.mark.timeout(30)
def test_a_put_larger_than_a_script_chunk_is_one_round_trip_and_whole(server):
    """2,500 records with memory: the scripts' HMGET/HSET chunks (1,000 fields, 2,000 arguments) are crossed;
    every record, its memory id and its freeing still come out exact."""
    import numpy as np

    q = connect(TransferQueueConfig(metadata="redis", redis_url=server.url, capacity=4096, storage="local",
                                    run_id="rt-big"))
    _warm(q)
    rt = RoundTrips(q.metadata)
    n = 2500
    q.put([Record(f"b{i}", f"bg{i // 5}", group_size=5, tensors={"x": np.full(200, i)}) for i in range(n)])  # 1,600 B: not inline
    assert rt.counts["put"] == 1 and q.metadata.r.hlen(q.metadata.p + "mem") == n
    with pytest.raises(ValueError, match="already in the queue"):  # the last uid of the call, past every chunk
        q.put([Record(f"new{i}", f"ng{i}") for i in range(1500)] + [Record(f"b{n - 1}", "x")])
    b = q.get("trainer", num_groups=n // 5, timeout=5)
    assert sorted(b.uids) == sorted(f"b{i}" for i in range(n))
    assert [int(t["x"][0]) for t in q.fetch(b, as_torch=False)] == [int(u[1:]) for u in b.uids]
    assert q.ack(b) == n and rt.counts["ack"] == 1
    s = q.stats()
    assert s.resident == 0 and s.put == 64 + n and q.metadata.r.hlen(q.metadata.p + "mem") == 0
    assert q.metadata.r.hlen(q.metadata.p + "idx") == 0
    q.close()
