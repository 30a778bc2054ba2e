"""Single-turn agent: one generation from the prompt, scored by a reward function.

The reward runs through `agents.scoring.Scorer` (its own thread pool, a timeout, validated
return values); `RewardBroken` (too many failures in a row) propagates out of `run`.
"""

from __future__ import annotations

import time
from typing import Callable

from agents.base import AgentLoop, LLMClient, trajectory_from_output
from agents.scoring import Scorer
from asyncrl.engines.base import SamplingParams
from asyncrl.engines.sample import Sample
from asyncrl.types import Trajectory


class SingleTurnAgent(AgentLoop):
    """Args: `reward_timeout_s`, `reward_workers`, `max_reward_failures` are the `agent.*` keys of the
    same names; `reward_name` names the reward in errors (default: its `module:qualname`)."""

    def __init__(
        self,
        *,
        decode: Callable[[list[int]], str],
        reward_fn: Callable[..., object],
        sampling: SamplingParams,
        reward_timeout_s: float = 10.0,
        reward_workers: int = 4,
        max_reward_failures: int = 100,
        reward_name: str | None = None,
    ) -> None:
        self.decode, self.reward_fn, self.sampling, self.reward_timeout_s = decode, reward_fn, sampling, reward_timeout_s
        self.scorer = Scorer(reward_fn, name=reward_name, timeout_s=reward_timeout_s, max_failures=max_reward_failures,
                             workers=reward_workers)

    async def run(self, sample: Sample, llm: LLMClient) -> Trajectory:
        t0 = time.time()
        out = await llm.generate(sample.prompt_ids, self.sampling, session_id=sample.uid)
        traj = trajectory_from_output(sample, out, t0)
        t1 = time.time()
        traj.reward, traj.reward_info = await self.scorer(self.decode(out.token_ids), sample.answer)
        traj.timings["reward"] = time.time() - t1
        return traj
