"""The GPU path of a fleet: vLLM server actors on GPU bundles (`rollout.gpu_bundles`), a weight
update in abort mode joined into one response. Needs a CUDA GPU and vllm."""

from __future__ import annotations

import asyncio

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.vllm,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_vllm_fleet_on_gpu_bundles_partial_rollout(tiny_model, tiny_model_b):
    pytest.importorskip("vllm")
    import ray
    from safetensors.torch import load_file

    from asyncrl.config import RolloutConfig
    from asyncrl.engines.base import SamplingParams
    from asyncrl.rollout.fleet import FleetManager
    from asyncrl.rollout.fleet_build import Fleet
    from asyncrl.rollout.router import Router
    from tests.integration.fleet.weights import weight_source

    cfg = RolloutConfig(backend="vllm", num_servers=1, gpu_bundles=True, tensor_parallel_size=1, gpu_memory_utilization=0.3)
    ray.init(num_cpus=4, num_gpus=torch.cuda.device_count(), include_dashboard=False, log_to_driver=False)
    try:
        async def go():
            manager = FleetManager(Router())
            await manager.add_fleet(await Fleet.spawn("gpu", cfg, str(tiny_model), dtype="float32", seed=0))
            trainer, _, wcfg = weight_source(list(load_file(str(tiny_model_b / "model.safetensors")).items()))
            await manager.attach_weights(trainer, wcfg, pause_mode="abort")
            (server,) = manager.router.servers
            t = asyncio.create_task(manager.router.generate([4, 5], SamplingParams(temperature=0.0, max_tokens=400)))
            while (await server.refresh()).generated_tokens < 20:
                await asyncio.sleep(0.01)
            await manager.publish(1)  # the actor's receiver: shm buckets -> the vLLM worker
            out = await t
            stats = await manager.stats()
            await manager.close()
            trainer.impl.close()
            return out, stats

        out, stats = asyncio.run(go())
    finally:
        ray.shutdown()
    assert 0 in out.versions and out.versions[-1] == 1 and len(out.token_ids) == len(out.versions)
    assert stats["fleets"]["gpu"]["servers"][0]["version"] == 1
