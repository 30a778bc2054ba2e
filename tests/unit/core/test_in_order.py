"""In-order consumption: the trainer waits for an older group still running instead of taking a
newer ready one, and takes a newer one when no older one remains (a failed group's replacement)."""

import asyncio

import pytest

from asyncrl.staleness import StalenessManager
from asyncrl.trajectory_queue import TrajectoryQueue, trajectory_sample
from asyncrl.types import Trajectory
from transfer_queue import TransferQueueConfig


def _group(q: TrajectoryQueue, gid: str, version: int) -> list:
    return [trajectory_sample(q.storage, Trajectory(
        uid=f"{gid}-{i}", group_id=gid, index_in_group=i, group_size=2, prompt_ids=[1], response_ids=[5],
        behavior_logprobs=[-0.1], loss_mask=[1], token_versions=[version], min_version=version,
        max_version=version, reward=float(i))) for i in range(2)]


@pytest.mark.timeout(30)
def test_in_order_waits_for_the_older_running_group_and_takes_a_replacement_without_deadlock():
    async def go():
        s = StalenessManager(batch_groups=2, eta=1, in_order=True)
        q = TrajectoryQueue(TransferQueueConfig(storage="local"), s)

        async def finish(gid, v, ok=True):
            if ok:
                await q.put(_group(q, gid, v))
            await s.finish(accepted=ok, cause="" if ok else "reward_failed", version=v)

        vs = [await s.acquire() for _ in range(4)]  # g0..g3 at version 0
        assert vs == [0] * 4 and not s.can_start()
        await finish("g0", 0); await finish("g2", 0)
        _, groups = await q.get(2, 2, step=0)
        assert sorted(g[0].group_id for g in groups) == ["g0", "g2"]
        await s.set_version(1)
        await finish("g1", 0, ok=False)  # failed reward: its replacement starts at version 1
        assert await s.acquire() == 1 and await s.acquire() == 1  # g4, g5
        await finish("g4", 1); await finish("g5", 1)
        # step 1: g3 (version 0) still runs, so the trainer must not take the ready g4, g5
        take = asyncio.create_task(q.get(2, 2, step=1, poll_s=0.05))
        await asyncio.sleep(0.3)
        assert not take.done()
        await finish("g3", 0)
        _, groups = await asyncio.wait_for(take, 5)  # no version-0 group left: g4 completes the batch
        assert {g[0].group_id: g[0].version for g in groups} == {"g3": 0, "g4": 1}
        await q.close()

    asyncio.run(go())


@pytest.mark.timeout(30)
def test_ready_first_takes_the_newer_ready_group():
    async def go():
        s = StalenessManager(batch_groups=1, eta=1, in_order=False)
        q = TrajectoryQueue(TransferQueueConfig(storage="local"), s)
        v0 = await s.acquire()
        await s.set_version(1)
        v1 = await s.acquire()
        await q.put(_group(q, "young", v1))
        await s.finish(accepted=True, version=v1)
        assert s.takeable_version() is None
        _, groups = await asyncio.wait_for(q.get(1, 2, step=1, poll_s=0.05), 5)
        assert groups[0][0].group_id == "young"
        await s.finish(accepted=False, cause="reward_failed", version=v0)
        await q.close()

    asyncio.run(go())
