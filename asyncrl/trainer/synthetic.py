"""Test support: a synthetic `TrainBatch` and the full (unsharded) gradients of an engine.

Job: the batch the trainer's tests, the FSDP2 equivalence harness (tests/integration/trainer/smoke.py)
and `asyncrl bench trainer` train on. Boundary: builds data, runs nothing; no torchrun, no process group.
"""

from __future__ import annotations

import random

import torch

from asyncrl.trainer.batch import TrainBatch
from asyncrl.types import Trajectory


def synthetic_batch(num_seqs: int, *, vocab_size: int, seed: int = 0, pad_id: int = 0, groups_of: int = 4) -> TrainBatch:
    """Random prompts/responses of varied lengths, a tool span in some responses, random behavior log-probs and rewards."""
    from asyncrl.trainer.advantages import compute_advantages

    rng = random.Random(seed)
    trajs = []
    for i in range(num_seqs):
        p, r = rng.randint(2, 6), rng.randint(1, 8)
        mask = [1] * r
        if r > 3 and rng.random() < 0.5:  # a tool/env span the policy did not write
            mask[1:3] = [0, 0]
        trajs.append(
            Trajectory(
                uid=f"s{i}", group_id=f"g{i // groups_of}", index_in_group=i % groups_of, group_size=groups_of,
                prompt_ids=[rng.randrange(1, vocab_size) for _ in range(p)],
                response_ids=[rng.randrange(1, vocab_size) for _ in range(r)],
                behavior_logprobs=[-rng.uniform(3.5, 5.5) * m for m in mask],
                loss_mask=mask, token_versions=[0 if m else -1 for m in mask], min_version=0, max_version=0,
                reward=float(rng.random() < 0.5),
            )
        )  # fmt: skip
    adv = compute_advantages("grpo", [t.reward for t in trajs], [t.group_id for t in trajs])
    return TrainBatch.from_trajectories(trajs, adv, pad_id=pad_id)


def full_grads(engine) -> dict[str, torch.Tensor]:  # noqa: ANN001 - TrainerEngine, imported lazily
    """Unsharded gradients by parameter name (collective)."""
    out = {}
    for name, p in engine.model.named_parameters():
        g = p.grad
        out[name] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().cpu().clone()
    return out
