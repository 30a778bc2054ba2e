"""Records the trainer could not read, with a durable queue (a real redis-server): they leave at the next
checkpoint, counted as dropped `unreadable`, and only they: the rest of their group was trained and is acked.
Redis finishes whole groups; before `records_only` a partial drop counted the group's trained records as
dropped too, and the run's accounting came out negative (trained + dropped + resident > put)."""

from __future__ import annotations

import asyncio

import pytest

from asyncrl.staleness import StalenessManager
from asyncrl.trajectory_queue import TrajectoryQueue, trajectory_sample
from asyncrl.types import Trajectory
from tests.integration.transfer_queue._redis import RedisServer
from transfer_queue import TransferQueueConfig


@pytest.fixture
def server(tmp_path):
    s = RedisServer(str(tmp_path))
    yield s
    s.stop()


def _traj(i: int) -> Trajectory:
    return Trajectory(uid=f"u{i}", group_id="g", index_in_group=i, group_size=4, prompt_ids=[1, 2],
                      response_ids=[3, 4, 5], behavior_logprobs=[-0.1] * 3, loss_mask=[1] * 3, token_versions=[0] * 3,
                      min_version=0, max_version=0, reward=1.0, reward_info={})


@pytest.mark.timeout(30)
def test_a_groups_unreadable_records_alone_are_dropped_at_the_checkpoint(server, tmp_path):
    async def main() -> None:
        cfg = TransferQueueConfig(metadata="redis", redis_url=server.url, storage="shm", shm_dir=str(tmp_path), run_id="unr")
        q = TrajectoryQueue(cfg, StalenessManager(batch_groups=1, eta=1))
        try:
            await q.put([trajectory_sample(q.storage, _traj(i)) for i in range(4)])
            batch, _ = await q.get(1, 4, step=0, poll_s=0.1)
            assert len(batch.samples) == 4
            await q.drop_unreadable(batch, {"u1", "u3"})
            await q.trained(batch)
            s = await q.client.stats()
            assert (s.acked["trainer"], s.dropped["trainer"]["unreadable"]) == (0, 0)  # nothing before the checkpoint
            await q.checkpointed()
            s = await q.client.stats()
            assert (s.acked["trainer"], s.dropped["trainer"]["unreadable"], s.put) == (2, 2, 4)
            assert s.resident == 0 and sum(s.depth["trainer"].values()) == 0
        finally:
            await q.close()

    asyncio.run(main())
