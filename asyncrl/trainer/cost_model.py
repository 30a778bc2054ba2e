"""`trainer.engine=cost_model`: the trainer's step as a cost in wall time, everything else real.

Job: measure the pipeline (admission, the data plane, the weight plane, the controller) without
paying for forward/backward passes. A step reads its shard from the data plane like a real one
(`TrainerRank.train`), then sleeps `cost_per_token_s` per loss token of this rank's rows, so the
trainer's ranks train `world / cost_per_token_s` tokens/s. `CostModelEngine` loads and shards the real
model, so publishing sends its real weights (real sizes, real FSDP all-gathers); `TimedEngine`
has no model at all (one small tensor to publish) for in-process schedule benchmarks
(`asyncrl bench pipeline`).

What it does not model: compute that grows with sequence length squared, memory limits, and
the optimizer's own time.
"""

from __future__ import annotations

import time
from typing import Any, Iterator

import torch

from asyncrl.trainer.batch import along_lineage, mask_stale_tokens, token_age_metrics
from asyncrl.trainer.engine import TrainerEngine


class _Timed:
    """The step shared by both engines: `steps` records (start, end, tokens) of every one."""

    cost_per_token_s: float
    rank: int
    world: int
    step: int
    steps: list[tuple[float, float, int]]

    schedule: list[tuple[int, float]] = []
    """(from step, seconds per token), in step order (`trainer.cost_model_schedule`)."""
    eta: int = 0
    token_level: bool = False
    """`trainer.staleness_level=token`: tokens older than `eta` are masked as a real step masks them (and not paid for)."""

    def train_local(self, parts: list[Any], real_rows: list[int], version: int = -1,
                    lineage: list[list[int]] | None = None) -> dict[str, float]:
        t0 = time.monotonic()
        version = self.step if version < 0 else version
        parts, age = mask_stale_tokens(along_lineage(parts, version, lineage or []), version, self.eta, self.token_level)
        tokens = int(sum(p.num_tokens for p in parts))
        cost = next((c for at, c in reversed(self.schedule) if self.step >= at), self.cost_per_token_s)
        time.sleep(tokens * cost)
        total = self._all_tokens(tokens)
        self.step += 1
        self.steps.append((t0, time.monotonic(), tokens))
        seqs = sum(int((p.loss_mask > 0).any(dim=1).sum()) for p in parts)  # rows with a loss token, as the engine counts
        return {"loss": 0.0, "tokens": float(total), "seqs": float(seqs), **token_age_metrics(age)}

    def _all_tokens(self, tokens: int) -> int:
        return tokens


class CostModelEngine(_Timed, TrainerEngine):
    """A `TrainerEngine` (real sharded model, checkpoints, `iter_full_params`) whose step is a sleep."""

    def __init__(self, model_path: str, *, cost_per_token_s: float, **kw: Any) -> None:
        TrainerEngine.__init__(self, model_path, **kw)
        self.cost_per_token_s = cost_per_token_s
        self.eta, self.token_level = self.trainer.eta, self.trainer.staleness_level == "token"
        self.schedule = sorted((int(at), float(c)) for at, c in self.trainer.cost_model_schedule)
        self.steps = []

    def _all_tokens(self, tokens: int) -> int:
        if self.world == 1:
            return tokens
        import torch.distributed as dist

        t = torch.tensor([tokens], dtype=torch.float64, device=self.device)
        dist.all_reduce(t)  # also the step's barrier, as a real step's collectives are
        return int(t.item())


class TimedEngine(_Timed):
    """No model: one rank of one, a single small tensor to publish (`w`)."""

    def __init__(self, cost_per_token_s: float) -> None:
        self.cost_per_token_s = cost_per_token_s
        self.rank, self.world, self.step = 0, 1, 0
        self.steps = []
        self._param = torch.zeros(256)

    def iter_full_params(self, device: str | torch.device = "cpu", borrowed: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        yield "w", self._param.to(device)

    def save(self, path: str) -> None:
        return None

    def load(self, path: str) -> None:
        return None

    def close(self) -> None:
        return None
