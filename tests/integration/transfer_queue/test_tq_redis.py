"""The redis backend against a real redis-server process."""

from __future__ import annotations

import multiprocessing as mp
import threading
import time

import numpy as np
import pytest

from tests.integration.transfer_queue import _procs
from tests.integration.transfer_queue._redis import RedisServer
from transfer_queue import Record, TransferQueueConfig, connect

CTX = mp.get_context("spawn")


@pytest.fixture
def server(tmp_path):
    s = RedisServer(str(tmp_path))
    yield s
    s.stop()


def _cfg(server, tmp_path, **kw) -> dict:
    return {"metadata": "redis", "redis_url": server.url, "storage": "shm", "shm_dir": str(tmp_path), "run_id": "r", **kw}


def _group(gid: str, n: int, version: int = 0, **kw) -> list[Record]:
    return [Record(f"{gid}-{i}", gid, group_size=n, version=version, meta={"i": i},
                   tensors={"x": _procs.tensor_for(f"{gid}-{i}")}, **kw) for i in range(n)]


@pytest.mark.timeout(60)
def test_redis_semantics(server, tmp_path):
    q = connect(TransferQueueConfig(**_cfg(server, tmp_path, capacity=8, consumer_groups=["trainer", "eval"],
                                           lease_timeout_s=0.5)))
    q.put(_group("a", 2)[:1])
    assert len(q.get("trainer", timeout=0.1)) == 0  # group incomplete
    q.put(_group("a", 2)[1:])
    b = q.get("trainer", timeout=2)
    assert sorted(b.uids) == ["a-0", "a-1"]
    assert all(np.array_equal(t["x"], _procs.tensor_for(s.uid)) for s, t in zip(b.samples, q.fetch(b, as_torch=False)))
    assert q.ack(b) == 2
    # field by field: delivered once sealed
    q.put([Record("f", "fg", tensors={"prompt": np.arange(1000)}, sealed=False)])
    assert len(q.get("eval", num_groups=2, timeout=0.2, allow_partial=True)) == 2  # only group a
    q.update("f", tensors={"response": np.arange(2000)}, meta={"reward": 1.0})
    bf = q.get("trainer", timeout=2)
    assert bf.uids == ["f"] and bf.samples[0].meta["reward"] == 1.0 and set(bf.samples[0].handles) == {"prompt", "response"}
    # nack and lease expiry redeliver; ack is idempotent and final
    q.nack(bf)
    assert q.get("trainer", timeout=2).uids == ["f"]
    again = q.get("trainer", timeout=3)  # nobody acked: the lease expired
    assert again.uids == ["f"] and q.stats().redelivered["trainer"] >= 2
    assert q.ack(again) == 1 and q.ack(again) == 0 and q.ack(b) == 0
    assert len(q.get("trainer", timeout=0.7)) == 0
    # every consumer group sees every record; memory freed only after all acked
    s = q.stats()
    assert s.resident == 3 and s.acked["trainer"] == 3 and s.in_flight("eval") == 3
    q.drop(q.get("eval", num_groups=2, timeout=2), "filtered")
    s = q.stats()
    assert s.resident == 0 and s.dropped["eval"]["filtered"] == 3 and s.acked["eval"] == 0
    deadline = time.monotonic() + 5
    while q.storage.arena_used() and time.monotonic() < deadline:  # frees travel back asynchronously
        time.sleep(0.01)
    assert q.storage.arena_used() == 0
    # staleness: counted drops
    q.put(_group("old", 2, version=1))
    q.put(_group("new", 2, version=5))
    b = q.get("trainer", num_groups=2, max_staleness=2, current_version=6, timeout=0.5, allow_partial=True)
    assert b.group_ids == ["new"] and q.stats().dropped["trainer"]["stale"] == 2 and q.stats().staleness["trainer"] == {1: 2}


@pytest.mark.timeout(60)
def test_redis_back_pressure_and_exact_accounting(server, tmp_path):
    q = connect(TransferQueueConfig(**_cfg(server, tmp_path, capacity=64, storage="local")))
    n = 3000

    def produce():
        for start in range(0, n, 30):
            q.put([Record(f"u{j}", f"g{j // 3}", group_size=3, version=start // 300, meta={"j": j}) for j in range(start, start + 30)])

    t = threading.Thread(target=produce)
    t.start()
    time.sleep(0.5)
    assert t.is_alive() and q.stats().resident <= 64  # the producer is blocked, nothing dropped
    batches = 0
    while t.is_alive() or q.stats().depth["trainer"]["ready"] > 0:
        b = q.get("trainer", num_groups=4, max_staleness=1, current_version=n // 300 - 2, timeout=0.3, allow_partial=True)
        batches += 1
        (q.drop(b, "failed") if batches % 5 == 0 else q.ack(b))
    t.join()
    q.put([Record(f"last{j}", f"last{j // 3}", group_size=3, version=n // 300) for j in range(6)])
    leased = q.get("trainer", num_groups=2, timeout=1)
    s = q.stats()
    dropped = sum(s.dropped["trainer"].values())
    assert s.put == n + 6 and s.dropped["trainer"]["stale"] > 0 and s.dropped["trainer"]["failed"] > 0
    assert s.put == s.acked["trainer"] + dropped + s.in_flight("trainer")
    assert s.depth["trainer"]["leased"] == len(leased) == 6 and s.resident == s.in_flight("trainer")


@pytest.mark.timeout(120)
def test_redis_consumer_killed_then_redis_killed_and_restarted_loses_nothing(server, tmp_path):
    cfg = _cfg(server, tmp_path, capacity=64, lease_timeout_s=1.0)
    q = connect(TransferQueueConfig(**cfg))
    groups = [f"g{i}" for i in range(10)]
    for g in groups:
        q.put(_group(g, 2))
    out = CTX.Queue()
    doomed = CTX.Process(target=_procs.consume_and_hang, args=(cfg, 3, out), daemon=True)
    doomed.start()
    kind, lost = out.get(timeout=60)
    assert kind == "got" and len(lost) == 6
    doomed.kill()
    doomed.join()
    first = q.get("trainer", num_groups=2, timeout=2)  # leased by us when the server dies
    q.metadata.close()  # the producer's storage (its shm arena) stays: it holds the bytes
    producer = q.storage  # kept open to the end (left to the GC, its ZeroMQ context blocks whoever collects it)
    server.kill()  # the whole metadata store dies; its append-only file survives
    server.start()
    q = connect(TransferQueueConfig(**cfg))
    seen: list[str] = []
    while len(seen) < 20:
        b = q.get("trainer", num_groups=4, timeout=5, allow_partial=True)
        assert len(b) > 0, f"records lost: have {sorted(seen)}"
        for s, t in zip(b.samples, q.fetch(b, as_torch=False)):
            assert np.array_equal(t["x"], _procs.tensor_for(s.uid))
        seen += b.uids
        q.ack(b)
    assert sorted(seen) == sorted(f"{g}-{i}" for g in groups for i in range(2))
    assert set(lost) <= set(seen) and set(first.uids) <= set(seen)
    s = q.stats()
    assert s.put == 20 and s.acked["trainer"] == 20 and s.resident == 0 and s.redelivered["trainer"] >= 10
    q.close()
    producer.close()


@pytest.mark.timeout(60)
def test_redis_max_version_and_oldest_first(server, tmp_path):
    q = connect(TransferQueueConfig(**_cfg(server, tmp_path, capacity=16)))
    q.put(_group("young", 1, version=3))
    q.put(_group("old", 1, version=2))
    assert len(q.get("trainer", num_groups=2, max_version=2, current_version=3, timeout=0.2)) == 0
    b = q.get("trainer", num_groups=1, max_version=2, current_version=3, timeout=1)
    assert b.group_ids == ["old"]  # read after the younger one, delivered first
    q.put(_group("older", 1, version=1))
    b2 = q.get("trainer", num_groups=2, current_version=3, timeout=1)
    assert b2.group_ids == ["older", "young"]
    assert q.ack(b) == 1 and q.ack(b2) == 2 and q.stats().redelivered["trainer"] == 0
    q.close()


@pytest.mark.timeout(60)
def test_redis_consumer_back_under_its_id_takes_its_leases_back_at_once(server, tmp_path):
    cfg = TransferQueueConfig(**_cfg(server, tmp_path, capacity=16, lease_timeout_s=60))
    first = connect(cfg, consumer_id="run-a")
    first.put(_group("g0", 2))
    first.put(_group("g1", 2))
    leased = first.get("trainer", num_groups=1, timeout=2)
    assert leased.group_ids == ["g0"]
    first.metadata.close()  # "dies" before acking (its storage stays: it holds the bytes)
    other = connect(cfg, consumer_id="someone-else")
    assert other.get("trainer", num_groups=1, timeout=0.5).group_ids == ["g1"]  # g0 stays leased (60 s)
    back = connect(cfg, consumer_id="run-a")  # the resumed run, same lease holder name
    again = back.get("trainer", num_groups=1, timeout=2)
    assert again.group_ids == ["g0"] and back.stats().redelivered["trainer"] == 2
    assert back.ack(again) == 2
    for c in (other, back):
        c.close()
    first.storage.close()
