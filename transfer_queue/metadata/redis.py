"""The `redis` metadata backend: Redis Streams with one consumer group per queue consumer group.

All state lives in Redis under `tq:<run_id>:`, so any process (trainer, rollouter,
`asyncrl status`) on any host sees the same queue, and a process restart loses nothing:
a batch delivered to a consumer that died stays in the stream's pending entries list and
is claimed by the next `get` once idle for `lease_timeout_s` (XAUTOCLAIM), or at once by a
consumer that comes back under the same `consumer_id` (its first `get` reads its own pending
entries: a resumed run gets what it had leased before it died, before anything newer).

Layout (P = `tq:<run_id>:`):
    P grp:<gid>   hash   size, n (records put), sealed, eid (stream entry once published), done,
                         d:<cg> (finished for that consumer group, while others are not), pr (producer
                         of its first put), pm (set: records of several producers), and per record
                         r:<uid> (msgpack SampleMeta), t:<uid> (its MAC, with a secret), s:<uid> (sealed),
                         v:<uid> (updates), p:<uid> (producer, only where it is not pr), m:<uid> (memory
                         ids, where it has any)
    P idx         hash   uid -> the record's group id (uid uniqueness, update and ack by uid)
    P mem         hash   memory id (a digest of `storage.handles.identity`) -> uid of the live record
    P stream      stream one entry per complete, sealed group; consumer group per queue consumer group
    P resident    int    records held (back-pressure); P stats hash of counters; P hist:<cg> staleness

Differences from the memory backend (documented, not hidden): a group is published once
all its records are sealed, so `fields` does not make unsealed records deliverable; acks
and drops apply to whole groups. Oldest first and `max_version` apply to the entries this
client has read (the selection is `rules.select_groups`, as in memory): an entry it read but did
not deliver (newer than `max_version`, of another `group_size`, or a batch that did not fill before
its timeout) stays leased to it ("parked", counted as
leased in `stats`) and is offered first, oldest version first, at its next `get`; another
consumer gets it only once that lease expires. Scripts touch keys they compute, so a single Redis
(not Redis Cluster) is assumed. Back-pressure polls: `put` retries every few ms while full.

Ownership, as in memory (`rules.may_act`; its Lua twin `rules.MAY_ACT_LUA` runs inside the
scripts, so the check and the change are one atomic call, no extra round trip): the producer is
the `client_id` of the `put` (pr per group, p:<uid> for a record of another producer, which
also sets pm: then no producer owns the group as a whole); the lease holder is the consumer that owns the group's entry in the stream's pending
entries list (XPENDING), which stays the last holder after its lease expired until another
consumer claims it: a late ack by the previous holder passes until then, as in memory. Groups
finish whole, so an `ack`/`drop` is allowed when the client holds the group's entry or produced
all of its records; `update` when it produced the record or holds it in any consumer group;
`nack` as ack; `renew` only by the holder. Anything else raises `PermissionError`, counted in
`stats().not_owner`, and changes nothing. Two live records never point at the same memory (`P mem`,
as memory's `identity` table): a `put` or `update` whose handle names memory held is refused.

Records are authenticated (`record_auth.py`: the MAC, what it covers and what not): with `queue.secret`
set, every blob `put` or `update` writes carries a tag keyed by the secret and bound to run, group and
uid, and every reader checks it before it decodes the record. A record that fails (rewritten, written or
copied by a client without the secret) is never delivered: `get` drops its whole group for that consumer
group (groups finish whole here; its other records would be delivered as a group short of one), counting
the records that failed in `stats().forged` and the group's records under `dropped[cg]["forged"]`; an
`update` of it raises `ForgedRecord` (counted); an ack that frees it does not free memory by its handles
(counted). A stream entry that is not its group's (a replayed or never put group) is skipped in READ,
counted `forged`. Each kind is logged once per store. Without a secret nothing is authenticated:
whoever can talk to Redis can rewrite the queue.

Round trips (pinned by tests/integration/transfer_queue/test_tq_redis_round_trips.py): a `put` is one
script call, whatever its size; a `get` whose groups are ready is one (READ: own pending entries,
expired leases, new entries and their records in one atomic call); one that has to wait adds a
blocking XREADGROUP and a READ of what it returned per wait (and an XCLAIM that keeps what it holds
leased, at most every `lease_timeout_s / 4`); an `ack` or `drop` is one. redis-py loads a script on
its first call to a server (two more round trips, once).
"""

from __future__ import annotations

import hashlib
import time
from collections import Counter
from typing import Any

import msgpack
import redis

from transfer_queue.codec import pack
from transfer_queue.config import TransferQueueConfig
from transfer_queue.metadata.base import DROP_CAUSES, FreeHook, GetRequest, MetadataStore, default_consumer_id
from transfer_queue.records import Batch, QueueStats, SampleMeta
from transfer_queue.metadata.record_auth import ForgeryLog, RecordAuth, entries, freed
from transfer_queue.metadata.redis_scripts import FINISH, LOAD, NACK, PUT, READ, RENEW, UPDATE
from transfer_queue.rules import Candidate, select_groups, staleness
from transfer_queue.storage.handles import identity



def _memory_ids(handles: Any) -> list[str]:
    """Digests of the memory `handles` refer to (`storage.handles.identity`; inline handles: none)."""
    out = []
    for h in handles:
        i = identity(h)
        if i is not None:
            out.append(hashlib.blake2b(msgpack.packb(list(i)), digest_size=16).hexdigest())
    return out


class ForgedRecord(ValueError):
    """An `update` found the record in Redis not authentic (`record_auth`): it is left as it is."""


class RedisController(MetadataStore):
    """Example:
        ctl = RedisController(TransferQueueConfig(metadata="redis", redis_url=url, run_id="r1"))
        ctl.put(samples); batch = ctl.get(GetRequest("trainer", num_groups=4, timeout=5))
        ctl.ack("trainer", batch.uids)
    """

    def __init__(self, config: TransferQueueConfig, on_free: FreeHook | None = None) -> None:
        self.config = config
        self.consumer_groups = list(config.consumer_groups)
        self.on_free = on_free or (lambda handles: None)
        self.p = f"tq:{config.run_id}:"
        self.r = redis.Redis.from_url(config.redis_url)
        self.auth, self._forged = RecordAuth(config.record_key or config.secret, config.run_id), ForgeryLog()
        self._put, self._update, self._load_script, self._read, self._finish, self._nack, self._renew = (
            self.r.register_script(s) for s in (PUT, UPDATE, LOAD, READ, FINISH, NACK, RENEW))
        self._lease_ms = int(config.lease_timeout_s * 1000)
        self._claim_every = min(config.lease_timeout_s / 4, 0.5)
        self._next_claim: dict[str, float] = {}
        self._own_read: set[tuple[str, str]] = set()
        """(consumer group, consumer id) whose own pending entries this client already took back."""
        self._parked: dict[str, dict[str, list[SampleMeta]]] = {}
        """Per consumer group: entries this client read but did not deliver (newer than a
        `max_version`, or a batch that did not fill before its timeout), by stream id."""
        for cg in self.consumer_groups:
            try:
                self.r.xgroup_create(self.p + "stream", cg, id="0", mkstream=True)
            except redis.ResponseError as e:
                if "BUSYGROUP" not in str(e):
                    raise
        self.r.setnx(self.p + "t0", self._now())

    # ---- producers -------------------------------------------------------
    def put(self, samples: list[SampleMeta], timeout: float | None = None, client_id: str = "") -> None:
        if len(samples) > self.config.capacity:
            raise ValueError(f"put of {len(samples)} records exceeds queue.capacity={self.config.capacity}")
        head: list[Any] = []
        for s in samples:
            head += [s.uid, s.group_id, s.group_size, int(s.sealed), ",".join(_memory_ids(s.handles.values()))]
        blobs = [pack(s) for s in samples]
        args = [self.p, self.config.capacity, len(samples), client_id or default_consumer_id(), pack(head), *blobs,
                *(self.auth.tag(s.group_id, s.uid, b) for s, b in zip(samples, blobs))]
        deadline = None if timeout is None else time.monotonic() + timeout
        pause = 0.001
        while self._call(self._put, args) == -1:  # full: back-pressure by polling
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"queue full (capacity {self.config.capacity}) for {timeout}s")
            time.sleep(pause)
            pause = min(pause * 2, 0.02)

    def update(self, uid: str, handles: dict[str, dict[str, Any]], meta: dict[str, Any] | None = None,
               seal: bool = True, client_id: str = "") -> None:
        client_id = client_id or default_consumer_id()
        for _ in range(100):  # optimistic: retry if another writer changed the record meanwhile
            gid = self.r.hget(self.p + "idx", uid)
            blob, version, tag = (self.r.hmget(self.p + f"grp:{gid.decode()}", f"r:{uid}", f"v:{uid}", f"t:{uid}")
                                  if gid else (None, None, None))
            if blob is None:
                raise KeyError(f"update: no record {uid!r} in the queue")
            s = self.auth.open(gid, (uid.encode(), tag or b"", blob))
            if s is None:  # never rewritten (and so signed) from what another client wrote
                self.r.hincrby(self.p + "stats", "forged", 1)
                self._forged("update", 1, f"record {uid!r}")
                raise ForgedRecord(f"update of {uid!r}: the record in Redis is not this run's (written or changed by a "
                                   "client without queue.secret); it stays as it is and is dropped when read")
            old = [s.handles[k] for k in handles if k in s.handles]
            s.handles.update(handles)
            s.meta.update(meta or {})
            s.sealed = s.sealed or seal
            blob = pack(s)
            res = self._call(self._update, [
                self.p, uid, version, blob, int(seal), client_id, ",".join(_memory_ids(old)),
                ",".join(_memory_ids(handles.values())), ",".join(_memory_ids(s.handles.values())),
                self.auth.tag(gid, uid, blob), *self.consumer_groups])
            if res == -2:
                raise KeyError(f"update: no record {uid!r} in the queue")
            if res == -3:
                raise PermissionError(f"update of {uid!r}: client {client_id!r} is neither the producer nor the lease holder")
            if res == 0:
                if old:
                    self.on_free(old)
                return
        raise RuntimeError(f"update of {uid!r}: the record kept changing under 100 attempts")

    def _call(self, script: Any, args: list[Any]) -> Any:
        try:
            return script(args=args)
        except redis.ResponseError as e:  # script errors are bad requests of the caller
            raise ValueError(str(e)) from e

    # ---- consumers -------------------------------------------------------
    def get(self, req: GetRequest) -> Batch:
        if req.consumer not in self.consumer_groups:
            raise ValueError(f"unknown consumer group {req.consumer!r}; queue.consumer_groups={self.consumer_groups}")
        stream, cg, me = self.p + "stream", req.consumer, req.consumer_id
        deadline = None if req.timeout is None else time.monotonic() + req.timeout
        held: list[tuple[str, list[SampleMeta]]] = []
        parked = self._parked.setdefault(cg, {})
        given: list[Any] = []  # (stream id, group id) pairs a blocking read returned, for READ to load
        stale: list[list[SampleMeta]] = []  # groups dropped as too stale
        forged_groups: list[str] = []  # groups dropped for a record that failed its MAC
        refreshed = not parked  # what this call reads is freshly leased; what it finds parked is refreshed once
        last_refresh = time.monotonic()
        while True:
            want = (req.num_groups or req.num_samples or 1) - (len(held) if req.num_groups else sum(len(g) for _, g in held))
            own = (cg, me) not in self._own_read  # a consumer back under its old id (a resumed run) takes its leases back at once
            self._own_read.add((cg, me))
            claim = time.monotonic() >= self._next_claim.get(cg, 0.0)  # expired leases of dead consumers
            if claim:
                self._next_claim[cg] = time.monotonic() + self._claim_every
            skip = list(parked) if own else []
            _, data, replayed = self._call(self._read, [self.p, cg, me, int(own), self._lease_ms if claim else -1,
                                                        max(want, 1), want, len(skip), *skip, *given])
            self._forged("stream entry not its group's", replayed, "a replayed group, or one never put")
            given, forged = [], []
            taken = {e for e, _ in held}
            for eid, gid, raws in entries(data):
                if eid in taken:
                    continue
                samples, bad = self.auth.open_group(gid, raws)
                if bad:
                    forged.append((eid, gid, bad))
                    parked.pop(eid, None)
                else:
                    parked[eid] = samples
            if forged:
                self._drop_forged(cg, forged)
                forged_groups += [gid.decode(errors="replace") for _, gid, _ in forged]
            sel = select_groups(
                [Candidate(eid, min(s.version for s in g), len(g), g[0].group_size) for eid, g in parked.items()],
                num_groups=req.num_groups, num_samples=req.num_samples, group_size=req.group_size,
                max_staleness=req.max_staleness, current_version=req.current_version, max_version=req.max_version,
                held_groups=len(held), held_records=sum(len(g) for _, g in held), lineage=req.lineage or ())
            if sel.stale:  # one FINISH for all of them (it finishes whole groups by any of their uids)
                groups = [parked.pop(eid) for eid in sel.stale]
                self._settle(cg, [g[0].uid for g in groups], "stale", "")
                stale += groups
            held += [(eid, parked.pop(eid)) for eid in sel.take]
            if sel.enough:
                break
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                if not req.allow_partial:
                    parked.update(held)  # still leased to this consumer: offered first at its next get
                    held = []
                break
            ids = [e for e, _ in held] + list(parked)
            if ids and (not refreshed or time.monotonic() - last_refresh >= self._claim_every):
                self.r.xclaim(stream, cg, me, 0, ids, justid=True)  # keep the lease fresh while waiting
                refreshed, last_refresh = True, time.monotonic()
            wait = min(1.0 if left is None else left, self._claim_every if ids else 1.0)  # back in time to refresh
            block = max(int(wait * 1000), 1)
            want = (req.num_groups or req.num_samples or 1) - (len(held) if req.num_groups else sum(len(g) for _, g in held))
            res = self.r.xreadgroup(cg, me, {stream: ">"}, count=max(want, 1), block=block)
            for eid, fields in (res[0][1] if res else []):
                given += [eid, fields.get(b"gid", b"")] if fields else []  # no gid: not ours, READ skips it
        if parked:
            self.r.xclaim(stream, cg, me, 0, list(parked), justid=True)  # keep their lease fresh
        samples = [s for _, g in held for s in g]
        if req.current_version is not None and samples:
            pipe = self.r.pipeline(transaction=False)
            for age, n in Counter(staleness(s.version, req.current_version, req.lineage or ()) for s in samples).items():
                pipe.hincrby(self.p + f"hist:{cg}", str(age), n)
            pipe.execute()
        lease = f"{me}|{','.join(e for e, _ in held)}" if held else ""
        return Batch(cg, lease, samples, req.current_version, stale_groups=len(stale), stale=[s for g in stale for s in g],
                     forged_groups=forged_groups)

    def _drop_forged(self, cg: str, forged: list[tuple[str, bytes, int]]) -> None:
        """Finish for `cg` the groups of READ's entries that hold records that failed `record_auth`."""
        self._forged("bad tag", sum(n for _, _, n in forged), f"group {forged[0][1].decode(errors='replace')!r}")
        pairs = msgpack.packb([x for eid, gid, _ in forged for x in (eid, gid)], use_bin_type=False)
        out = self._call(self._finish, [self.p, cg, len(self.consumer_groups), "forged", "", pack([]), "0", pairs,
                                        sum(n for _, _, n in forged)])
        self._free(out[1], count=False)  # its forged records were counted just now

    def _free(self, data: bytes, count: bool = True) -> None:
        """Pass to `on_free` the handles of FINISH's freed records that verify; those that do not free nothing."""
        handles, bad = [], 0
        for gid, raw in freed(data):
            s = self.auth.open(gid, raw)
            if s is None:
                bad += 1
            else:
                handles += s.handles.values()
        if bad and count:
            self.r.hincrby(self.p + "stats", "forged", bad)
            self._forged("freed", bad, "a record changed after its delivery; its memory is not freed by its handles")
        if handles:
            self.on_free(handles)

    def _load(self, entries: list[tuple[bytes, dict]]) -> list[int]:
        if not entries:
            return []
        return self._load_script(args=[self.p, *[fields.get(b"gid", b"") for _, fields in entries]])

    def ack(self, consumer: str, uids: list[str], client_id: str = "") -> int:
        return self._settle(consumer, uids, "", client_id or default_consumer_id())

    def drop(self, consumer: str, uids: list[str], cause: str, client_id: str = "", records_only: bool = False) -> int:
        if cause not in DROP_CAUSES:
            raise ValueError(f"drop: cause {cause!r} is not one of {DROP_CAUSES}")
        return self._settle(consumer, uids, cause, client_id or default_consumer_id(), records_only)

    def _settle(self, consumer: str, uids: list[str], cause: str, client_id: str, records_only: bool = False) -> int:
        """Finish `uids` for `consumer`; `client_id` "" only for the controller's own rules (stale drops).
        Whole groups are finished; `records_only` (a drop): `uids` alone are counted under `cause`, the rest
        of their groups as acked."""
        self._check_consumer(consumer)
        if not uids:
            return 0
        out = self._call(self._finish, [self.p, consumer, len(self.consumer_groups), cause, client_id, pack(list(uids)),
                                        "1" if records_only else "0"])
        if out[0] == -1:
            what = "ack" if cause == "" else "drop"
            raise PermissionError(f"{what} of {out[1].decode()!r} for {consumer!r}: client {client_id!r} is neither "
                                  "the producer nor the lease holder")
        self._free(out[1])  # the records freed that held memory
        return int(out[0])

    def nack(self, consumer: str, lease_id: str, uids: list[str], client_id: str = "") -> int:
        self._check_consumer(consumer)
        client_id = client_id or default_consumer_id()
        _, _, ids = lease_id.partition("|")
        if not ids:
            return 0
        n = self._call(self._nack, [self.p, consumer, client_id, self._lease_ms + 1, *ids.split(",")])
        if n == -1:
            raise PermissionError(f"nack of lease {lease_id!r} for {consumer!r}: client {client_id!r} is neither "
                                  "the producer nor the lease holder")
        return int(n)

    def renew(self, consumer: str, lease_id: str, uids: list[str], client_id: str = "") -> bool:
        self._check_consumer(consumer)
        client_id = client_id or default_consumer_id()
        me, _, ids = lease_id.partition("|")
        lease = ids.split(",") if ids else []
        parked = list(self._parked.get(consumer, {}))
        if not lease and not parked:
            return False
        n = self._call(self._renew, [self.p, consumer, client_id, me, len(lease), *lease, *parked])
        if n == -1:
            raise PermissionError(f"renew of lease {lease_id!r}: client {client_id!r} is not its holder")
        return n > 0

    def _check_consumer(self, consumer: str) -> None:
        if consumer not in self.consumer_groups:
            raise ValueError(f"unknown consumer group {consumer!r}; queue.consumer_groups={self.consumer_groups}")

    # ---- observability ---------------------------------------------------
    def groups_held(self, group_ids: list[str]) -> set[str]:
        """Of `group_ids`, those with records in the queue now (put and not yet finished by every
        consumer group): one pipelined EXISTS per group. A restarted producer asks it to learn which of
        the groups it was generating reached the queue before it died."""
        pipe = self.r.pipeline(transaction=False)
        for gid in group_ids:
            pipe.exists(self.p + f"grp:{gid}")
        return {gid for gid, n in zip(group_ids, pipe.execute()) if n}

    def stats(self) -> QueueStats:
        c = {k.decode(): int(v) for k, v in self.r.hgetall(self.p + "stats").items()}
        put, resident = c.get("put", 0), int(self.r.get(self.p + "resident") or 0)
        waiting = resident - c.get("published", 0)  # records of groups not yet complete and sealed
        depth, acked, dropped, redelivered, hist = {}, {}, {}, {}, {}
        for cg in self.consumer_groups:
            acked[cg] = c.get(f"acked:{cg}", 0)
            dropped[cg] = {k: c.get(f"dropped:{cg}:{k}", 0) for k in (*DROP_CAUSES, "forged")}
            redelivered[cg] = c.get(f"redelivered:{cg}", 0)
            hist[cg] = {int(k): int(v) for k, v in self.r.hgetall(self.p + f"hist:{cg}").items()}
            pending = self.r.xpending_range(self.p + "stream", cg, "-", "+", self.config.capacity)
            pipe = self.r.pipeline(transaction=False)
            for e in pending:
                pipe.xrange(self.p + "stream", e["message_id"], e["message_id"])
            entries = [r[0] for r in pipe.execute() if r and r[0][1]]
            leased = sum(self._load(entries))
            in_flight = put - acked[cg] - sum(dropped[cg].values())
            depth[cg] = {"ready": in_flight - leased - waiting, "waiting": waiting, "leased": leased}
        now = self._now()
        up = max(now - float(self.r.get(self.p + "t0") or now), 1e-9)
        return QueueStats(
            capacity=self.config.capacity, resident=resident, put=put,
            complete_groups=int(self.r.xlen(self.p + "stream")), depth=depth, acked=acked, dropped=dropped,
            redelivered=redelivered, not_owner=c.get("not_owner", 0), forged=c.get("forged", 0), staleness=hist,
            rates={"put_per_s": put / up, "ack_per_s": sum(acked.values()) / up})

    def _now(self) -> float:
        """The Redis server's clock: the queue's clients run on hosts whose clocks need not agree."""
        sec, usec = self.r.time()
        return sec + usec / 1e6

    def close(self) -> None:
        self.r.close()
