"""Groups of trajectories -> the trainer's `TrainBatch`: advantages from the registry, then padding."""

from __future__ import annotations

from typing import Any

from asyncrl.config import AlgorithmConfig
from asyncrl.types import Trajectory


class BatchBuilder:
    def __init__(self, algorithm: AlgorithmConfig, pad_id: int) -> None:
        self.algorithm, self.pad_id = algorithm, pad_id

    def __call__(self, groups: list[list[Trajectory]]) -> tuple[Any, int]:
        """(TrainBatch, number of trained tokens)."""
        from asyncrl.trainer.advantages import compute_advantages
        from asyncrl.trainer.batch import TrainBatch

        trajs = [t for g in groups for t in g]
        adv = compute_advantages(
            self.algorithm.advantage,
            [t.reward for t in trajs],
            [t.group_id for t in trajs],
            norm_by_std=self.algorithm.norm_adv_by_std,
        )
        batch = TrainBatch.from_trajectories(trajs, adv, pad_id=self.pad_id)
        return batch, sum(t.num_generated_tokens for t in trajs)
