"""The redis metadata backend trusts no stranger either: ownership and replayed handles, as in memory.

A real redis-server on 127.0.0.1 (the fixture of tests/integration/transfer_queue). The same
scenario runs against `MemoryController` (the reference) and `RedisController` and must give
the same answers, refusal for refusal; a client-level test runs it through `connect` with real
shm arena handles.
"""

from __future__ import annotations

import itertools
import time
import uuid

import numpy as np
import pytest
import redis

from tests.integration.transfer_queue._redis import RedisServer
from transfer_queue import Record, TransferQueueConfig, connect
from transfer_queue.metadata.base import GetRequest, MetadataStore
from transfer_queue.metadata.memory import MemoryController
from transfer_queue.metadata.redis import RedisController
from transfer_queue.records import SampleMeta
from transfer_queue.rules import MAY_ACT_LUA, may_act

LEASE_S = 0.3


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = RedisServer(str(tmp_path_factory.mktemp("redis")), appendonly=False)
    yield s
    s.stop()


def _store(backend: str, server: RedisServer) -> MetadataStore:
    if backend == "memory":
        return MemoryController(capacity=16, consumer_groups=["trainer"], lease_timeout_s=LEASE_S)
    return RedisController(TransferQueueConfig(metadata="redis", redis_url=server.url, run_id=uuid.uuid4().hex,
                                               capacity=16, consumer_groups=["trainer"], lease_timeout_s=LEASE_S))


def _h(key: str) -> dict:
    return {"plane": "local", "dtype": "int64", "shape": [1], "nbytes": 8, "key": key}


def _rec(uid: str, key: str | None = None, sealed: bool = True) -> SampleMeta:
    return SampleMeta(uid, f"g-{uid}", 1, 0, {}, {"x": _h(key or f"k-{uid}")}, sealed)


def _try(f, *a, **kw) -> str:
    try:
        return f"ok:{f(*a, **kw)}"
    except PermissionError:
        return "refused"
    except ValueError:
        return "invalid"


@pytest.mark.timeout(30)
def test_lua_rule_is_the_python_rule(server):
    """`rules.MAY_ACT_LUA` (run by redis' scripts) answers as `rules.may_act` on every case."""
    r = redis.Redis.from_url(server.url)
    script = r.register_script(MAY_ACT_LUA + """
local producer, holder = ARGV[2], ARGV[3]
if producer == '' then producer = false end  -- a missing hash field
if holder == '' then holder = nil end
return may_act(ARGV[1], producer, holder) and 1 or 0
""")
    cases = list(itertools.product(["p", "c"], ["p", "c", "x", None], ["p", "c", "x", None]))
    got = [bool(script(args=[c, p or "", h or ""])) for c, p, h in cases]
    assert got == [may_act(c, p or "", h) for c, p, h in cases]
    assert sum(got) == 2 * 4 * 4 - 2 * 3 * 3  # refused exactly when neither matches
    r.close()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("backend", ["memory", "redis"])
def test_ownership_same_answers_as_memory(backend, server):
    st = _store(backend, server)
    out: list[str] = []

    def get(who: str):
        return st.get(GetRequest("trainer", who, num_groups=1, timeout=3.0))

    st.put([_rec("a", sealed=False)], client_id="prod")
    out += [_try(st.update, "a", {}, {"r": 1}, True, client_id="evil"),     # stranger: refused
            _try(st.update, "a", {}, {"r": 1}, True, client_id="prod")]     # producer
    b = get("C")
    out += [b.uids == ["a"] and "got",
            _try(st.update, "a", {}, {"r": 2}, True, client_id="C"),        # lease holder may update
            _try(st.update, "a", {}, {"r": 3}, True, client_id="evil"),
            _try(st.ack, "trainer", b.uids, client_id="evil"),
            _try(st.drop, "trainer", b.uids, "filtered", client_id="evil"),
            _try(st.nack, "trainer", b.lease_id, b.uids, client_id="evil"),
            _try(st.renew, "trainer", b.lease_id, b.uids, client_id="evil"),
            _try(st.renew, "trainer", b.lease_id, b.uids, client_id="prod"),  # renew: the holder only
            _try(st.renew, "trainer", b.lease_id, b.uids, client_id="C"),
            _try(st.ack, "trainer", b.uids, client_id="prod"),              # the producer may finish it
            _try(st.ack, "trainer", b.uids, client_id="evil")]              # done: idempotent, nothing to refuse
    # late ack: allowed while nobody else took the expired lease ...
    st.put([_rec("e")], client_id="prod")
    be = get("C")
    time.sleep(LEASE_S + 0.2)
    out.append(_try(st.ack, "trainer", be.uids, client_id="C"))
    # ... refused once another consumer holds it
    st.put([_rec("d")], client_id="prod")
    bd = get("C")
    time.sleep(LEASE_S + 0.2)
    bd2 = get("D")
    out += [bd2.uids == ["d"] and "got",
            _try(st.ack, "trainer", bd.uids, client_id="C"),
            _try(st.renew, "trainer", bd.lease_id, bd.uids, client_id="C"),  # its lease is gone: False
            _try(st.ack, "trainer", bd2.uids, client_id="D")]
    # the producer may nack what C holds; C's ack after D took it is refused
    st.put([_rec("f")], client_id="prod")
    bf = get("C")
    out.append(_try(st.nack, "trainer", bf.lease_id, bf.uids, client_id="prod"))
    bf2 = get("D")
    out += [bf2.uids == ["f"] and "got",
            _try(st.ack, "trainer", bf.uids, client_id="C"),
            _try(st.ack, "trainer", bf2.uids, client_id="D")]
    assert out == ["refused", "ok:None", "got", "ok:None", "refused", "refused", "refused", "refused", "refused",
                   "refused", "ok:True", "ok:1", "ok:0",
                   "ok:1",
                   "got", "refused", "ok:False", "ok:1",
                   "ok:1", "got", "refused", "ok:1"], out
    s = st.stats()
    assert s.not_owner == 9 and s.acked["trainer"] == 4 and s.resident == 0 and s.put == 4, s
    st.close()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("backend", ["memory", "redis"])
def test_replayed_handles_refused_as_in_memory(backend, server):
    st = _store(backend, server)
    st.put([_rec("r1", "k1")], client_id="prod")
    out = [_try(st.put, [_rec("r2", "k1")], 0, client_id="evil"),                  # replay of a live record's memory
           _try(st.put, [_rec("r3", "k2"), _rec("r4", "k2")], 0, client_id="prod"),  # twice in one call
           _try(st.update, "r1", {"y": _h("k1")}, client_id="prod"),                # its own field's memory again
           _try(st.update, "r1", {"x": _h("k9")}, client_id="prod"),                # replaced: k1 is released
           _try(st.put, [_rec("r5", "k1")], 0, client_id="prod"),
           _try(st.put, [_rec("r6", "k9")], 0, client_id="prod")]                   # k9 is r1's now
    b = st.get(GetRequest("trainer", "C", num_groups=2, timeout=3.0))
    out.append(_try(st.ack, "trainer", b.uids, client_id="C"))
    out.append(_try(st.put, [_rec("r7", "k9")], 0, client_id="prod"))              # freed: memory reusable
    assert out == ["invalid", "invalid", "invalid", "ok:None", "ok:None", "invalid", "ok:2", "ok:None"], out
    s = st.stats()
    assert s.put == 3 and s.resident == 1 and s.not_owner == 0, s
    if backend == "redis":  # the memory index holds exactly the live record's memory
        assert st.r.hlen(st.p + "mem") == 1  # type: ignore[attr-defined]
    st.close()


@pytest.mark.timeout(30)
def test_clients_strangers_refused_and_shm_arena_replay_refused(server, tmp_path):
    cfg = TransferQueueConfig(metadata="redis", redis_url=server.url, storage="shm", shm_dir=str(tmp_path),
                              run_id=uuid.uuid4().hex, capacity=16, lease_timeout_s=30)
    prod, cons, evil = (connect(cfg, consumer_id=n) for n in ("prod", "cons", "evil"))
    try:
        prod.put([Record("a", "g", tensors={"x": np.arange(3000)}, sealed=False)])
        with pytest.raises(PermissionError):
            evil.update("a", meta={"reward": 1.0})
        prod.update("a", meta={"reward": 1.0})
        b = cons.get("trainer", timeout=5)
        h = b.samples[0].handles["x"]
        assert "offset" in h and "slot" in h  # an arena handle: identity is (free address, offset)
        with pytest.raises(ValueError, match="already holds"):  # a replayed handle, even by its producer
            prod.metadata.put([SampleMeta("f", "fg", 1, 0, {}, {"x": dict(h)}, True)], 0, "prod")
        for op in (evil.ack, evil.nack, evil.renew, lambda b: evil.drop(b, "failed")):
            with pytest.raises(PermissionError):
                op(b)
        st = cons.stats()
        assert st.not_owner == 5 and st.acked["trainer"] == 0 and st.depth["trainer"]["leased"] == 1, st
        assert cons.renew(b) and cons.fetch(b, as_torch=False)[0]["x"][-1] == 2999
        assert cons.ack(b) == 1 and evil.ack(b) == 0
        st = cons.stats()
        assert st.not_owner == 5 and st.acked["trainer"] == 1 and st.resident == 0, st
    finally:
        for c in (prod, cons, evil):
            c.close()


@pytest.mark.timeout(30)
def test_redis_group_of_two_producers_is_finished_only_by_its_holder(server):
    """Groups finish whole in redis: a producer of one record may not ack its neighbour's (memory acks per
    record, so there each producer may ack its own); the holder may."""
    st = _store("redis", server)
    st.put([SampleMeta("m0", "mg", 2, 0, {}, {"x": _h("m0")}, True)], client_id="p1")
    st.put([SampleMeta("m1", "mg", 2, 0, {}, {"x": _h("m1")}, True)], client_id="p2")
    b = st.get(GetRequest("trainer", "C", num_groups=1, timeout=3.0))
    assert sorted(b.uids) == ["m0", "m1"]
    for who in ("p1", "p2"):
        with pytest.raises(PermissionError):
            st.ack("trainer", ["m0"], client_id=who)
    assert st.update("m0", {}, {"r": 1}, client_id="p1") is None  # its own record: it may update it
    with pytest.raises(PermissionError):
        st.update("m0", {}, {"r": 1}, client_id="p2")
    assert st.ack("trainer", ["m1"], client_id="C") == 2
    s = st.stats()
    assert s.not_owner == 3 and s.resident == 0 and st.r.hlen(st.p + "mem") == 0, s  # type: ignore[attr-defined]
    st.close()
