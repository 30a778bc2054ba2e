"""Reward shaping of finished samples on the rollout side: DAPO's overlong penalty on queue records.

Job: turn the reward a sample's reward function gave into the reward the trainer sees, before the
group is queued, where a record's reward and response length are both known (the `Rollouter`,
for every agent and every fleet: hosts in this process or Ray actors). The record keeps both
numbers: `reward_info["score"]` (unshaped) and `reward_info["overlong_penalty"]`, so logs show
what the policy earned and what its length cost. The penalty itself is the pure function
`asyncrl.trainer.advantages.overlong_penalty` (imported when first used: it lives beside torch).

Boundary: no reward function runs here and no tensor is read; a failed reward (`reward_info["failed"]`)
is left as it is (0 by convention, not a score to shape). Held-out evaluation is never shaped.

    shaping = OverlongShaping.from_config(cfg)      # None when agent.overlong_buffer_len is 0
    shaping.apply(record)                           # meta["reward"] 1.0, 8 of 10 tokens, buffer 4 -> 0.5
    overlong_metrics(batch_records)                 # {"rollout/overlong_penalty": ..., "rollout/overlong_penalised": ...}
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from asyncrl.config.checks import check, max_response_length


@dataclass(frozen=True)
class OverlongShaping:
    """DAPO overlong shaping of queue records: `reward += overlong_penalty(len(response), ...)`."""

    buffer_len: int
    """`agent.overlong_buffer_len`: the penalty starts this many tokens before `max_response_length`."""
    max_response_length: int
    """`rollout.max_tokens` (or the tool agent's `agent.kwargs.max_response_tokens`)."""
    penalty_factor: float = 1.0
    """`agent.overlong_penalty_factor`: the penalty at `max_response_length`."""

    def __post_init__(self) -> None:
        check(0 < self.buffer_len < self.max_response_length, "agent.overlong_buffer_len",
              f"must be in (0, {self.max_response_length}) (the max response length), got {self.buffer_len}")

    @classmethod
    def from_config(cls, cfg: Any) -> "OverlongShaping | None":
        if not cfg.agent.overlong_buffer_len:
            return None
        return cls(cfg.agent.overlong_buffer_len, max_response_length(cfg)[0], cfg.agent.overlong_penalty_factor)

    def penalty(self, response_length: int) -> float:
        from asyncrl.trainer.advantages import overlong_penalty

        return overlong_penalty(response_length, max_response_length=self.max_response_length,
                                buffer_len=self.buffer_len, penalty_factor=self.penalty_factor)

    def apply(self, record: Any) -> None:
        """Shape one queue record's reward in place (a failed reward is left alone)."""
        from asyncrl.trajectory_queue import response_length

        meta = record.meta
        if "failed" in meta["reward_info"]:
            return
        score = float(meta["reward"])
        p = self.penalty(response_length(record))
        meta["reward_info"] = {**meta["reward_info"], "score": score, "overlong_penalty": p}
        meta["reward"] = score + p


def overlong_metrics(records: Sequence[Any]) -> dict[str, float]:
    """Per-step metrics of a batch's shaping: the mean penalty and the fraction of samples penalised
    (over the records that were shaped); empty when none was (shaping off)."""
    pens = [float(r.meta["reward_info"]["overlong_penalty"]) for r in records if "overlong_penalty" in r.meta["reward_info"]]
    if not pens:
        return {}
    return {"rollout/overlong_penalty": sum(pens) / len(pens), "rollout/overlong_penalised": sum(p < 0 for p in pens) / len(pens)}
