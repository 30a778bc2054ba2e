"""Single-turn agent: one generation from the prompt, scored by a reward function."""

from __future__ import annotations

import time
from typing import Callable

from agents.base import AgentLoop, LLMClient, Sample, score, trajectory_from_output
from asyncrl.rollout.base import SamplingParams
from asyncrl.types import Trajectory


class SingleTurnAgent(AgentLoop):
    def __init__(
        self,
        *,
        decode: Callable[[list[int]], str],
        reward_fn: Callable[..., object],
        sampling: SamplingParams,
        reward_timeout_s: float = 10.0,
    ) -> None:
        self.decode, self.reward_fn, self.sampling, self.reward_timeout_s = decode, reward_fn, sampling, reward_timeout_s

    async def run(self, sample: Sample, llm: LLMClient) -> Trajectory:
        t0 = time.time()
        out = await llm.generate(sample.prompt_ids, self.sampling, session_id=sample.uid)
        traj = trajectory_from_output(sample, out, t0)
        t1 = time.time()
        traj.reward, traj.reward_info = await score(
            self.reward_fn, self.decode(out.token_ids), sample.answer, self.reward_timeout_s
        )
        traj.timings["reward"] = time.time() - t1
        return traj
