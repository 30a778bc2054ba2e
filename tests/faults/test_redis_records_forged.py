"""Redis records are authenticated (issue 44, item 5): a client that knows Redis but not the run's secret
cannot make the trainer consume a record the run did not write.

A real redis-server (the fixture of tests/integration/transfer_queue); a real producer and consumer
(`RedisController`s holding the secret); the attacker is a plain redis-py client that rewrites a reward
(and a handle), writes groups and stream entries of its own, and copies valid blobs with their tags to
other uids and runs. The consumer's `get` returns none of them, `stats()` counts them, and every
untouched group is delivered. Without a secret the queue still works (and is not authenticated).
"""

from __future__ import annotations

import logging
import os
import threading
import uuid

import msgpack
import pytest
import redis

from asyncrl.bench.redis_tools import RoundTrips
from tests.integration.transfer_queue._redis import RedisServer
from transfer_queue import TransferQueueConfig
from transfer_queue.metadata.base import GetRequest
from transfer_queue.metadata.redis import ForgedRecord, RedisController
from transfer_queue.records import SampleMeta

SECRET = "run-secret-4b1d"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = RedisServer(str(tmp_path_factory.mktemp("redis")), appendonly=False)
    yield s
    s.stop()


class Run:
    """One run's producer, consumer and (its secret unknown) attacker on the same Redis."""

    def __init__(self, server: RedisServer, secret: str = SECRET, run_id: str = "") -> None:
        self.run_id = run_id or uuid.uuid4().hex
        cfg = TransferQueueConfig(metadata="redis", redis_url=server.url, run_id=self.run_id, secret=secret,
                                  capacity=64, lease_timeout_s=5.0)
        self.freed: list[str] = []
        self.producer = RedisController(cfg, on_free=self._free)
        self.consumer = RedisController(cfg, on_free=self._free)
        self.evil = redis.Redis.from_url(server.url)
        self.p = f"tq:{self.run_id}:"

    def _free(self, handles) -> None:
        self.freed += [h.key for h in handles]

    def put(self, gid: str, size: int = 2, sealed: bool = True) -> list[str]:
        uids = [f"{gid}-{i}" for i in range(size)]
        self.producer.put([SampleMeta(u, gid, size, 0, {"reward": 0.5}, {"x": _h(f"k-{u}")}, sealed) for u in uids],
                          client_id="producer")
        return uids

    def get(self, n: int = 16):
        return self.consumer.get(GetRequest("trainer", "consumer", num_groups=n, timeout=0.3, allow_partial=True))

    def rewrite(self, gid: str, uid: str, change) -> None:
        """What a client without the secret can do: decode the record, change it, encode it, HSET it."""
        rec = msgpack.unpackb(self.evil.hget(self.p + f"grp:{gid}", f"r:{uid}"))
        change(rec)
        self.evil.hset(self.p + f"grp:{gid}", f"r:{uid}", msgpack.packb(rec))

    def copy(self, src: tuple[str, str], dst: tuple[str, str], run: "Run | None" = None) -> None:
        """Copy a valid record's blob and tag to another (group, uid), of this run or of `run`."""
        blob, tag = self.evil.hmget(self.p + f"grp:{src[0]}", f"r:{src[1]}", f"t:{src[1]}")
        assert tag and len(tag) == 32
        self.evil.hset((run or self).p + f"grp:{dst[0]}", mapping={f"r:{dst[1]}": blob, f"t:{dst[1]}": tag})

    def close(self) -> None:
        self.producer.close(), self.consumer.close(), self.evil.close()


def _h(key: str) -> dict:
    return {"plane": "local", "dtype": "int64", "shape": [1], "nbytes": 8, "key": key}


def _accounts(s, cg: str = "trainer") -> bool:
    return s.put == s.acked[cg] + sum(s.dropped[cg].values()) + s.in_flight(cg)


@pytest.mark.timeout(30)
def test_a_rewritten_reward_or_handle_is_refused_its_group_dropped_and_counted(server, caplog):
    run = Run(server)
    for g in ("g0", "g1", "g2", "g3", "g4"):
        run.put(g)

    def reward(rec):
        rec["meta"]["reward"] = 1e9

    def handle(rec):
        rec["handles"]["x"]["key"] = "k-g0-0"  # point it at another record's memory

    run.rewrite("g1", "g1-0", reward)
    run.rewrite("g2", "g2-1", handle)
    with caplog.at_level(logging.WARNING, logger="transfer_queue.metadata.record_auth"):
        first = run.get(n=2)  # g0 g1 g2 read: two groups dropped on the way
        run.rewrite("g4", "g4-0", reward)  # another one later: counted, not logged again
        rest = run.get()
    got = first.samples + rest.samples
    assert sorted(s.group_id for s in got) == ["g0", "g0", "g3", "g3"]  # every untouched group, nothing forged
    assert all(s.meta["reward"] == 0.5 and s.handles["x"].key == f"k-{s.uid}" for s in got)
    s = run.consumer.stats()
    assert s.forged == 3 and s.dropped["trainer"]["forged"] == 6 and s.depth["trainer"]["leased"] == 4
    assert _accounts(s)
    assert len([r for r in caplog.records if "bad tag" in r.getMessage()]) == 1
    assert run.consumer.ack("trainer", [x.uid for x in got], client_id="consumer") == 4
    s = run.consumer.stats()
    assert s.resident == 0 and s.acked["trainer"] == 4 and _accounts(s) and s.forged == 3
    # memory is freed by the handles of authentic records only: the forged handle frees nothing
    assert sorted(run.freed) == sorted(f"k-{u}" for u in ["g0-0", "g0-1", "g1-1", "g2-0", "g3-0", "g3-1", "g4-1"])
    run.close()


@pytest.mark.timeout(30)
def test_groups_and_stream_entries_of_another_client_are_refused(server):
    run = Run(server)
    run.put("a")
    fake = msgpack.packb({"uid": "evil-0", "group_id": "evil", "group_size": 1, "version": 0, "meta": {"reward": 1e9},
                          "handles": {}, "sealed": True})
    # a naive one: a record and a stream entry; a thorough one: the whole layout, with a tag of its own
    run.evil.hset(run.p + "grp:evil", "r:evil-0", fake)
    run.evil.xadd(run.p + "stream", {"gid": "evil"})
    eid = run.evil.xadd(run.p + "stream", {"gid": "evil2"})
    run.evil.hset(run.p + "grp:evil2", mapping={"r:evil2-0": fake.replace(b"evil", b"evi2"), "t:evil2-0": os.urandom(32),
                                                 "s:evil2-0": 1, "v:evil2-0": 0, "size": 1, "sealed": 1, "eid": eid})
    run.evil.hset(run.p + "idx", "evil2-0", "evil2")
    # a replay: a second stream entry for the authentic group `a`
    run.evil.xadd(run.p + "stream", {"gid": "a"})
    run.put("b")
    got = run.get()
    assert sorted(s.uid for s in got.samples) == ["a-0", "a-1", "b-0", "b-1"]  # each legitimate group once
    assert len(run.get().samples) == 0  # the refused entries are finished, not offered again
    s = run.consumer.stats()
    assert s.forged == 1 + 1 + 2 and s.dropped["trainer"]["forged"] == 0  # no group that was put was dropped
    # while a get waits (a blocking read): an entry without a group id, then an authentic group
    threading.Timer(0.2, lambda: (run.evil.xadd(run.p + "stream", {"junk": "1"}), run.put("c"))).start()
    late = run.consumer.get(GetRequest("trainer", "consumer", num_groups=1, timeout=5))
    assert sorted(late.uids) == ["c-0", "c-1"]
    assert run.consumer.ack("trainer", got.uids + late.uids, client_id="consumer") == 6
    s = run.consumer.stats()
    assert s.resident == 0 and _accounts(s)
    run.close()


@pytest.mark.timeout(30)
def test_a_valid_record_copied_to_another_uid_group_or_run_is_refused(server):
    run, other = Run(server), Run(server)  # two runs, one secret: the run id is bound too
    for g in ("c0", "c1", "c2", "c3"):
        run.put(g)
    other.put("c0")
    run.copy(("c0", "c0-0"), ("c1", "c1-1"))  # to another group's uid
    run.copy(("c2", "c2-0"), ("c2", "c2-1"))  # to another uid of its own group
    run.copy(("c0", "c0-1"), ("c0", "c0-1"), run=other)  # to the same uid and group of another run
    got = run.get()
    assert sorted(s.uid for s in got.samples) == ["c0-0", "c0-1", "c3-0", "c3-1"]
    s = run.consumer.stats()
    assert s.forged == 2 and s.dropped["trainer"]["forged"] == 4 and _accounts(s)
    assert other.get().samples == [] and other.consumer.stats().forged == 1
    run.close(), other.close()


@pytest.mark.timeout(30)
def test_an_update_of_a_forged_record_is_refused_and_counted(server):
    run = Run(server)
    run.put("u", size=1, sealed=False)
    run.rewrite("u", "u-0", lambda rec: rec["meta"].update(reward=1e9))
    with pytest.raises(ForgedRecord):
        run.producer.update("u-0", {}, {"done": True}, client_id="producer")  # never signs what it did not write
    assert run.consumer.stats().forged == 1 and run.get().samples == []
    run.put("v", size=1, sealed=False)  # an authentic record updates as before
    run.producer.update("v-0", {"y": _h("k-v-0-y")}, {"reward": 1.0}, client_id="producer")
    got = run.get()
    assert got.uids == ["v-0"] and got.samples[0].meta["reward"] == 1.0 and set(got.samples[0].handles) == {"x", "y"}
    run.close()


@pytest.mark.timeout(30)
def test_put_get_ack_with_a_secret_stay_one_round_trip_each(server):
    run = Run(server)
    run.put("w")
    run.consumer.ack("trainer", run.get(n=1).uids, client_id="consumer")  # redis-py loads the scripts once
    rt, rc = RoundTrips(run.producer), RoundTrips(run.consumer)
    run.put("x")
    b = run.get(n=1)  # ready at once: one READ
    assert sorted(b.uids) == ["x-0", "x-1"] and run.consumer.ack("trainer", b.uids, client_id="consumer") == 2
    assert rt.counts == {"put": 1} and rc.counts == {"get": 1, "ack": 1}, (rt.counts, rc.counts)
    run.close()


@pytest.mark.timeout(30)
def test_without_a_secret_the_queue_works_and_is_not_authenticated(server):
    run = Run(server, secret="")
    run.put("n0")
    run.put("n1")
    assert not [k for k in run.evil.hkeys(run.p + "grp:n0") if k.startswith(b"t:")]  # no tags written
    run.rewrite("n1", "n1-0", lambda rec: rec["meta"].update(reward=2.0))  # not detected: documented
    got = run.get()
    assert sorted(s.uid for s in got.samples) == ["n0-0", "n0-1", "n1-0", "n1-1"]
    assert {s.uid: s.meta["reward"] for s in got.samples}["n1-0"] == 2.0 and run.consumer.stats().forged == 0
    assert run.consumer.ack("trainer", got.uids, client_id="consumer") == 4 and run.consumer.stats().resident == 0
    run.close()


@pytest.mark.timeout(30)
def test_a_forged_group_frees_its_admission_slot_and_a_strangers_group_frees_none(server):
    """asyncrl's side: the groups a `get` dropped as forged come back in `Batch.forged_groups`; the
    `TrajectoryQueue` gives back the admission slots of those it put itself (else each would hold a slot
    for good: a resumed run with such a group waited for ever), and none for a group a stranger made up."""
    import asyncio

    from asyncrl.staleness import StalenessManager
    from asyncrl.trajectory_queue import TrajectoryQueue, trajectory_sample
    from asyncrl.types import Trajectory

    def traj(uid: str, version: int) -> Trajectory:
        return Trajectory(uid=uid, group_id=uid, index_in_group=0, group_size=1, prompt_ids=[1, 2], response_ids=[3, 4],
                          behavior_logprobs=[-0.5, -0.5], loss_mask=[1, 1], token_versions=[version] * 2,
                          min_version=version, max_version=version, reward=1.0, reward_info={})

    async def main() -> None:
        run_id = uuid.uuid4().hex
        mgr = StalenessManager(batch_groups=1, eta=4)
        q = TrajectoryQueue(TransferQueueConfig(metadata="redis", redis_url=server.url, run_id=run_id, storage="local",
                                                capacity=16, secret=SECRET, lease_timeout_s=5.0), mgr)
        evil, p = redis.Redis.from_url(server.url), f"tq:{run_id}:"
        try:
            for uid in ("a", "b"):
                v = await mgr.acquire()
                await q.put([trajectory_sample(q.storage, traj(uid, v))])
                await mgr.finish(accepted=True, version=v)
            rec = msgpack.unpackb(evil.hget(p + "grp:a", "r:a"))
            rec["meta"]["reward"] = 1e9
            evil.hset(p + "grp:a", "r:a", msgpack.packb(rec))  # one of ours, changed
            fake = msgpack.packb({"uid": "z", "group_id": "z", "group_size": 1, "version": 0, "meta": {}, "handles": {},
                                  "sealed": True})
            evil.hset(p + "grp:z", mapping={"r:z": fake, "t:z": os.urandom(32), "s:z": 1, "v:z": 0, "size": 1,
                                            "sealed": 1, "n": 1})
            evil.hset(p + "grp:z", "eid", evil.xadd(p + "stream", {"gid": "z"}))  # a stranger's, never admitted
            evil.hset(p + "idx", "z", "z")
            assert mgr.accepted == 2
            batch, groups = await q.get(1, 1, step=0, poll_s=0.2)
            assert [g[0].uid for g in groups] == ["b"] and "a" in batch.forged_groups
            assert mgr.dropped["forged"] == 1 and mgr.accepted == 1  # a's slot back; z's never taken
            await q.trained(batch)
        finally:
            evil.close()
            await q.close()

    asyncio.run(main())


def test_the_record_key_is_the_runs_own_file(tmp_path):
    """`RUN_DIR/queue_record_key`: drawn once (0600) and read back by a resume; a link, another user's file or
    one others may read is a one-line error naming `queue.record_key`."""
    from asyncrl.config import Config, ConfigError
    from asyncrl.run_dir import RECORD_KEY_FILE, assign_record_key

    def cfg(**queue):
        c = Config()
        c.queue.metadata = "redis"
        for k, v in queue.items():
            setattr(c.queue, k, v)
        return c

    first = cfg()
    assign_record_key(first, tmp_path)
    path = tmp_path / RECORD_KEY_FILE
    assert len(first.queue.record_key) == 64 and path.stat().st_mode & 0o777 == 0o600
    again = cfg()
    assign_record_key(again, tmp_path)
    assert again.queue.record_key == first.queue.record_key  # a resume: the records stay readable
    memory = Config()
    assign_record_key(memory, tmp_path / "none")
    assert memory.queue.record_key == ""  # an in-process queue needs none
    path.chmod(0o644)
    with pytest.raises(ConfigError, match="queue.record_key: .*mode 644"):
        assign_record_key(cfg(), tmp_path)
    path.chmod(0o600)
    os.chown(path, 54321, 54321)
    with pytest.raises(ConfigError, match="owner uid 54321"):
        assign_record_key(cfg(), tmp_path)
    path.unlink()
    victim = tmp_path / "victim"
    victim.write_text("x" * 64)
    victim.chmod(0o600)
    path.symlink_to(victim)  # planted: the key would be read from (or written to) elsewhere
    with pytest.raises(ConfigError, match="queue.record_key: .*cannot be read"):
        assign_record_key(cfg(), tmp_path)
