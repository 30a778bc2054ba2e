"""The trainer's end of the weight plane with a state dict the test chooses: a real `TrainerRank`
(real `Sender`, shm buckets) over an engine that only has parameters."""

from __future__ import annotations

from typing import Iterator

import torch

from asyncrl.trainer.calls import AsyncTrainer
from asyncrl.trainer.rank import TrainerRank
from checkpoint_engine import WeightsConfig


class StateEngine:
    """Rank 0 of 1 whose full parameters are `state` (the test sets it before each publish)."""

    rank, world, step = 0, 1, 0

    def __init__(self, state: list[tuple[str, torch.Tensor]]) -> None:
        self.state = state

    def iter_full_params(self, device: str = "cpu", borrowed: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in self.state:
            yield name, t.to(device)

    def close(self) -> None:
        pass


def weight_source(state: list[tuple[str, torch.Tensor]], backend: str = "shm") -> tuple[AsyncTrainer, StateEngine, WeightsConfig]:
    cfg = WeightsConfig(backend=backend, timeout_s=20.0, bucket_size_mb=4)
    engine = StateEngine(state)
    return AsyncTrainer(TrainerRank(engine, plane=None, weights=cfg)), engine, cfg
