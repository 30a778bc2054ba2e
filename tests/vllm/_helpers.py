"""Helpers for the vLLM backend tests: run a coroutine on the module loop, HF reference log-probs."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, Coroutine


def run(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, Any], timeout: float = 60.0) -> Any:
    return loop.run_until_complete(asyncio.wait_for(coro, timeout))


class HFReference:
    """Teacher-forced fp32 HF forward: log-softmax(logits / T) at each response token."""

    def __init__(self, path: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    def logprobs(self, prompt: list[int], response: list[int], temperature: float = 1.0) -> list[float]:
        import torch

        ids = torch.tensor([prompt + response])
        with torch.no_grad():
            logits = self.model(ids).logits[0, len(prompt) - 1 : -1].float()
        lp = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
        return lp.gather(-1, torch.tensor(response)[:, None])[:, 0].tolist()

    def state_dict(self) -> dict[str, Any]:
        return dict(self.model.state_dict())


def max_gap(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max((abs(x - y) for x, y in zip(a, b)), default=0.0)


async def until(cond: Any, timeout: float = 30.0) -> None:
    """Poll `cond()` on the event loop until it holds."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError("condition not reached")
        await asyncio.sleep(0.002)
