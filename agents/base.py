"""What one rollout is: the AgentLoop API and the LLM client it talks to.

An AgentLoop turns one `Sample` (a prompt of a group) into one `Trajectory` by calling
an `LLMClient` (token ids in; token ids, per-token log-probs and versions out) and
scoring the result through a `Scorer` (`scoring.py`: rewards are user code, run in a
bounded pool of their own, validated, and stopped after too many failures in a row).
It never sees Ray, queues or weights: the rollouter gives it a client bound to the fleet.
"""

from __future__ import annotations

import abc
import time
from typing import Protocol

from asyncrl.engines.base import GenerateOutput, SamplingParams
from asyncrl.engines.sample import Sample
from asyncrl.types import Trajectory

__all__ = ["AgentLoop", "LLMClient", "trajectory_from_output"]


class LLMClient(Protocol):
    async def generate(
        self, prompt_ids: list[int], sampling: SamplingParams, session_id: str | None = None
    ) -> GenerateOutput: ...


class AgentLoop(abc.ABC):
    """`async run(sample, llm) -> Trajectory`; subclasses get their settings by keyword.
    `RewardBroken` raised while scoring must propagate out of `run`."""

    @abc.abstractmethod
    async def run(self, sample: Sample, llm: LLMClient) -> Trajectory: ...


def trajectory_from_output(sample: Sample, out: GenerateOutput, t0: float) -> Trajectory:
    versions = out.versions or [0]
    return Trajectory(
        uid=sample.uid,
        group_id=sample.group_id,
        index_in_group=sample.index_in_group,
        group_size=sample.group_size,
        prompt_ids=list(sample.prompt_ids),
        response_ids=list(out.token_ids),
        behavior_logprobs=list(out.logprobs),
        loss_mask=[1] * len(out.token_ids),
        token_versions=list(out.versions),
        min_version=min(versions),
        max_version=max(versions),
        finish_reason=out.finish_reason,
        meta=dict(sample.meta),
        timings={"created": t0, "generate": time.time() - t0},
    )
