"""TrainBatch: layout of trajectories, alignment, shards and micro-batches."""

import pytest
import torch

from asyncrl.trainer.batch import TrainBatch
from asyncrl.types import Trajectory


def traj(uid, prompt, resp, lps, mask, reward=0.0):
    return Trajectory(
        uid=uid, group_id="g", index_in_group=0, group_size=1, prompt_ids=prompt, response_ids=resp,
        behavior_logprobs=lps, loss_mask=mask, token_versions=[0] * len(resp), min_version=0, max_version=0, reward=reward,
    )  # fmt: skip


def make_batch():
    return TrainBatch.from_trajectories(
        [
            traj("a", [5, 6], [7, 8, 9], [-0.1, -0.2, -0.3], [1, 0, 1]),
            traj("b", [5, 6, 7, 8], [9], [-0.5], [1]),
            traj("c", [4], [3, 2], [-1.0, -2.0], [1, 1]),
        ],
        advantages=[1.5, -2.0, 0.25],
        pad_id=0,
    )


def test_from_trajectories_layout_and_alignment():
    b = make_batch()
    assert b.input_ids.tolist() == [[5, 6, 7, 8, 9], [5, 6, 7, 8, 9], [4, 3, 2, 0, 0]]
    assert b.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]
    # response token i of a P-token prompt sits at column P + i; tool token (mask 0) is not trained on
    assert b.loss_mask.tolist() == [[0, 0, 1, 0, 1], [0, 0, 0, 0, 1], [0, 1, 1, 0, 0]]
    assert torch.allclose(b.old_logprobs[0], torch.tensor([0, 0, -0.1, 0.0, -0.3]))
    assert torch.allclose(b.old_logprobs[2], torch.tensor([0, -1.0, -2.0, 0, 0]))
    assert b.advantages[0].tolist() == [0, 0, 1.5, 1.5, 1.5]
    assert b.advantages[1].tolist() == [0, 0, 0, 0, -2.0]
    assert len(b) == 3 and b.num_tokens == 5.0 and b.ref_logprobs is None


def test_from_trajectories_rejects_mismatch():
    with pytest.raises(ValueError, match="advantages"):
        TrainBatch.from_trajectories([traj("a", [1], [2], [-1.0], [1])], advantages=[], pad_id=0)
    with pytest.raises(ValueError, match="shape"):
        TrainBatch(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 2), torch.zeros(2, 3))


def test_shard_pads_short_rank_with_masked_copies():
    b = make_batch()  # 5, 5 and 3 tokens: spread by tokens, rank 0 takes rows 0 and 2, rank 1 row 1 and a padding row
    assert b.shard_rows(2) == [[0, 2], [1]]
    s0, s1 = b.shard(0, 2), b.shard(1, 2)
    assert len(s0) == len(s1) == 2
    assert torch.equal(s0.input_ids, b.input_ids[[0, 2]])
    assert torch.equal(s1.input_ids[0], b.input_ids[1])
    assert s1.loss_mask[1].sum() == 0 and s1.advantages[1].abs().sum() == 0  # padding row adds nothing
    assert s0.num_tokens + s1.num_tokens == b.num_tokens
    assert torch.equal(b.shard(0, 1).input_ids, b.input_ids)


def test_micro_batches_trim_padding_columns_and_slice():
    b = make_batch()
    mbs = b.micro_batches(2)
    assert [len(m) for m in mbs] == [2, 1]
    assert mbs[1].input_ids.tolist() == [[4, 3, 2]]  # trailing all-pad columns dropped
    assert b[1:2].old_logprobs[0, 4].item() == pytest.approx(-0.5)
    assert b.to("cpu").input_ids.dtype == torch.long


def test_a_long_tail_batch_is_spread_by_tokens_not_by_count():
    from asyncrl.trainer.spread import spread

    lengths = [2000, 1800, 40, 30, 35, 20, 25, 30]  # group order: the long rows come first
    by_count = [sum(lengths[:4]), sum(lengths[4:])]
    ranks = spread(lengths, 2)
    loads = [sum(lengths[i] for i in r) for r in ranks]
    assert sorted(i for r in ranks for i in r) == list(range(8)) and all(len(r) == 4 for r in ranks)
    assert max(loads) < 0.6 * max(by_count), (loads, by_count)  # 3870 | 110 by count
    assert spread(lengths, 2) == ranks  # every rank computes the same
    assert spread([], 3) == [[], [], []] and spread([7], 3) == [[0], [], []]
