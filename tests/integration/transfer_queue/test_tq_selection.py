"""`rules.select_groups` is what both backends decide: random traces of puts and gets run through the pure
function (a model of each backend's candidates) and through the real `memory` and `redis` backends (a real
redis-server), which must deliver and drop the same groups; and a `get`'s stale drops reach the caller in
its `Batch`, also through the memory service's wire.

The models differ only in what a `get` sees: memory offers every ready group; redis offers the entries
this client read and kept ("parked") plus the next entries of the stream, as many as the batch still needs
(its docstring: oldest first applies to what it has read)."""

from __future__ import annotations

import random

import pytest

from tests.integration.transfer_queue._redis import RedisServer
from transfer_queue import Record, TransferQueueConfig, connect
from transfer_queue.rules import Candidate, select_groups
from transfer_queue.service import ControllerService

ETA = 2


@pytest.fixture
def server(tmp_path):
    s = RedisServer(str(tmp_path), appendonly=False)
    yield s
    s.stop()


class _Model:
    """The queue as `select_groups` sees it: every ready group (memory), or redis's view (what this
    client parked, then the next `num_groups` unread entries of the stream)."""

    def __init__(self, redis: bool) -> None:
        self.redis = redis
        self.unread: list[Candidate] = []  # arrival order
        self.parked: list[Candidate] = []

    def put(self, c: Candidate) -> None:
        self.unread.append(c)

    def get(self, num_groups: int, **kw) -> tuple[list[str], int]:
        if self.redis:
            offer = self.parked + self.unread[:num_groups]
            self.unread = self.unread[num_groups:]
        else:
            offer, self.unread = self.unread, []
        sel = select_groups(offer, num_groups=num_groups, max_staleness=ETA, **kw)
        gone = set(sel.take) | set(sel.stale)
        rest = [c for c in offer if c.key not in gone]
        if self.redis:
            self.parked = rest
        else:
            self.unread = rest
        return sel.take, len(sel.stale)


def _trace(seed: int, n_ops: int = 80) -> list[tuple]:
    rng = random.Random(seed)
    ops, version, g = [], 0, 0
    for _ in range(n_ops):
        r = rng.random()
        if r < 0.5:
            ops.append(("put", f"g{g}", rng.choice((1, 2)), rng.randint(max(0, version - 4), version)))
            g += 1
        elif r < 0.65:
            version += 1
        else:
            mv = rng.choice((None, None, rng.randint(max(0, version - 3), version)))
            ops.append(("get", rng.randint(1, 3), rng.choice((None, None, 1, 2)), version, mv))
    return ops


def _run(q, model: _Model, ops: list[tuple]) -> tuple[int, int]:
    """Apply `ops` to the real queue `q` and to `model`; returns (groups delivered, groups dropped as stale)."""
    delivered = dropped = 0
    for op in ops:
        if op[0] == "put":
            _, gid, size, v = op
            q.put([Record(f"{gid}-{i}", gid, group_size=size, version=v) for i in range(size)])
            model.put(Candidate(gid, v, size, size))
            continue
        _, n, size, cur, mv = op
        b = q.get("trainer", num_groups=n, group_size=size, max_staleness=ETA, current_version=cur,
                  max_version=mv, timeout=0, allow_partial=True)
        take, stale = model.get(n, group_size=size, current_version=cur, max_version=mv)
        assert (b.group_ids, b.stale_groups) == (take, stale), op
        if b.samples:
            assert q.ack(b) == len(b)
        delivered, dropped = delivered + len(take), dropped + stale
    return delivered, dropped


def _check(q, model: _Model, seed: int) -> None:
    ops = _trace(seed)
    puts = sum(op[0] == "put" for op in ops)
    records = sum(op[2] for op in ops if op[0] == "put")
    delivered, dropped = _run(q, model, ops)
    assert dropped > 0 and delivered > 0, (seed, delivered, dropped)  # the trace exercised both
    s = q.stats()
    left = len(model.unread) + len(model.parked)
    assert delivered + dropped + left == puts
    assert s.dropped["trainer"]["stale"] + s.acked["trainer"] + s.resident == records


@pytest.mark.timeout(60)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_memory_decides_as_the_pure_rule(seed):
    q = connect(TransferQueueConfig(storage="local", capacity=1024))
    _check(q, _Model(redis=False), seed)
    q.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_redis_decides_as_the_pure_rule(server, seed):
    q = connect(TransferQueueConfig(metadata="redis", storage="local", redis_url=server.url, capacity=1024,
                                    run_id=f"sel{seed}"))
    _check(q, _Model(redis=True), seed)
    q.close()


@pytest.mark.timeout(30)
def test_stale_drops_cross_the_memory_service_wire(tmp_path):
    cfg = dict(storage="shm", shm_dir=str(tmp_path), run_id="sel-wire", capacity=64)
    svc = ControllerService(TransferQueueConfig(**cfg))
    q = connect(TransferQueueConfig(**cfg, controller_address=svc.address))
    try:
        for gid, v in (("old1", 0), ("old2", 1), ("ok", 4)):
            q.put([Record(f"{gid}-{i}", gid, group_size=2, version=v) for i in range(2)])
        b = q.get("trainer", num_groups=1, max_staleness=2, current_version=5, timeout=1)
        assert b.group_ids == ["ok"] and b.stale_groups == 2 and q.stats().dropped["trainer"]["stale"] == 4
        # the dropped records come back as metadata (their versions, for the consumer's accounting)
        assert sorted((s.group_id, s.version) for s in b.stale) == [("old1", 0), ("old1", 0), ("old2", 1), ("old2", 1)]
        # after a resume (version 6 = version 3's weights), staleness runs along the lineage: v4 is
        # 1 past v3, and v7 one step after v6: 2 apart, not 3
        for gid, v in (("branch", 4), ("fresh", 6)):
            q.put([Record(f"{gid}-{i}", gid, group_size=2, version=v) for i in range(2)])
        b = q.get("trainer", num_groups=2, max_staleness=2, current_version=7, lineage=[[6, 3]], timeout=1)
        assert b.group_ids == ["branch", "fresh"] and b.stale_groups == 0
        b = q.get("trainer", num_groups=1, max_staleness=2, current_version=7, lineage=[[6, 3]], timeout=0.2)
        assert len(b) == 0
    finally:
        q.close()
        svc.close()
