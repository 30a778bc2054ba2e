"""`Sender`: the trainer end of the weight plane.

`publish(named_tensors, version)` packs the caller's (name, tensor) stream into buckets on
a producer thread while this thread ships the previous bucket and collects acks, so
gathering / casting / copying bucket i+1 overlaps sending bucket i. Only two bucket
buffers exist (double buffering): a slot is refilled only after every live receiver has
acknowledged the bucket in it. Metadata and acks travel over a ZeroMQ ROUTER socket
(msgpack); bucket bytes over the backend's data plane.

A publish is done when every member *loaded* the update: after the last bucket each receiver
confirms once its engine serves the new weights (`Update.confirm`), so the caller may send
requests the moment `publish` returns (a server still reloading would otherwise be asked to
generate with half-loaded layers).

What it does not know: where tensors come from (FSDP, a plain model) and what a receiver
does with them. Versions and eviction are decided by `Membership`. With FSDP2 only rank 0
builds a Sender; the other ranks iterate the same full-tensor gather in lockstep (the
iterator is consumed on the producer thread). Joins are processed whenever the sender
runs (`publish`, `sync`, `poll`, `wait_for`): it has no background thread.

Nothing a peer sends can raise out of it: malformed frames (`control.py`) are counted in
`stats()["malformed"]` and dropped, and only a joined member's acks count for an update.

Newcomers (receiver ids not in the first update that never completed one) take part in a publish
only when named; `sync()` brings them in (`Membership.publishable`): fresh ids cost an insider
nothing, so they must not cost every publish a timeout.

Liveness: a receiver evicted for a timeout is a suspect; when it joins again it is sent a
`Probe` and takes part only once it answers (`Pong`), so a peer that keeps joining but never
reads stalls one publish (one `timeout_s`), not every one:

    publish v=4 {r0, r1}: r1 silent -> evicted after timeout_s (suspect)
    r1 -> Join             sender -> Probe(n) to r1; r1 stays out
    publish v=5 {r0}       returns without waiting for r1
    r1 -> Pong(n)          r1 live, behind -> sync() / publish v=6 bring it current

A member whose process died is not waited for: while an update waits on members, every
`LIVENESS_S` each one that has not answered is sent a `Probe`, and one that no connection holds
at two such looks in a row (its process is gone, so is its TCP connection) is evicted at once as
`disconnected`, not after `timeout_s`. A receiver restarted under the same id holds it again
through its new connection (ZMQ_ROUTER_HANDOVER); its Join before the update's first bucket
is sent the update's `Begin` (the new process takes part), a later one evicts the old member
(`rejoined`). A connected receiver that does not answer (a hung process) is evicted as a
`straggler` once half of the members answered that step and `straggler_s` passed (at least
`STRAGGLER_FACTOR` times what they took), else after `timeout_s`:

    publish v=7 {r0, r1, r2}: r0, r1 ack bucket 0 after 0.04 s; r2 silent (hung)
    -> r2 evicted at 2.0 s (straggler_s), not 30 s (timeout_s); the update goes on with {r0, r1}
"""

from __future__ import annotations

import dataclasses
import queue
import secrets
import threading
import time
from typing import Callable, Iterable

import torch

from checkpoint_engine.backends import make_sender_transport
from checkpoint_engine.backends.base import pack_device
from checkpoint_engine.buckets import BucketPacker
from checkpoint_engine.config import WeightsConfig
from checkpoint_engine.control import SenderSocket
from checkpoint_engine.membership import DISCONNECTED, STRAGGLER, TIMEOUT, Membership, UpdateOutcome
from checkpoint_engine.wire import Abort, Ack, Begin, Bucket, BucketMeta, End, Group, Join, Nack, Pong, Probe
from plane_common.net import endpoint, resolve

NamedTensors = Iterable[tuple[str, torch.Tensor]]
READY = -1
GROUP = -2
LOADED = -3
LIVENESS_S = 0.5
STRAGGLER_FACTOR = 3.0
"""A straggler's grace is at least this many times what half of the members took to answer (`straggler_s`)."""
"""Seconds between two looks at whether the members an update waits on are still connected."""


class Sender:
    """Publishes versions of a state dict to every joined receiver.

    Example:
        sender = Sender(WeightsConfig(backend="shm"), state_fn=model_state)
        ... rollout servers start `Receiver(cfg, "server-0", endpoint=sender.endpoint)` ...
        out = sender.publish(model.state_dict().items(), version=1)
        out.completed, out.evicted   # who holds v1 now, who was dropped and why
        sender.sync()                # late joiners / returning receivers get v1
    """

    def __init__(self, config: WeightsConfig, state_fn: Callable[[], NamedTensors] | None = None):
        self.config = dataclasses.replace(config, host=resolve(config.host, "weights.host"))
        """`config` with `host` resolved on this process's host: what its listeners bind and advertise."""
        self.state_fn = state_fn
        self.membership = Membership()
        self.transport = make_sender_transport(self.config)
        self._ctl = SenderSocket(self.config)
        self.port = self._ctl.port
        self._update_id = 0
        self._epoch = 0
        self._rejoined: set[str] = set()
        """Receivers that sent Join during the update in progress (a restarted process)."""
        self._group: tuple[str, ...] | None = None
        """gloo/nccl: members of the live process group, kept across updates while unchanged."""
        self._width: dict[str, int] = {}
        """Ranks each receiver takes in a group (its `Join.width`)."""
        self.last: UpdateOutcome | None = None
        self._begin: Begin | None = None
        """The update in progress's Begin (sent again to a member restarted before its first bucket)."""
        self._shipped = -1
        """Highest bucket index announced in the update in progress (acks beyond it are malformed)."""
        self._probes: dict[str, tuple[list[int], Join]] = {}
        """Suspects that joined again: the nonces of the probes they were sent, and their Join."""
        self.stale = 0
        """Well-formed acks / pongs that came too late to matter (an update already left)."""
        self._pings: set[int] = set()
        """Nonces of the liveness probes sent while waiting on members (their pongs mean nothing more)."""

    @property
    def endpoint(self) -> str:
        """ZeroMQ address receivers connect to: the address the control socket bound (never a wildcard)."""
        return endpoint(self.config.host, self.port)

    # ---- control plane -------------------------------------------------------------
    def _send(self, rid: str, msg) -> bool:
        """False: no connection holds `rid` (nothing was sent)."""
        return self._ctl.send(rid, msg)

    def _connected(self, rid: str) -> bool:
        """Whether a connection holds `rid`, found by sending it a liveness probe."""
        nonce = secrets.randbits(62)
        if len(self._pings) > 4096:  # pongs that never came back (their receivers died)
            self._pings.clear()
        self._pings.add(nonce)
        return self._send(rid, Probe(nonce))

    def _recv(self, timeout_s: float) -> tuple[str, object] | None:
        """Next admitted message, or None after `timeout_s`; malformed frames are counted, never raised."""
        return self._ctl.recv(timeout_s, self._admit)

    def _admit(self, rid: str, msg: object) -> str | None:
        """The sender's checks of a well-formed record from `rid` (None: accepted, else the reason
        it is malformed), and the joins and probes it causes."""
        if isinstance(msg, Join):
            if msg.receiver_id != rid:
                return "identity"
            if self.membership.is_suspect(rid):  # timed out before: prove you read, then join
                nonces = self._probes.get(rid, ([], msg))[0][-3:]
                nonces.append(secrets.randbits(62))
                self._probes[rid] = (nonces, msg)
                self._send(rid, Probe(nonces[-1]))
            else:
                self._accept(rid, msg)
            return None
        known = rid in self.membership.receivers or rid in self._probes
        if isinstance(msg, Pong):
            if not known:
                return "member"
            if msg.nonce in self._pings:  # a liveness probe's answer: the send had already told
                self._pings.discard(msg.nonce)
                return None
            probe = self._probes.get(rid)
            if probe is None:
                self.stale += 1
            elif msg.nonce not in probe[0]:
                return "probe"
            else:
                del self._probes[rid]
                self._accept(rid, probe[1])
            return None
        if isinstance(msg, (Ack, Nack)):
            if not known:
                return "member"
            if not 1 <= msg.update_id <= self._update_id:
                return "update"
            if msg.update_id == self._update_id and msg.index > self._shipped:
                return "index"
            return None
        return "direction"  # Begin, Group, Bucket, End, Abort, Probe: only a sender sends those

    def _accept(self, rid: str, join: Join) -> None:
        self.membership.join(rid, join.version)
        self._width[rid] = join.width
        self._rejoined.add(rid)
        if self._group is not None and rid in self._group:
            self._group = None  # a restarted process is not in the old group

    def poll(self, timeout_s: float = 0.0) -> list[str]:
        """Process pending joins; returns the live receivers."""
        deadline = time.monotonic() + timeout_s
        while self._recv(max(0.0, deadline - time.monotonic())) is not None:
            pass
        return self.membership.live()

    def wait_for(self, n: int, timeout_s: float) -> list[str]:
        """Block until at least `n` receivers are live (joined); TimeoutError otherwise."""
        deadline = time.monotonic() + timeout_s
        while len(self.poll(0.05)) < n:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(self.membership.live())} of {n} receivers joined")
        return self.membership.live()

    def wait_for_ids(self, receivers: Iterable[str], timeout_s: float, connected: bool = False) -> list[str]:
        """Wait up to `timeout_s` until every receiver in `receivers` is live; returns those
        still missing (an empty list when all joined). `connected`: and a connection holds its id (a
        process restarted under the id of one that died is live through the dead one's entry until its
        own Join is read; its connection comes first, the Join right after)."""
        want = set(receivers)
        deadline = time.monotonic() + timeout_s
        wait = 0.0  # no wait when everyone already joined
        while True:
            live = set(self.poll(wait))
            missing = sorted(r for r in want if r not in live or connected and not self._connected(r))
            if not missing or time.monotonic() > deadline:
                return missing
            wait = 0.05 if connected else 0.01

    def _collect(self, uid: int, index: int, members: list[str], timeout_s: float,
                 outcome: UpdateOutcome) -> tuple[set[str], set[str]]:
        """Wait for every member's Ack/Nack of `index`. Returns (acked, need_regroup);
        silent or refusing members are evicted from `members` in place."""
        acked: set[str] = set()
        regroup: set[str] = set()
        start = time.monotonic()
        deadline = start + timeout_s
        look = start + LIVENESS_S
        unreachable: set[str] = set()  # not connected at the last look
        late, armed = TIMEOUT, self.config.straggler_s > 0
        while len(acked | regroup) < len(members):
            now = time.monotonic()
            if armed and len(members) >= 2 and len(acked | regroup) * 2 >= len(members):  # half answered: the rest get a grace
                armed = False
                grace = max(self.config.straggler_s, STRAGGLER_FACTOR * (now - start))
                if now + grace < deadline:
                    deadline, late = now + grace, STRAGGLER
            if now >= look:
                look = now + LIVENESS_S
                for rid in [r for r in members if r not in acked and r not in regroup]:
                    if self._connected(rid):
                        unreachable.discard(rid)
                    elif rid in unreachable:  # gone at two looks: its process died
                        self._evict(rid, DISCONNECTED, members, outcome)
                    else:
                        unreachable.add(rid)
                continue
            got = self._recv(min(deadline, look) - now)
            if got is None:
                if time.monotonic() >= deadline:
                    break
                continue
            rid, msg = got
            if rid in self._rejoined and rid in members and index == READY:  # a restart, before any bucket: it takes part
                self._rejoined.discard(rid)
                acked.discard(rid)
                self._send(rid, self._begin)
            elif rid in self._rejoined and rid in members:
                self._evict(rid, "rejoined", members, outcome, tell=False)
            elif isinstance(msg, Ack) and rid in members and msg.update_id == uid and msg.index == index:
                acked.add(rid)
            elif isinstance(msg, Nack) and msg.update_id == uid and rid in members:
                if msg.reason == "transport":
                    regroup.add(rid)
                else:
                    self._evict(rid, msg.reason, members, outcome)
        for rid in [r for r in members if r not in acked and r not in regroup]:
            self._evict(rid, late, members, outcome)
        return acked, regroup

    def _evict(self, rid: str, reason: str, members: list[str], outcome: UpdateOutcome,
               tell: bool = True) -> None:
        members.remove(rid)
        outcome.evicted[rid] = reason
        if tell:
            self._send(rid, Abort(self._update_id, reason))
            self.membership.evict(rid, reason)

    def _form_group(self, uid: int, members: list[str], outcome: UpdateOutcome) -> None:
        """gloo/nccl: (re)build the group sender + `members`; retried when one is missing. A
        receiver of width w takes w consecutive ranks (one per engine worker)."""
        self._group = None
        while members:
            self._epoch += 1
            world = 1 + sum(self._width.get(rid, 1) for rid in members)
            rank = 1
            for rid in members:
                self._send(rid, Group(uid, self._epoch, rank, world))
                rank += self._width.get(rid, 1)
            try:
                self.transport.form_group(self._epoch, world)
                self._group = tuple(members)
                return
            except RuntimeError:  # deliberate retry: someone never joined the group
                self._collect(uid, GROUP, members, self.config.timeout_s, outcome)

    # ---- one update ----------------------------------------------------------------
    def publish(self, named_tensors: NamedTensors, version: int,
                receivers: Iterable[str] | None = None) -> UpdateOutcome:
        """Send `named_tensors` as `version` to every live receiver that was in the first update or completed one
        (or, named, to those of `receivers` that are live); returns once each one loaded it (its
        engine serves the new weights) or was evicted. Receivers in `receivers` that are not live
        are reported as evicted. A newcomer (not in the first update, never completed one) is left
        for `sync()` unless named (`Membership.publishable`)."""
        self.membership.check_next(version)
        self.poll()
        candidates = self.membership.live() if receivers is not None else self.membership.publishable()
        members, absent = self._select(candidates, receivers)
        out = self._run(named_tensors, version, members)
        out.evicted.update(absent)
        self.membership.commit(version)
        return out

    def sync(self, named_tensors: NamedTensors | None = None,
             receivers: Iterable[str] | None = None, *, resend: bool = False) -> UpdateOutcome | None:
        """Bring receivers that are behind (late joiners, returning evictees), or those of them in
        `receivers`, to the current version; `named_tensors` defaults to `state_fn()`. None when
        nobody is behind (`named_tensors` is then not consumed). `resend=True`: send the current
        version to the live `receivers` even if they acknowledged it (their engine was found
        serving other weights, e.g. by a parity check)."""
        self.poll()
        candidates = self.membership.live() if resend and receivers is not None else self.membership.behind()
        behind, absent = self._select(candidates, receivers)
        if not behind or self.membership.version < 0:
            return None
        if named_tensors is None:
            if self.state_fn is None:
                raise ValueError("sync() needs named_tensors or a Sender(state_fn=...)")
            named_tensors = self.state_fn()
        out = self._run(named_tensors, self.membership.version, behind)
        out.evicted.update(absent)
        return out

    def _select(self, candidates: list[str], receivers: Iterable[str] | None) -> tuple[list[str], dict[str, str]]:
        """(members of an update, {asked-for receiver: why it is left out})."""
        if receivers is None:
            return candidates, {}
        want = set(receivers)
        known = self.membership.receivers
        absent = {r: ("evicted" if r in known and not known[r].alive else "not joined")
                  for r in sorted(want - set(self.membership.live()))}
        return [r for r in candidates if r in want], absent

    def _run(self, named_tensors: NamedTensors, version: int, members: list[str]) -> UpdateOutcome:
        t0 = time.perf_counter()
        self._update_id += 1
        uid = self._update_id
        self._rejoined = set()
        self._shipped = -1
        members = list(members)
        self.membership.start(members)
        outcome = UpdateOutcome(version)
        begin = self._begin = Begin(uid, version, self.transport.begin_info())
        for rid in members:
            self._send(rid, begin)
        self._collect(uid, READY, members, self.config.timeout_s, outcome)
        if self.transport.collective and self._group != tuple(members):
            self._form_group(uid, members, outcome)

        free: queue.Queue[int] = queue.Queue()
        ready: queue.Queue[BucketMeta | BaseException | None] = queue.Queue()
        for s in range(len(self.transport.slots)):
            free.put(s)
        stop = threading.Event()
        packer = BucketPacker(named_tensors, self.config.bucket_bytes)
        device = pack_device(self.config)

        def produce() -> None:
            try:
                if device is not None:  # a new thread starts on cuda:0, whatever rank this is
                    torch.cuda.set_device(device)
                while True:
                    slot = free.get()
                    if stop.is_set():
                        return
                    meta = packer.fill(self.transport.slots[slot], slot, self.config.checksum)
                    if meta is not None:
                        self.transport.seal(meta)
                    ready.put(meta)
                    if meta is None:
                        return
            except BaseException as e:  # handed to the publishing thread, which re-raises
                ready.put(e)

        producer = threading.Thread(target=produce, name="weights-pack", daemon=True)
        producer.start()
        try:
            while (item := ready.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                self._ship(uid, item, members, outcome)
                free.put(item.slot)
                outcome.buckets += 1
        finally:
            stop.set()
            free.put(0)
            producer.join()
        for rid in members:
            self._send(rid, End(uid, version))
        # the engines load the last tensors after End: the update is done when each says so
        self._collect(uid, LOADED, members, self.config.timeout_s, outcome)
        for rid in members:
            self.membership.complete(rid, version)
        outcome.completed = members
        outcome.bytes = packer.total_bytes
        outcome.seconds = time.perf_counter() - t0
        self.last = outcome
        return outcome

    def _ship(self, uid: int, meta: BucketMeta, members: list[str], outcome: UpdateOutcome) -> None:
        """Deliver one bucket to every member, regrouping collectives after an eviction."""
        self._shipped = max(self._shipped, meta.index)
        while members:
            for rid in members:
                self._send(rid, Bucket(uid, meta))
            failed = False
            if self.transport.collective:
                try:
                    self.transport.send(meta)
                except RuntimeError:  # translated: a member is gone; acks tell which
                    failed = True
            else:
                self.transport.send(meta)
            wait = self.config.timeout_s * (1.2 if self.transport.collective else 1.0) + 1.0
            before = len(members)
            _, regroup = self._collect(uid, meta.index, members, wait, outcome)
            if not self.transport.collective or not (failed or regroup or len(members) < before):
                return
            self._form_group(uid, members, outcome)

    def stats(self) -> dict[str, object]:
        """Versions and membership (`newcomers`: live receivers an unnamed publish leaves for `sync()`;
        `probing`: suspects that joined again and were sent a probe they have not answered),
        plus what was refused: `malformed` (frames dropped, by reason:
        parts, identity, oversized, msgpack, kind, fields, direction, member, update, index, probe),
        `stale` and, with a secret, `auth` (`refused` client keys, `handshake_failed`)."""
        return {"version": self.membership.version, "live": self.membership.live(),
                "behind": self.membership.behind(), "newcomers": self.membership.newcomers(),
                "evicted": self.membership.evicted(),
                "suspect": self.membership.suspects(), "probing": sorted(self._probes), "stale": self.stale, **self._ctl.stats()}

    def close(self) -> None:
        for rid in self.membership.live():
            self._send(rid, Abort(self._update_id, "sender closed"))
        self._ctl.close()
        self.transport.close()
