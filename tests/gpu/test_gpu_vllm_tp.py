"""A vLLM server with tensor_parallel_size=2 inside its Ray actor (one bundle of 2 GPUs): it starts with
the multiprocessing executor (vLLM's own choice there, its Ray executor, wants one bundle per worker)
and generates."""

from __future__ import annotations

from tests.gpu import GPU

import asyncio

import pytest
import torch

pytestmark = GPU


@pytest.mark.timeout(600)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_a_tensor_parallel_vllm_server_in_a_ray_actor_generates(tiny_model):
    pytest.importorskip("vllm")
    import ray

    from asyncrl.config import RolloutConfig
    from asyncrl.engines.base import SamplingParams
    from asyncrl.rollout.fleet import FleetManager
    from asyncrl.rollout.fleet_build import Fleet

    ray.init(num_cpus=4, num_gpus=2, include_dashboard=False, log_to_driver=False)
    try:
        cfg = RolloutConfig(backend="vllm", num_servers=1, gpu_bundles=True, tensor_parallel_size=2, gpus_per_worker=1.0,
                            gpu_memory_utilization=0.2)

        async def go():
            manager = FleetManager()
            await manager.add_fleet(await Fleet.spawn("tp", cfg, str(tiny_model), dtype="float32", seed=0))
            (server,) = manager.router.servers
            out = await server.generate([1, 5, 6, 7], SamplingParams(max_tokens=8, seed=0))
            await manager.close()
            return out

        out = asyncio.run(go())
    finally:
        ray.shutdown()
    assert len(out.token_ids) > 0 and len(out.logprobs) == len(out.token_ids)
