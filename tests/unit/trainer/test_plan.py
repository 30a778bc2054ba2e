"""BatchPlan: a rank reads its rows of every mini-batch from the data plane, and gets exactly the rows
(and tensors) the full-batch path (`TrainerEngine.train_step`: `TrainBatch.shard` of each mini-batch)
gives it; padding rows carry no loss. The plan survives its wire form."""

import random

import numpy as np
import pytest
import torch

from asyncrl.batching import PlanBuilder
from asyncrl.config import AlgorithmConfig
from asyncrl.trainer.batch import TrainBatch
from asyncrl.trainer.plan import BatchPlan, load_shard, minibatch_slices
from asyncrl.trajectory_queue import trajectory_sample
from asyncrl.types import Trajectory
from transfer_queue.storage.local import LocalStorage


def _trajs(n, seed=0):
    rng = random.Random(seed)
    out = []
    for i in range(n):
        p, r = rng.randint(1, 5), rng.randint(0, 7)
        mask = [int(rng.random() > 0.2) for _ in range(r)]
        out.append(Trajectory(uid=f"u{i}", group_id=f"g{i // 3}", index_in_group=i % 3, group_size=3,
                              prompt_ids=[rng.randrange(1, 50) for _ in range(p)],
                              response_ids=[rng.randrange(1, 50) for _ in range(r)],
                              behavior_logprobs=[-rng.random() for _ in range(r)], loss_mask=mask,
                              token_versions=[rng.randrange(0, 3) if m else -1 for m in mask], min_version=0, max_version=2,
                              reward=float(rng.random() > 0.5)))
    return out


@pytest.mark.parametrize("rows, minibatches, world", [(9, 1, 1), (9, 2, 2), (10, 4, 3), (5, 4, 4), (3, 1, 4)])
def test_rank_shards_match_the_full_batch_split(rows, minibatches, world):
    plane = LocalStorage(inline_max_bytes=0)
    trajs = _trajs(rows)
    groups = [[trajectory_sample(plane, t) for t in trajs[i:i + 3]] for i in range(0, rows, 3)]
    plan, tokens = PlanBuilder(AlgorithmConfig(), pad_id=0, minibatches=minibatches)(groups)
    assert tokens == sum(sum(t.loss_mask) for t in trajs)
    plan = BatchPlan.from_bytes(plan.to_bytes())  # what crosses to the ranks
    full = TrainBatch.from_trajectories(trajs, [r.advantage for r in plan.rows], pad_id=0)
    real_total = 0
    for rank in range(world):
        parts, real, unreadable = load_shard(plan, plane, rank, world)
        assert unreadable == {}
        assert len(parts) == len(minibatch_slices(rows, minibatches))
        for part, n_real, mb in zip(parts, real, minibatch_slices(rows, minibatches)):
            want = full[mb].shard(rank, world).trim()
            per = -(-(mb.stop - mb.start) // world)
            assert n_real == len(full[mb].shard_rows(world)[rank]) and len(part) == per  # the same rows, spread by tokens
            got = part.trim()
            for f in ("loss_mask", "old_logprobs", "advantages", "token_versions"):
                a, b = getattr(got, f)[:n_real], getattr(want, f)[:n_real]
                w = min(a.shape[1], b.shape[1])
                assert torch.equal(a[:, :w], b[:, :w]), f
                assert not a[:, w:].any() and not (b[:, w:] != (-1 if f == "token_versions" else 0)).any()
            real_ids = got.input_ids[:n_real] * got.attention_mask[:n_real]
            want_ids = want.input_ids[:n_real] * want.attention_mask[:n_real]
            w = min(real_ids.shape[1], want_ids.shape[1])
            assert torch.equal(real_ids[:, :w], want_ids[:, :w])
            assert got.loss_mask[n_real:].sum() == 0 and got.advantages[n_real:].abs().sum() == 0  # padding is inert
            real_total += n_real
    assert real_total == rows


def test_from_arrays_rejects_inconsistent_rows():
    good = {"prompt_ids": np.array([1, 2], np.int32), "response_ids": np.array([3], np.int32),
            "behavior_logprobs": np.array([-0.1], np.float32), "loss_mask": np.array([1], np.int8),
            "token_versions": np.array([0], np.int32)}
    TrainBatch.from_arrays([good, None], [1.0, 0.0], pad_id=0)
    with pytest.raises(ValueError, match="len\\(loss_mask\\)"):
        TrainBatch.from_arrays([dict(good, loss_mask=np.array([1, 1], np.int8))], [1.0], pad_id=0)
    with pytest.raises(ValueError, match="empty prompt"):
        TrainBatch.from_arrays([dict(good, prompt_ids=np.array([], np.int32))], [1.0], pad_id=0)
