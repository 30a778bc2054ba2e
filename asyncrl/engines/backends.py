"""`build_server`: the one place that knows the rollout backends (torch, vllm, openai, cost_model).

Job: turn a `RolloutConfig` and a model folder into one `RolloutServer`, importing the backend's
module only when it is chosen. Boundary: builds, never starts or places: local fleets are
fleet_build.py's, Ray actors server_actor.py's (both call this, neither is called back).
"""

from __future__ import annotations

import os

from asyncrl.config import RolloutConfig
from asyncrl.rollout.base import RolloutServer


def build_server(cfg: RolloutConfig, model_path: str, *, dtype: str, seed: int, index: int = 0,
                 log_dir: str | None = None) -> RolloutServer:
    """Server `index` of a fleet of `cfg.backend`. `log_dir` (the run directory) receives engine
    logs that would otherwise flood the console (vLLM: `vllm.log`)."""
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
            log_path=os.path.join(log_dir, "vllm.log") if log_dir else None,
        )
    if cfg.backend == "openai":  # one server per URL; the config requires external_weights=frozen
        from asyncrl.rollout.openai_server import OpenAIRolloutServer

        return OpenAIRolloutServer(cfg.server_urls[index], timeout_s=cfg.request_timeout_s)
    if cfg.backend == "cost_model":
        from asyncrl.rollout.cost_model import CostModelServer, LongTail

        c = cfg.cost_model
        return CostModelServer(token_cost_s=c.token_cost_s, max_concurrency=c.max_concurrency, seed=seed + index,
                               lengths=LongTail(c.short_tokens, c.long_fraction, c.long_factor, c.jitter),
                               update_cost_s=c.update_cost_s)
    raise ValueError(f"rollout.backend: unknown backend {cfg.backend!r}")
