"""Groups of queue records -> the trainer's `BatchPlan`: advantages from the registry, handles passed on.

The controller's whole share of a batch: one advantage per trajectory, computed from the
rewards and group ids the records carry, and the reward itself; the tensors stay where they were
written and each trainer rank reads its own rows (`asyncrl.trainer.plan`). A token-level
estimator (`gae`) needs the critic's values, so the ranks compute it from the rewards.
"""


from __future__ import annotations

from typing import Any

from asyncrl.config import AlgorithmConfig
from asyncrl.trainer.advantages import advantage_spec
from asyncrl.trainer.plan import BatchPlan, plan_rows
from asyncrl.trajectory_queue import generated_tokens, reward



class PlanBuilder:
    def __init__(self, algorithm: AlgorithmConfig, pad_id: int, minibatches: int = 1) -> None:
        self.algorithm, self.pad_id, self.minibatches = algorithm, pad_id, minibatches

    def __call__(self, groups: list[list[Any]]) -> tuple[BatchPlan, int]:
        """(BatchPlan, number of trained tokens) of `groups` (lists of `SampleMeta`, group order)."""
        from asyncrl.trainer.advantages import compute_advantages

        samples = [s for g in groups for s in g]
        rewards = [reward(s) for s in samples]
        if advantage_spec(self.algorithm.advantage).needs_critic:  # GAE: computed on the ranks with the critic's values
            adv = [0.0] * len(samples)
        else:
            adv = compute_advantages(self.algorithm.advantage, rewards, [s.group_id for s in samples],
                                     norm_by_std=self.algorithm.norm_adv_by_std)
        plan = BatchPlan(plan_rows(samples, adv, rewards), pad_id=self.pad_id, minibatches=self.minibatches)
        return plan, sum(generated_tokens(s) for s in samples)
