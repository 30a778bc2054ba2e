"""Trajectories through the TransferQueue: written where they finish, queued and handed out as metadata.

Producer side (`trajectory_sample`, in the process where a trajectory is finished: a rollout
server's host): the per-token arrays of a `Trajectory` are written once into that process's
data plane, and what remains is a `SampleMeta`: scalar fields in `meta` (reward, versions,
lengths, ...), one data-plane handle per array, `version` = its oldest token version, grouped
by `group_id` so GRPO groups are delivered whole. That record (about 1 KiB, whatever the
length of the response) is all the controller ever receives.

Consumer side (`TrajectoryQueue`, in the controller): `put` adds a finished group's records
to the metadata store, `get` waits for `n` whole groups within the staleness bound
(`max_staleness=eta` at the trainer's step), oldest first; with in-order consumption none
newer than the oldest group still running (`max_version=StalenessManager.takeable_version()`,
asked again whenever a group ends). It returns metadata and handles only: the trainer's ranks
read the tensors themselves (`asyncrl.trainer.plan`). Groups the queue drops as too stale (the
`get`'s `Batch.stale_groups`) are reported to the `StalenessManager` so admission can replace them.

Acknowledgement (who owns "trained exactly once"): with a durable queue (`redis`) the
trainer acks at its checkpoint, so a crash between checkpoints redelivers what was not
yet covered by a checkpoint; leases of delivered, unacked batches are renewed after
every step. With the in-process `memory` queue (which dies with the process anyway) a
batch is acked as soon as it is trained.

Checkpoints: the `memory` queue dies with the process, so a checkpoint keeps what it holds.
`TrajectoryQueue` remembers the groups it put and has not handed out or seen dropped
(`queued()`); the checkpoint writes them with their bytes (`save_record`: metadata and arrays,
msgpack, no pickle) and a resume puts them back under their own versions (`restore`). A
durable queue keeps its records itself; `groups_held` says which groups it holds.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import msgspec
import numpy as np

from asyncrl.staleness import StalenessManager
from asyncrl.types import Trajectory
from transfer_queue import AsyncTransferQueueClient, Batch, Record, SampleMeta, StoragePlane, TransferQueueConfig, write_record
from transfer_queue.codec import DTYPES
from transfer_queue.storage import inline_bytes

_ARRAYS = {"prompt_ids": np.int32, "response_ids": np.int32, "behavior_logprobs": np.float32, "loss_mask": np.int8, "token_versions": np.int32}
_SCALARS = ("uid", "group_id", "index_in_group", "group_size", "min_version", "max_version", "reward", "reward_info", "finish_reason", "meta", "timings")


def to_record(t: Trajectory) -> Record:
    meta: dict[str, Any] = {k: getattr(t, k) for k in _SCALARS}
    meta["num_generated_tokens"] = t.num_generated_tokens
    return Record(
        uid=t.uid,
        group_id=t.group_id,
        group_size=t.group_size,
        version=t.min_version,
        meta=meta,
        tensors={k: np.asarray(getattr(t, k), dtype=dt) for k, dt in _ARRAYS.items()},
    )


def trajectory_sample(plane: StoragePlane, t: Trajectory) -> SampleMeta:
    """Write `t`'s arrays to `plane` (once) and return its queue record: metadata and handles."""
    return write_record(plane, to_record(t.validate()))


class SavedArray(msgspec.Struct, forbid_unknown_fields=True):
    """One array of a saved record: dtype tag (`transfer_queue.codec.DTYPES`), shape, raw bytes."""

    dtype: str
    shape: list[int]
    data: bytes


class SavedRecord(msgspec.Struct, forbid_unknown_fields=True):
    """A queue record with its arrays, as a checkpoint keeps it (the plane it lived in may not
    outlive the process). `version`: the record's queue version, unchanged by the round trip."""

    uid: str
    group_id: str
    group_size: int
    version: int
    meta: dict[str, Any]
    arrays: dict[str, SavedArray]


def save_record(plane: StoragePlane, s: SampleMeta) -> SavedRecord:
    """`s` with the bytes of its arrays read from `plane` (copied: the plane may free them after)."""
    names = list(s.handles)
    arrays = plane.read([s.handles[k] for k in names])
    return SavedRecord(s.uid, s.group_id, s.group_size, s.version, dict(s.meta),
                       {k: SavedArray(s.handles[k].dtype, list(a.shape), a.tobytes()) for k, a in zip(names, arrays)})


def load_record(plane: StoragePlane, r: SavedRecord) -> SampleMeta:
    """A saved record's arrays written to `plane` (once); its queue record, ready to `add`."""
    tensors = {}
    for k, a in r.arrays.items():
        if a.dtype not in DTYPES or a.dtype == "bfloat16":
            raise ValueError(f"saved record {r.uid}: array {k} has dtype {a.dtype!r}, which a trajectory never has")
        tensors[k] = np.frombuffer(a.data, dtype=DTYPES[a.dtype]).reshape(a.shape)
    return write_record(plane, Record(uid=r.uid, group_id=r.group_id, group_size=r.group_size, version=r.version,
                                      meta=dict(r.meta), tensors=tensors))


def from_record(meta: dict[str, Any], tensors: dict[str, Any]) -> Trajectory:
    """The `Trajectory` back from a record's metadata and its tensors (tests, tools)."""
    fields = {k: v for k, v in meta.items() if k in _SCALARS}
    for k in _ARRAYS:
        fields[k] = np.asarray(tensors[k]).tolist()
    return Trajectory(**fields).validate()


# ---- what the controller reads of a record ----------------------------------------------
def reward(s: SampleMeta) -> float:
    return float(s.meta["reward"])


def response_length(s: SampleMeta) -> int:
    return int(s.handles["response_ids"]["shape"][0])


def generated_tokens(s: SampleMeta) -> int:
    return int(s.meta["num_generated_tokens"])


def reward_failed(s: SampleMeta) -> bool:
    return "failed" in s.meta["reward_info"]


class TrajectoryQueue:
    def __init__(self, cfg: TransferQueueConfig, staleness: StalenessManager, *, consumer: str = "trainer",
                 storage: StoragePlane | None = None, consumer_id: str = "", token_level: bool = False,
                 on_stale: Any = None) -> None:
        """`storage`: the plane this process frees handles through (and, in one process, where
        producers write and the trainer reads); built from `cfg` when None. `consumer_id`: this
        consumer's lease holder name; a resumed run passes the same one to get its unacked
        batches back at once (durable queue). `token_level` (`trainer.staleness_level=token`): a
        group is queued under its newest token's version instead of its oldest, so it is dropped
        as stale only when none of its tokens is within eta (a short sample that finished early
        while a long one of its group still ran is kept: its reward still counts in the group's
        advantages); the trainer masks the older tokens out of the loss (`batch.mask_stale_tokens`)."""
        self.token_level = token_level
        self.on_stale = on_stale
        """Called with the records of every group the queue dropped as too stale (metadata only)."""
        self.client = AsyncTransferQueueClient(cfg, storage=storage, consumer_id=consumer_id)
        self.staleness = staleness
        self.consumer = consumer
        self.ack_at_checkpoint = cfg.metadata == "redis"
        self.lease_timeout_s = cfg.lease_timeout_s
        self._training: Batch | None = None
        self.pending: list[Batch] = []
        """Trained batches not yet acked (durable queue: until the next checkpoint)."""
        self.pending_drops: list[Batch] = []
        """Their records the trainer could not read, dropped at the same checkpoint (`drop_unreadable`)."""
        self.inline_tensor_bytes = 0
        """Tensor bytes that rode inside those records' handles (`queue.inline_max_bytes`)."""
        self.records = 0
        self._queued: dict[str, list[SampleMeta]] = {}
        """In-process queue: the groups put and not yet handed out or dropped, by group id (what a checkpoint keeps)."""
        self._put_ids: set[str] = set()
        """Groups this process put (or restored) and the queue has not handed out or dropped since: those whose
        admission slots a forged-record drop frees (a group a stranger wrote in Redis was never admitted)."""

    @property
    def storage(self) -> StoragePlane:
        return self.client.sync.storage

    def received(self, samples: list[SampleMeta]) -> None:
        """Account for records handed to this queue (their bytes on the wire are counted where they crossed
        one, `RemoteServer.delivered_record_bytes`, not by encoding them again here)."""
        self.records += len(samples)
        self.inline_tensor_bytes += sum(inline_bytes(s.handles) for s in samples)

    async def put(self, group: list[SampleMeta]) -> None:
        self.received(group)
        if self.token_level:  # the queue's version of a group: its newest token's (see `__init__`)
            newest = max(int(s.meta["max_version"]) for s in group)
            group = [dataclasses.replace(s, version=newest) for s in group]
        await self.client.add(group)
        self._put_ids.add(group[0].group_id)
        if not self.ack_at_checkpoint:
            self._queued[group[0].group_id] = group

    def queued(self) -> list[list[SampleMeta]]:
        """In-process queue: the groups it holds for the trainer now (none for a durable queue, which keeps them itself)."""
        return list(self._queued.values())

    async def restore(self, groups: list[list[SampleMeta]]) -> None:
        """Put back groups a checkpoint kept (`queued`), their versions as they were."""
        for group in groups:
            self.received(group)
            await self.client.add(group)
            self._put_ids.add(group[0].group_id)
            if not self.ack_at_checkpoint:
                self._queued[group[0].group_id] = group

    async def groups_held(self, group_ids: list[str]) -> set[str]:
        """Of `group_ids`, those whose records the queue holds now: queued, leased or trained and
        not yet acked (a durable queue after a restart); the in-process queue: those put since start."""
        held = getattr(self.client.sync.metadata, "groups_held", None)
        if held is None:
            return {g for g in group_ids if g in self._queued}
        return await asyncio.to_thread(held, group_ids)

    async def discard(self, group: list[SampleMeta]) -> None:
        """Free the tensors of a finished group that will not be queued (every reward failed)."""
        await self.client.discard(group)

    async def get(self, n: int, group_size: int, step: int, poll_s: float = 0.5) -> tuple[Batch, list[list[SampleMeta]]]:
        """Wait for `n` whole groups with staleness <= eta at trainer step `step`, none newer
        than the oldest group still running when consumption is in order; metadata only."""
        while True:
            seen = self.staleness.changes
            newest = self.staleness.takeable_version()
            batch = await self.client.get(
                self.consumer,
                num_groups=n,
                group_size=group_size,
                max_staleness=self.staleness.eta,
                current_version=step,
                max_version=newest,
                lineage=self.staleness.lineage or None,
                # a limit is only good until a running group ends: then ask again at once
                timeout=poll_s if newest is None else 0.01,
            )
            for s in [*batch.samples, *batch.stale]:  # handed out or dropped: no longer the queue's to keep
                self._queued.pop(s.group_id, None)
                self._put_ids.discard(s.group_id)
            if batch.stale_groups:  # dropped by the queue as too stale: their admission slots are free again
                await self.staleness.drop_accepted("stale", batch.stale_groups)
                if self.on_stale is not None:
                    self.on_stale(batch.stale)
            ours = [g for g in batch.forged_groups if g in self._put_ids]  # a record of theirs was changed in Redis
            if ours:
                self._put_ids.difference_update(ours)
                await self.staleness.drop_accepted("forged", len(ours))
            if batch.samples:
                self._training = batch
                break
            if newest is not None:
                await self.staleness.wait_changed(seen, poll_s)
        by_group: dict[str, list[SampleMeta]] = {}
        for s in batch.samples:
            by_group.setdefault(s.group_id, []).append(s)
        groups = [sorted(g, key=lambda s: s.meta["index_in_group"]) for g in by_group.values()]
        return batch, groups

    async def keep_leases(self) -> None:
        """Until cancelled, renew every third of `queue.lease_timeout_s` the leases this trainer
        holds: the batch in training and the trained ones waiting for the checkpoint. A step held
        up longer than the lease (a publish waiting for a dead server, a read waiting for a host cut
        off, a restart) must not let its records be redelivered and trained a second time. The
        renewals run on a thread of their own: the event loop's default pool can be busy with
        blocking calls for longer than a lease."""
        from concurrent.futures import ThreadPoolExecutor

        loop = asyncio.get_running_loop()
        with ThreadPoolExecutor(1, thread_name_prefix="tq-leases") as own:  # never queued behind the loop's busy default pool
            while True:
                await asyncio.sleep(self.lease_timeout_s / 3)
                for b in [*self.pending, *([self._training] if self._training is not None else [])]:
                    await loop.run_in_executor(own, self.client.sync.renew, b)

    async def trained(self, batch: Batch) -> None:
        self._training = None
        if self.ack_at_checkpoint:
            self.pending.append(batch)
            for b in self.pending:
                await self.client.renew(b)
        else:
            await self.client.ack(batch)

    async def drop_unreadable(self, batch: Batch, uids: set[str]) -> None:
        """Finish the records of `batch` the trainer could not read (their producer gone or cut off),
        counted as dropped `unreadable`: they leave by a counted rule, never trained, never lost silently;
        the rest of their groups was trained and is acked. A durable queue does it at the next checkpoint,
        with the step's acks (a crash before it redelivers the whole batch, as for any step after the
        checkpoint); the in-process queue at once."""
        gone = [s for s in batch.samples if s.uid in uids]
        if not gone:
            return
        part = Batch(consumer=batch.consumer, lease_id=batch.lease_id, samples=gone)
        if self.ack_at_checkpoint:
            self.pending_drops.append(part)
        else:
            await self.client.drop(part, "unreadable", records_only=True)

    async def checkpointed(self) -> None:
        for b in self.pending_drops:  # first: a durable store finishes whole groups, their read records acked
            await self.client.drop(b, "unreadable", records_only=True)
        self.pending_drops.clear()
        for b in self.pending:
            await self.client.ack(b)
        self.pending.clear()

    async def depth(self) -> dict[str, Any]:
        s = await self.client.stats()
        d = s.depth.get(self.consumer, {})
        return {"ready": d.get("ready", 0), "waiting": d.get("waiting", 0), "leased": d.get("leased", 0), "resident": s.resident, "capacity": s.capacity}

    async def close(self) -> None:
        await self.client.close()
