"""An asyncrl Trajectory travels as a generic record: scalars in `meta`, per-token arrays as tensors."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from asyncrl.types import Trajectory
from transfer_queue import Record, TransferQueueConfig, connect

_ARRAYS = {"prompt_ids": np.int32, "response_ids": np.int32, "behavior_logprobs": np.float32,
           "loss_mask": np.int8, "token_versions": np.int32}


def _to_record(t: Trajectory) -> Record:
    meta = {f.name: getattr(t, f.name) for f in dataclasses.fields(t) if f.name not in _ARRAYS}
    return Record(t.uid, t.group_id, t.group_size, t.min_version, meta,
                  {k: np.asarray(getattr(t, k), dtype=d) for k, d in _ARRAYS.items()})


@pytest.mark.timeout(20)
def test_trajectory_roundtrip_through_shm(tmp_path):
    q = connect(TransferQueueConfig(storage="shm", shm_dir=str(tmp_path), capacity=8))
    n = 600
    trajs = [Trajectory(uid=f"t{i}", group_id="p0", index_in_group=i, group_size=2, prompt_ids=[1, 2, 3],
                        response_ids=list(range(n)), behavior_logprobs=[-0.5] * n, loss_mask=[1] * n,
                        token_versions=[4] * n, min_version=4, max_version=4, reward=float(i),
                        reward_info={"acc": 1.0}).validate() for i in range(2)]
    q.put([_to_record(t) for t in trajs])
    b = q.get("trainer", num_groups=1, group_size=2, max_staleness=1, current_version=5, timeout=2)
    back = []
    for s, tensors in zip(b.samples, q.fetch(b, as_torch=False)):
        back.append(Trajectory(**s.meta, **{k: v.tolist() for k, v in tensors.items()}).validate())
    assert sorted(back, key=lambda t: t.uid) == trajs
    assert q.ack(b) == 2
