"""`load_shard` with a producer that cannot be reached: its rows become padding rows (no loss, not
counted as real) and are returned with why, the other rows are read as they are, and every mini-batch
keeps its number of rows."""

from __future__ import annotations

import pytest
import torch

from asyncrl.batching import PlanBuilder
from asyncrl.config import AlgorithmConfig
from asyncrl.trainer.plan import BatchPlan, load_shard
from asyncrl.trajectory_queue import trajectory_sample
from asyncrl.types import Trajectory
from transfer_queue.storage.zmq import ZmqStorage


def _traj(i: int) -> Trajectory:
    p, r = 2 + i % 3, 3 + i % 4
    return Trajectory(uid=f"u{i}", group_id=f"g{i // 3}", index_in_group=i % 3, group_size=3,
                      prompt_ids=[1 + i] * p, response_ids=[10 + i] * r, behavior_logprobs=[-0.1 * (i + 1)] * r,
                      loss_mask=[1] * r, token_versions=[0] * r, min_version=0, max_version=0, reward=float(i % 2))


@pytest.mark.timeout(20)
def test_rows_of_an_unreachable_producer_become_padding_and_are_named_with_why():
    alive, gone = ZmqStorage(inline_max_bytes=0), ZmqStorage(inline_max_bytes=0)
    reader = ZmqStorage(read_timeout_s=0.5)
    try:
        trajs = [_traj(i) for i in range(6)]
        lost = {"u1", "u3"}  # not the widest rows (u5, u2): the padded widths stay those of the readable case
        samples = [trajectory_sample(gone if t.uid in lost else alive, t) for t in trajs]
        plan, _ = PlanBuilder(AlgorithmConfig(), pad_id=0, minibatches=2)([samples[:3], samples[3:]])
        plan = BatchPlan.from_bytes(plan.to_bytes())
        want, want_real, none = load_shard(plan, reader, rank=0, world=1)
        assert none == {} and want_real == [3, 3]
        address = gone.address()
        gone.close()  # the producer's process died with the bytes of u1 and u3

        parts, real, unreadable = load_shard(plan, reader, rank=0, world=1)

        assert set(unreadable) == lost
        assert all(address in why and "queue.read_timeout_s" in why for why in unreadable.values())
        assert real == [2, 2]
        order = [[r.uid for r in plan.rows[:3]], [r.uid for r in plan.rows[3:]]]
        for part, full, uids in zip(parts, want, order):
            assert part.input_ids.shape == full.input_ids.shape
            for b, uid in enumerate(uids):
                if uid in lost:  # a padding row: nothing to learn from, nothing added to the loss
                    assert part.loss_mask[b].sum() == 0 and part.advantages[b].abs().sum() == 0
                    assert full.loss_mask[b].sum() > 0
                else:
                    for f in ("input_ids", "attention_mask", "loss_mask", "old_logprobs", "advantages", "token_versions"):
                        assert torch.equal(getattr(part, f)[b], getattr(full, f)[b]), (uid, f)
    finally:
        for p in (alive, gone, reader):
            p.close()
