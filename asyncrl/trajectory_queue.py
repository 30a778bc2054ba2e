"""Trajectories through the TransferQueue: the pipeline's producer and consumer verbs.

A `Trajectory` is put as one TransferQueue record: scalar fields in `meta`, per-token
arrays as tensors (written once to the data plane), `version` = its oldest token
version, grouped by `group_id` so GRPO groups are delivered whole. The trainer takes
`n` whole groups within the staleness bound (`max_staleness=eta` at its current step),
oldest first; with in-order consumption none newer than the oldest group still running
(`max_version=StalenessManager.takeable_version()`, asked again whenever a group ends).
Groups the queue drops as too stale are reported to the `StalenessManager` so admission
can replace them.

Acknowledgement (who owns "trained exactly once"): with a durable queue (`redis`) the
trainer acks at its checkpoint, so a crash between checkpoints redelivers what was not
yet covered by a checkpoint; leases of delivered, unacked batches are renewed after
every step. With the in-process `memory` queue (which dies with the process anyway) a
batch is acked as soon as it is trained.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from asyncrl.staleness import StalenessManager
from asyncrl.types import Trajectory
from transfer_queue import AsyncTransferQueueClient, Batch, Record, TransferQueueConfig

_ARRAYS = {"prompt_ids": np.int32, "response_ids": np.int32, "behavior_logprobs": np.float32, "loss_mask": np.int8, "token_versions": np.int32}
_SCALARS = ("uid", "group_id", "index_in_group", "group_size", "min_version", "max_version", "reward", "reward_info", "finish_reason", "meta", "timings")


def to_record(t: Trajectory) -> Record:
    return Record(
        uid=t.uid,
        group_id=t.group_id,
        group_size=t.group_size,
        version=t.min_version,
        meta={k: getattr(t, k) for k in _SCALARS},
        tensors={k: np.asarray(getattr(t, k), dtype=dt) for k, dt in _ARRAYS.items()},
    )


def from_record(meta: dict[str, Any], tensors: dict[str, Any]) -> Trajectory:
    fields = dict(meta)
    for k in _ARRAYS:
        fields[k] = np.asarray(tensors[k]).tolist()
    return Trajectory(**fields).validate()


class TrajectoryQueue:
    def __init__(self, cfg: TransferQueueConfig, staleness: StalenessManager, *, consumer: str = "trainer") -> None:
        self.client = AsyncTransferQueueClient(cfg)
        self.staleness = staleness
        self.consumer = consumer
        self.ack_at_checkpoint = cfg.metadata == "redis"
        self.pending: list[Batch] = []
        """Trained batches not yet acked (durable queue: until the next checkpoint)."""
        self._stale_seen = 0

    async def put(self, group: list[Trajectory]) -> None:
        await self.client.put([to_record(t) for t in group])

    async def get(self, n: int, group_size: int, step: int, poll_s: float = 0.5) -> tuple[Batch, list[list[Trajectory]]]:
        """Wait for `n` whole groups with staleness <= eta at trainer step `step`, none newer
        than the oldest group still running when consumption is in order."""
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
                # a limit is only good until a running group ends: then ask again at once
                timeout=poll_s if newest is None else 0.01,
            )
            await self._sync_drops(group_size)
            if batch.samples:
                break
            if newest is not None:
                await self.staleness.wait_changed(seen, poll_s)
        tensors = await self.client.fetch(batch, as_torch=False)
        by_group: dict[str, list[Trajectory]] = {}
        for s, ts in zip(batch.samples, tensors):
            by_group.setdefault(s.group_id, []).append(from_record(s.meta, ts))
        groups = [sorted(g, key=lambda t: t.index_in_group) for g in by_group.values()]
        return batch, groups

    async def _sync_drops(self, group_size: int) -> None:
        """Groups the queue dropped as too stale free their admission slots."""
        stats = await self.client.stats()
        stale = int(stats.dropped.get(self.consumer, {}).get("stale", 0))  # records
        groups = (stale - self._stale_seen) // group_size
        if groups > 0:
            self._stale_seen += groups * group_size
            await self.staleness.drop_accepted("stale", groups)

    async def trained(self, batch: Batch) -> None:
        if self.ack_at_checkpoint:
            self.pending.append(batch)
            for b in self.pending:
                await self.client.renew(b)
        else:
            await self.client.ack(batch)

    async def checkpointed(self) -> None:
        for b in self.pending:
            await self.client.ack(b)
        self.pending.clear()

    async def depth(self) -> dict[str, Any]:
        s = await self.client.stats()
        d = s.depth.get(self.consumer, {})
        return {"ready": d.get("ready", 0), "waiting": d.get("waiting", 0), "leased": d.get("leased", 0), "resident": s.resident, "capacity": s.capacity}

    async def close(self) -> None:
        await self.client.close()
