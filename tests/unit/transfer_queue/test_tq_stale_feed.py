"""Stale drops reach admission through the `Batch` a `get` returns (`TrajectoryQueue.get`), and the idle
ratio is one rule (`asyncrl.metrics.idle_ratio`) for the controller's metrics and `asyncrl status`."""

from __future__ import annotations

import asyncio

import pytest

from asyncrl.metrics import idle_ratio
from asyncrl.staleness import StalenessManager
from asyncrl.trajectory_queue import TrajectoryQueue, trajectory_sample
from asyncrl.types import Trajectory
from transfer_queue import TransferQueueConfig


def _traj(uid: str, version: int) -> Trajectory:
    return Trajectory(uid=uid, group_id=uid, index_in_group=0, group_size=1, prompt_ids=[1, 2], response_ids=[3, 4],
                      behavior_logprobs=[-0.5, -0.5], loss_mask=[1, 1], token_versions=[version] * 2,
                      min_version=version, max_version=version, reward=1.0, reward_info={})


@pytest.mark.timeout(20)
def test_stale_drops_of_a_get_free_their_admission_slots():
    async def main() -> None:
        mgr = StalenessManager(batch_groups=1, eta=1)
        q = TrajectoryQueue(TransferQueueConfig(storage="local", capacity=16), mgr)
        try:
            for uid in ("a", "b"):
                v = await mgr.acquire()
                await q.put([trajectory_sample(q.storage, _traj(uid, v))])
                await mgr.finish(accepted=True, version=v)
            await mgr.set_version(2)
            v = await mgr.acquire()
            await q.put([trajectory_sample(q.storage, _traj("fresh", v))])
            await mgr.finish(accepted=True, version=v)
            assert mgr.accepted == 3
            batch, groups = await q.get(1, 1, step=2, poll_s=0.1)
            assert [g[0].uid for g in groups] == ["fresh"] and batch.stale_groups == 2
            assert mgr.dropped["stale"] == 2 and mgr.accepted == 1  # a and b (staleness 2 > eta 1) gave back their slots
            await q.trained(batch)
            v = await mgr.acquire()
            await q.put([trajectory_sample(q.storage, _traj("next", v))])
            await mgr.finish(accepted=True, version=v)
            batch, _ = await q.get(1, 1, step=2, poll_s=0.1)
            assert batch.stale_groups == 0 and mgr.dropped["stale"] == 2  # counted once, not again per get
        finally:
            await q.close()

    asyncio.run(main())


def test_idle_ratio_is_the_idle_share_of_the_wall_time_clamped_to_one():
    assert idle_ratio(1.0, 4.0) == 0.25
    assert idle_ratio(5.0, 4.0) == 1.0  # idle time counted from before this segment began
    assert idle_ratio(0.0, 0.0) == 0.0 and idle_ratio(1e-10, 0.0) == pytest.approx(0.1)
