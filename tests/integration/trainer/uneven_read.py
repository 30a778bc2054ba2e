"""Run under torchrun with 2 ranks (tests/integration/trainer/test_fsdp_equivalence.py): after a probe
forward, rank 0 reads its shards (a receiver to send to) and rank 1 does not; the end of a publish
(`TrainerEngine.reshard`) must leave both alike, so the next forward's all-gathers match."""

import sys

from asyncrl.config import AlgorithmConfig, TrainerConfig
from asyncrl.trainer.engine import TrainerEngine

engine = TrainerEngine(sys.argv[1], trainer=TrainerConfig(total_steps=1), algorithm=AlgorithmConfig())
probe = [1, 5, 6, 7, 8]
first = engine.score_tokens(probe)
if engine.rank == 0:
    sum(t.numel() for _, t, _, _ in engine.iter_local_shards())  # FSDP's state_dict: the root unit resharded here only
engine.reshard()
second = engine.score_tokens(probe)
assert max(abs(a - b) for a, b in zip(first, second)) < 1e-6, (first, second)
print(f"rank {engine.rank}: probe scored again after an uneven read", flush=True)
engine.close()
