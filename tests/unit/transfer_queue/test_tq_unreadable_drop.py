"""Records the trainer could not read leave the queue by a counted rule (`unreadable`), once: the ack
of their whole batch afterwards counts only the others."""

from __future__ import annotations

import asyncio

import pytest

from asyncrl.staleness import StalenessManager
from asyncrl.trajectory_queue import TrajectoryQueue, trajectory_sample
from asyncrl.types import Trajectory
from transfer_queue import TransferQueueConfig
from transfer_queue.metadata.base import DROP_CAUSES


def _traj(i: int) -> Trajectory:
    return Trajectory(uid=f"u{i}", group_id="g", index_in_group=i, group_size=4, prompt_ids=[1, 2], response_ids=[3, 4],
                      behavior_logprobs=[-0.5, -0.5], loss_mask=[1, 1], token_versions=[0, 0],
                      min_version=0, max_version=0, reward=1.0, reward_info={})


def test_unreadable_is_a_drop_cause():
    assert "unreadable" in DROP_CAUSES


@pytest.mark.timeout(20)
def test_unreadable_records_are_counted_once_and_the_batch_ack_counts_the_rest():
    async def main() -> None:
        mgr = StalenessManager(batch_groups=1, eta=1)
        q = TrajectoryQueue(TransferQueueConfig(storage="local", metadata="memory", capacity=8), mgr)
        try:
            await q.put([trajectory_sample(q.storage, _traj(i)) for i in range(4)])
            batch, _ = await q.get(1, 4, step=0, poll_s=0.1)
            assert len(batch.samples) == 4
            await q.drop_unreadable(batch, {"u1", "u3", "not-in-this-batch"})
            s = await q.client.stats()
            assert s.dropped["trainer"]["unreadable"] == 2 and s.acked["trainer"] == 0
            await q.trained(batch)  # the in-process queue acks the whole batch at once
            s = await q.client.stats()
            dropped = sum(s.dropped["trainer"].values())
            assert (s.acked["trainer"], s.dropped["trainer"]["unreadable"], dropped) == (2, 2, 2)
            assert s.acked["trainer"] + dropped == s.put == 4
            assert s.resident == 0  # every record freed, the unreadable ones included
        finally:
            await q.close()

    asyncio.run(main())
