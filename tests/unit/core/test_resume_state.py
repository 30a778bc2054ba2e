"""What a checkpoint keeps of the work in flight, and how a resume puts it back: the in-process queue's
groups with their arrays, and running groups (finished records, saved partials) taken back by the
rollouter, which counts how each resumed sample ended."""

from __future__ import annotations

import asyncio

import numpy as np

from asyncrl.data.datasets import Prompt, PromptSet, PromptStream
from asyncrl.rollout.inflight import SavedCall, SavedSample
from asyncrl.rollout.resume import capture, read_async_state, reinstate, write_async_state
from asyncrl.rollout.rollouter import Rollouter
from asyncrl.staleness import StalenessManager
from asyncrl.trajectory_queue import TrajectoryQueue, load_record, save_record, trajectory_sample
from asyncrl.types import Trajectory
from transfer_queue import TransferQueueConfig
from transfer_queue.storage.local import LocalStorage


def _traj(uid: str, gid: str, i: int, n: int = 2, resumed: int | None = None) -> Trajectory:
    meta = {"data_index": 0} | ({} if resumed is None else {"resumed_tokens": resumed})
    return Trajectory(uid=uid, group_id=gid, index_in_group=i, group_size=n, prompt_ids=[1, 2], response_ids=[5, 6, 7],
                      behavior_logprobs=[-0.5] * 3, loss_mask=[1] * 3, token_versions=[3, 3, 4], min_version=3, max_version=4,
                      reward=float(i), meta=meta)


def test_a_record_round_trips_through_its_saved_form_with_its_arrays_and_version():
    plane = LocalStorage(inline_max_bytes=0)
    rec = trajectory_sample(plane, _traj("g-0", "g", 0))
    saved = save_record(plane, rec)
    plane.free(list(rec.handles.values()))  # the plane it lived in is gone
    back = load_record(plane, saved)
    assert (back.uid, back.version, back.meta) == (rec.uid, rec.version, rec.meta)
    got = plane.read([back.handles["response_ids"], back.handles["token_versions"]])
    assert got[0].tolist() == [5, 6, 7] and got[1].tolist() == [3, 3, 4] and got[0].dtype == np.int32


def test_a_checkpoint_keeps_queued_and_running_groups_and_a_resume_continues_them(tmp_path):
    """Group q is queued, group r runs with r-0 finished and r-1 cut after 2 tokens (reported by a
    server); after the resume q is in the queue again and r-1 is continued from its saved state."""
    cfg = TransferQueueConfig(storage="local", inline_max_bytes=0)

    async def go():
        staleness = StalenessManager(batch_groups=1, eta=4)
        queue = TrajectoryQueue(cfg, staleness)
        plane = queue.storage
        await queue.put([trajectory_sample(plane, _traj(f"q-{i}", "q", i)) for i in range(2)])
        rollouter = Rollouter(run_sample=None, prompts=None, staleness=staleness, sink=queue.put, discard=queue.discard, group_size=2)
        r = rollouter._new_group(Prompt(7, "", [1, 2], "ans"), 0)
        r.done[0] = trajectory_sample(plane, _traj(r.samples[0].uid, r.group_id, 0))
        rollouter._groups[r.group_id] = r

        class Server:
            async def partial_samples(self):
                return [SavedSample(r.samples[1].uid, [SavedCall("d", [5, 6], [-0.1, -0.2], [3, 3])])]

        work = await capture([Server()], rollouter, queue)
        write_async_state(tmp_path, work)
        await queue.close()

        # a new process: a fresh queue and rollouter
        staleness = StalenessManager(batch_groups=1, eta=4)
        queue = TrajectoryQueue(cfg, staleness)
        ran, fates, sunk = [], [], []

        async def run_sample(sample, saved=None):
            ran.append((sample.uid, saved))
            used = None if saved is None else saved.tokens
            return trajectory_sample(queue.storage, _traj(sample.uid, sample.group_id, sample.index_in_group, resumed=used))

        async def sink(group):
            sunk.append([s.uid for s in group])
            await queue.put(group)

        rollouter = Rollouter(run_sample=run_sample, prompts=PromptStream(PromptSet([Prompt(0, "", [1], "a")]), seed=0),
                              staleness=staleness, sink=sink, discard=queue.discard, group_size=2,
                              on_resumed=lambda fate, rec: fates.append((fate, rec.uid)))
        counts = await reinstate(read_async_state(tmp_path), rollouter=rollouter, queue=queue)
        running_after_reinstate = staleness.running
        staleness.accepted = staleness.taken + counts["queued_groups"]  # what the controller does for an in-process queue
        task = asyncio.create_task(rollouter.run())
        while not sunk:
            await asyncio.sleep(0.01)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        batch, groups = await queue.get(2, 2, 0)
        await queue.close()
        return r, work, counts, running_after_reinstate, ran, fates, sunk, groups

    r, work, counts, running, ran, fates, sunk, groups = asyncio.run(go())
    assert [x.uid for x in work.queued] == ["q-0", "q-1"] and [g.group_id for g in work.groups] == [r.group_id]
    assert counts == {"queued_restored": 2, "queued_groups": 1, "finished_restored": 1, "in_flight": 1, "saved_partial": 1}
    assert running == 1  # the running group counts as running at once, before the rollouter starts it
    resumed = [(uid, s.tokens) for uid, s in ran if uid.startswith(r.group_id)]
    assert resumed == [(r.samples[1].uid, 2)] and ran[0][0] == r.samples[1].uid  # only the cut sample runs, first, from its state
    assert fates == [("continued", r.samples[1].uid)]
    assert sunk[0] == [r.samples[0].uid, r.samples[1].uid]  # whole, in index order
    assert sorted(g[0].group_id for g in groups) == sorted(["q", r.group_id])  # the queued group came back too
