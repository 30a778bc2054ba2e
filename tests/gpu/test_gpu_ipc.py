"""A CUDA-IPC publish on one GPU: a trainer rank (Ray actor, half the GPU) sends its weights to a
vLLM server (another actor, the other half) through CUDA IPC handles; the server's worker copies
them out of the trainer's GPU buckets. The server then scores tokens as the trainer does."""

from __future__ import annotations

from tests.gpu import GPU

import asyncio

import pytest


pytestmark = GPU

def test_cuda_ipc_publish_trainer_to_server_on_one_gpu(tiny_model):
    pytest.importorskip("vllm")
    import ray

    from asyncrl.config import AlgorithmConfig, RolloutConfig, TrainerConfig
    from asyncrl.engines.base import SamplingParams
    from asyncrl.rollout.fleet import FleetManager
    from asyncrl.rollout.fleet_build import Fleet
    from asyncrl.trainer.actor import TrainerGroup
    from asyncrl.trainer.calls import AsyncTrainer
    from checkpoint_engine import WeightsConfig
    from transfer_queue import TransferQueueConfig

    weights = WeightsConfig(backend="cuda_ipc", device="cuda", checksum=False, timeout_s=60)
    ray.init(num_cpus=4, num_gpus=1, include_dashboard=False, log_to_driver=False)
    try:
        trainer = AsyncTrainer(TrainerGroup(1, str(tiny_model), trainer=TrainerConfig(device="cuda", gpus_per_rank=0.5),
                                             algorithm=AlgorithmConfig(), queue=TransferQueueConfig(), weights=weights))
        cfg = RolloutConfig(backend="vllm", num_servers=1, gpu_bundles=True, gpus_per_worker=0.5, gpu_memory_utilization=0.2)

        async def go():
            manager = FleetManager()
            await manager.add_fleet(await Fleet.spawn("gpu", cfg, str(tiny_model), dtype="float32", seed=0))
            await manager.attach_weights(trainer, weights, "keep")
            m = await manager.publish(7)
            (server,) = manager.router.servers
            out = await server.generate([1, 5, 6, 7], SamplingParams(max_tokens=8, seed=0))
            stats = await manager.stats()
            await manager.close()
            return m, out, stats

        m, out, stats = asyncio.run(go())
        trainer.impl.close()
    finally:
        ray.shutdown()
    assert m["weights/evicted"] == 0 and m["weights/bytes"] > 0
    assert set(out.versions) == {7} and stats["fleets"]["gpu"]["servers"][0]["version"] == 7
