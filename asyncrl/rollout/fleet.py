"""Factory of rollout servers from `RolloutConfig` (one place that knows the backends)."""

from __future__ import annotations

from asyncrl.config import RolloutConfig
from asyncrl.rollout.base import RolloutServer


def build_server(cfg: RolloutConfig, model_path: str, *, dtype: str, seed: int, index: int = 0) -> RolloutServer:
    if cfg.backend == "torch":
        from asyncrl.rollout.torch_engine import TorchRolloutServer

        return TorchRolloutServer(
            model_path,
            dtype=dtype,
            max_batch_size=cfg.max_batch_size,
            seed=seed + index,
            threads=cfg.torch_threads,
            prefix_cache_size=cfg.prefix_cache_size,
        )
    if cfg.backend == "vllm":
        from asyncrl.rollout.vllm_engine import VLLMRolloutServer

        return VLLMRolloutServer(
            model_path,
            dtype=dtype,
            seed=seed + index,
            enforce_eager=cfg.enforce_eager,
            gpu_memory_utilization=cfg.gpu_memory_utilization,
            cpu_kv_cache_gb=cfg.cpu_kv_cache_gb,
            tensor_parallel_size=cfg.tensor_parallel_size,
        )
    raise ValueError(f"rollout.backend: unknown backend {cfg.backend!r}")


def build_fleet(cfg: RolloutConfig, model_path: str, *, dtype: str, seed: int) -> list[RolloutServer]:
    return [build_server(cfg, model_path, dtype=dtype, seed=seed, index=i) for i in range(cfg.num_servers)]
