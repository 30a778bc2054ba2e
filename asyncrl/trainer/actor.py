"""Ray shell of the trainer: one `TrainerWorker` actor per FSDP2 rank, and `TrainerGroup` to drive them.

The worker only sets the torch.distributed environment (MASTER_ADDR / MASTER_PORT /
RANK / WORLD_SIZE) and forwards verbs to a `TrainerEngine`; all training logic lives in
`engine.py`. The group launches N workers, puts each batch into Ray's object store once
and fans every verb out to all ranks (FSDP collectives need every rank), returning rank
0's result. This is the only trainer module that imports ray.

    group = TrainerGroup(2, model_path, trainer=cfg.trainer, algorithm=cfg.algorithm)
    metrics = group.train_step(batch)           # same as TrainerEngine.train_step
    for name, tensor in group.iter_full_params(): ...
    group.close()

Not here yet: placement groups across nodes (workers go where Ray puts them; rank 0's
node hosts the rendezvous) and restarting a dead rank (a failure raises in the caller).
"""

from __future__ import annotations

import os
from typing import Any, Iterator

import ray
from torch import Tensor

from asyncrl.config import AlgorithmConfig, TrainerConfig
from asyncrl.trainer.batch import TrainBatch


class _Worker:
    """One rank. Built empty; `setup` joins the process group and loads the model."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size
        self.engine: Any = None

    def rendezvous_address(self) -> tuple[str, int]:
        from asyncrl.trainer.engine import free_port

        return ray.util.get_node_ip_address(), free_port()

    def setup(self, master_addr: str, master_port: int, model_path: str, engine_kwargs: dict[str, Any]) -> int:
        os.environ.update(
            MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), RANK=str(self.rank),
            WORLD_SIZE=str(self.world_size), LOCAL_RANK="0",  # Ray pins one GPU per actor: it is cuda:0 here
        )  # fmt: skip
        from asyncrl.trainer.engine import TrainerEngine

        self.engine = TrainerEngine(model_path, **engine_kwargs)
        return self.engine.step

    def compute_logprobs(self, batch: TrainBatch) -> Tensor:
        return self.engine.compute_logprobs(batch)

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        return self.engine.train_step(batch)

    def full_params(self) -> list[tuple[str, Tensor]] | None:
        """Every rank gathers; rank 0 returns the (name, full CPU tensor) list, the others None."""
        params = list(self.engine.iter_full_params())
        return params if self.rank == 0 else None

    def save(self, path: str) -> None:
        self.engine.save(path)

    def load(self, path: str) -> int:
        self.engine.load(path)
        return self.engine.step

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None


TrainerWorker = ray.remote(_Worker)
"""The Ray actor class of one rank (`TrainerWorker.options(num_gpus=1).remote(rank, world)`)."""


class TrainerGroup:
    """N `TrainerWorker`s acting as one trainer; every verb runs on all ranks and returns rank 0's result."""

    def __init__(
        self,
        num_ranks: int,
        model_path: str,
        *,
        trainer: TrainerConfig,
        algorithm: AlgorithmConfig,
        dtype: str = "float32",
        temperature: float = 1.0,
        seed: int = 0,
        num_cpus_per_rank: float = 1,
        num_gpus_per_rank: float = 0,
    ) -> None:
        if num_ranks < 1:
            raise ValueError(f"trainer.num_ranks: must be >= 1, got {num_ranks}")
        opts = dict(num_cpus=num_cpus_per_rank, num_gpus=num_gpus_per_rank)
        self.workers = [TrainerWorker.options(**opts).remote(r, num_ranks) for r in range(num_ranks)]
        addr, port = ray.get(self.workers[0].rendezvous_address.remote())
        kwargs = dict(trainer=trainer, algorithm=algorithm, dtype=dtype, temperature=temperature, seed=seed)
        steps = self._all("setup", addr, port, model_path, kwargs)
        self.step: int = steps[0]
        """Optimizer steps taken (the policy version), as of the last verb."""

    def _all(self, verb: str, *args: Any) -> list[Any]:
        return ray.get([getattr(w, verb).remote(*args) for w in self.workers])

    def compute_logprobs(self, batch: TrainBatch) -> Tensor:
        return self._all("compute_logprobs", ray.put(batch))[0]

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        metrics = self._all("train_step", ray.put(batch))[0]
        self.step += 1
        return metrics

    def full_params(self) -> list[tuple[str, Tensor]]:
        return self._all("full_params")[0]

    def iter_full_params(self) -> Iterator[tuple[str, Tensor]]:
        yield from self.full_params()

    def save(self, path: str) -> None:
        self._all("save", path)

    def load(self, path: str) -> None:
        self.step = self._all("load", path)[0]

    def close(self) -> None:
        """Close every engine and end the actors."""
        self._all("close")
        for w in self.workers:
            ray.kill(w)
        self.workers = []
