"""Semantics of the in-memory controller, through the client with the `local` plane."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from transfer_queue import Record, TransferQueueConfig, connect


def _q(**kw):
    return connect(TransferQueueConfig(storage="local", **kw))


def _group(gid: str, n: int, version: int = 0, **kw) -> list[Record]:
    return [Record(f"{gid}-{i}", gid, group_size=n, version=version, meta={"i": i},
                   tensors={"x": np.full(400, i, dtype=np.int32)}, **kw) for i in range(n)]


@pytest.mark.timeout(10)
def test_groups_are_delivered_whole_and_only_when_complete():
    q = _q(capacity=16)
    q.put(_group("a", 4)[:3])
    assert len(q.get("trainer", num_groups=1, timeout=0.05)) == 0
    q.put(_group("a", 4)[3:])
    b = q.get("trainer", num_groups=1, timeout=1)
    assert sorted(b.uids) == [f"a-{i}" for i in range(4)]
    assert [t["x"][0].item() for t in q.fetch(b)] == [s.meta["i"] for s in b.samples]
    assert q.ack(b) == 4
    assert q.stats().resident == 0


@pytest.mark.timeout(10)
def test_num_samples_takes_whole_groups_and_group_size_filters():
    q = _q(capacity=32)
    for g in "abc":
        q.put(_group(g, 2))
    q.put(_group("d", 3))
    b = q.get("trainer", num_samples=3, group_size=2, timeout=1)
    assert len(b) == 4 and len(b.group_ids) == 2
    b3 = q.get("trainer", num_groups=5, group_size=3, timeout=0.05, allow_partial=True)
    assert b3.group_ids == ["d"]


@pytest.mark.timeout(10)
def test_field_by_field_records_wait_for_the_fields_asked():
    q = _q(capacity=8)
    q.put([Record("u", "g", tensors={"prompt": np.arange(300)}, sealed=False)])
    assert len(q.get("trainer", timeout=0.05)) == 0  # not sealed
    assert len(q.get("trainer", fields=["prompt", "response"], timeout=0.05)) == 0
    q.update("u", tensors={"response": np.arange(500)}, seal=False)
    b = q.get("trainer", fields=["prompt", "response"], timeout=1)
    assert b.uids == ["u"]
    q.nack(b)
    q.update("u", tensors={"reward": np.ones(1)}, meta={"reward": 1.0})
    b = q.get("trainer", timeout=1)
    assert b.samples[0].meta["reward"] == 1.0 and set(q.fetch(b)[0]) == {"prompt", "response", "reward"}


@pytest.mark.timeout(10)
def test_every_consumer_group_sees_every_record_and_memory_is_freed_after_all_acked():
    q = _q(capacity=8, consumer_groups=["trainer", "eval"])
    q.put(_group("g", 2))
    bt = q.get("trainer", timeout=1)
    be = q.get("eval", timeout=1)
    assert sorted(bt.uids) == sorted(be.uids) == ["g-0", "g-1"]
    q.ack(bt)
    assert q.storage.nbytes == 2 * 1600 and q.stats().resident == 2
    q.ack(be)
    assert q.storage.nbytes == 0 and q.stats().resident == 0


@pytest.mark.timeout(10)
def test_acked_records_are_never_delivered_again_and_ack_is_idempotent():
    q = _q(capacity=8, lease_timeout_s=0.1)
    q.put(_group("g", 2))
    b = q.get("trainer", timeout=1)
    assert q.ack(b) == 2 and q.ack(b) == 0
    time.sleep(0.2)
    assert len(q.get("trainer", timeout=0.2)) == 0
    assert q.stats().redelivered["trainer"] == 0


@pytest.mark.timeout(10)
def test_nack_and_expired_lease_redeliver():
    q = _q(capacity=8, lease_timeout_s=0.3)
    q.put(_group("g", 2))
    b = q.get("trainer", timeout=1)
    assert len(q.get("trainer", timeout=0.05)) == 0  # leased
    q.nack(b)
    b2 = q.get("trainer", timeout=1)
    assert sorted(b2.uids) == sorted(b.uids)
    t0 = time.monotonic()
    b3 = q.get("trainer", timeout=2)  # nobody acks b2: its lease expires
    assert sorted(b3.uids) == sorted(b.uids) and time.monotonic() - t0 >= 0.25
    assert q.stats().redelivered["trainer"] == 2
    q.ack(b2)  # a late ack from the first holder still counts, once
    assert q.ack(b3) == 0 and q.stats().acked["trainer"] == 2


@pytest.mark.timeout(10)
def test_renew_keeps_a_lease():
    q = _q(capacity=8, lease_timeout_s=1.0)
    q.put(_group("g", 1))
    b = q.get("trainer", timeout=1)
    for _ in range(4):  # 1.2 s in all: longer than the lease, which each renew extends
        time.sleep(0.3)
        assert q.renew(b)
    assert len(q.get("trainer", timeout=0.05)) == 0


@pytest.mark.timeout(10)
def test_groups_are_taken_oldest_version_first_then_in_arrival_order():
    q = _q(capacity=32)
    q.put(_group("young", 2, version=5))
    q.put(_group("old-a", 2, version=3))  # finished after "young" (a long sample), older policy
    q.put(_group("old-b", 2, version=3))
    assert q.get("trainer", num_groups=1, timeout=1).group_ids == ["old-a"]
    assert q.get("trainer", num_groups=2, max_staleness=4, current_version=7, timeout=1).group_ids == ["old-b", "young"]


@pytest.mark.timeout(10)
def test_stale_groups_are_dropped_and_counted():
    q = _q(capacity=16)
    q.put(_group("old", 2, version=1))
    q.put(_group("new", 2, version=5))
    b = q.get("trainer", num_groups=2, max_staleness=2, current_version=6, timeout=0.1, allow_partial=True)
    assert b.group_ids == ["new"]
    s = q.stats()
    assert s.dropped["trainer"]["stale"] == 2 and s.resident == 2 and s.staleness["trainer"] == {1: 2}
    q.drop(b, "failed")
    assert q.stats().dropped["trainer"]["failed"] == 2 and q.stats().resident == 0


@pytest.mark.timeout(10)
def test_blocked_producer_resumes_when_space_frees():
    q = _q(capacity=4)
    q.put(_group("a", 4))
    done = threading.Event()

    def produce():
        q.put(_group("b", 2))
        done.set()

    t = threading.Thread(target=produce)
    t.start()
    assert not done.wait(0.3)  # full: the producer waits, nothing is dropped
    with pytest.raises(TimeoutError):
        q.put(_group("c", 1), timeout=0.05)
    q.ack(q.get("trainer", timeout=1))
    assert done.wait(2)
    t.join()
    s = q.stats()
    assert s.put == 6 and s.resident == 2 and sum(s.dropped["trainer"].values()) == 0
    with pytest.raises(ValueError, match="capacity"):
        q.put(_group("huge", 5))


@pytest.mark.timeout(10)
def test_bad_puts_are_refused():
    q = _q(capacity=8)
    q.put(_group("g", 2)[:1])
    with pytest.raises(ValueError, match="already"):
        q.put(_group("g", 2)[:1])
    with pytest.raises(ValueError, match="group_size"):
        q.put([Record("z", "g", group_size=3)])
    with pytest.raises(ValueError, match="unknown consumer"):
        q.get("nobody")
    assert q.stats().put == 1 and q.storage.nbytes == 1600  # the refused records' tensors were freed


@pytest.mark.timeout(60)
def test_100k_records_exact_accounting():
    """put = acked + dropped (by a named rule) + in flight, with a producer and a consumer thread."""
    q = _q(capacity=2048)
    n, gsize = 100_000, 4
    version = [0]

    def produce():
        for start in range(0, n, 400):
            q.put([Record(f"u{j}", f"g{j // gsize}", group_size=gsize, version=version[0], meta={"j": j})
                   for j in range(start, start + 400)])

    t = threading.Thread(target=produce)
    t.start()
    got = batches = 0
    while t.is_alive():
        b = q.get("trainer", num_groups=64, max_staleness=3, current_version=version[0] + 2, timeout=0.2,
                  allow_partial=True)
        got, batches = got + len(b), batches + 1
        if batches % 10 == 0:
            q.drop(b, "filtered")
        else:
            q.ack(b)
        version[0] += batches % 7 == 0
    t.join()
    leased = q.get("trainer", num_groups=8, timeout=1)  # left leased: in flight
    s = q.stats()
    assert s.depth["trainer"]["leased"] == len(leased) > 0
    dropped = sum(s.dropped["trainer"].values())
    assert s.put == n
    assert s.put == s.acked["trainer"] + dropped + s.in_flight("trainer")
    assert s.in_flight("trainer") == s.resident > 0
    assert s.acked["trainer"] > n * 0.5


def test_max_version_leaves_newer_groups_ready():
    q = connect(TransferQueueConfig(storage="local", capacity=8))
    for gid, v in (("young", 3), ("old", 2)):
        q.put([Record(f"{gid}-0", gid, 1, v, {}, {"x": np.zeros(1, np.int32)})])
    assert q.get("trainer", num_groups=2, max_version=2, timeout=0.05).samples == []  # only one group is old enough
    b = q.get("trainer", num_groups=1, max_version=2, timeout=0.05)
    assert b.group_ids == ["old"]
    assert q.get("trainer", num_groups=1, max_version=3, timeout=0.05).group_ids == ["young"]
    q.close()
