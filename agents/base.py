"""What one rollout is: the AgentLoop API and the LLM client it talks to.

An AgentLoop turns one `Sample` (a prompt of a group) into one `Trajectory` by calling
an `LLMClient` (token ids in; token ids, per-token log-probs and versions out) and
scoring the result. It never sees Ray, queues or weights: the rollouter gives it a
client bound to the fleet. Rewards run through `score`, which turns an exception or a
timeout into a marked failure (reward 0, `reward_info["failed"]`), never a crash.
"""

from __future__ import annotations

import abc
import asyncio
import inspect
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from asyncrl.rollout.base import GenerateOutput, SamplingParams
from asyncrl.types import Trajectory


class LLMClient(Protocol):
    async def generate(
        self, prompt_ids: list[int], sampling: SamplingParams, session_id: str | None = None
    ) -> GenerateOutput: ...


@dataclass
class Sample:
    """One member of a GRPO group, as handed to an AgentLoop."""

    uid: str
    group_id: str
    index_in_group: int
    group_size: int
    prompt_ids: list[int]
    answer: str
    """Reference answer for the reward function."""
    meta: dict[str, Any] = field(default_factory=dict)


async def score(
    fn: Callable[..., Any], response: str, answer: str, timeout_s: float
) -> tuple[float, dict[str, Any]]:
    """Run a reward function with a timeout; failures give (0.0, {"failed": cause}).

    A coroutine function (e.g. one that runs tests in the sandbox) is awaited and cancelled at
    the timeout; a plain function runs in a worker thread (a hung one keeps its thread).
    """
    try:
        if _is_async(fn):
            out = await asyncio.wait_for(fn(response, answer), timeout_s)
        else:
            out = await asyncio.wait_for(asyncio.to_thread(fn, response, answer), timeout_s)
    except asyncio.TimeoutError:
        return 0.0, {"failed": "timeout"}
    except Exception as e:  # a user's reward function: translate any error into a counted failure
        return 0.0, {"failed": f"{type(e).__name__}: {e}"[:200]}
    reward, info = out if isinstance(out, tuple) else (out, {})
    reward = float(reward)
    if reward != reward:  # NaN
        return 0.0, {"failed": "nan"}
    return reward, dict(info)


def _is_async(fn: Callable[..., Any]) -> bool:
    """Coroutine functions, partials of them, and objects with an `async __call__`."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


class AgentLoop(abc.ABC):
    """`async run(sample, llm) -> Trajectory`; subclasses get their settings by keyword."""

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
