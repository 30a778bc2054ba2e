"""Helpers for the torch engine tests: teacher-forced reference log-probs, an engine builder."""

from __future__ import annotations

from pathlib import Path

import torch

from asyncrl.engines.torch_engine import TorchRolloutServer


def make_server(path: Path, **kwargs: object) -> TorchRolloutServer:
    kwargs.setdefault("threads", 1)
    return TorchRolloutServer(path, **kwargs)


@torch.no_grad()
def teacher_forced_logprobs(model: object, prompt: list[int], response: list[int], temperature: float) -> list[float]:
    """log_softmax(logits / T) at each response token, from one unbatched HF forward (T=0: raw logits)."""
    ids = torch.tensor([prompt + response])
    logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    if temperature > 0:
        logits = logits / temperature
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(response).unsqueeze(1)).squeeze(1).tolist()


def max_abs_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max((abs(x - y) for x, y in zip(a, b)), default=0.0)
