"""The weight-parity probe on real parts: a real FSDP2 `TrainerEngine` publishing through a real
`Sender` (shm buckets, several per model), real torch rollout engines loading through their
`Receiver`s, the `FleetManager` comparing their log-probs of the probe with the trainer's.

A corrupted load is made by a server subclass that adds noise to one weight after the real load
(what a reused transport buffer did to vLLM's layerwise reload): the probe must catch it at the
first publish's check, with one line naming the server, the version and the gap; with
`weights.parity_action=resync` the server is re-synced instead and passes once it loads cleanly. A publish
returns before its check (no train step waits for it): `parity_settled()` waits for the verdict.
With bfloat16 engines against the float32 trainer (`rollout.dtype`) the same holds under the 16-bit tolerance.
"""

from __future__ import annotations

import asyncio
import itertools

import pytest
import torch

from asyncrl.config import AlgorithmConfig, TrainerConfig
from asyncrl.rollout.fleet import FleetManager
from asyncrl.rollout.fleet_build import Fleet
from asyncrl.rollout.host import ServerHost
from asyncrl.rollout.parity import ParityCheck, WeightParityError, vocab_bound
from asyncrl.rollout.router import Router
from asyncrl.engines.torch_engine import TorchRolloutServer
from asyncrl.trainer.calls import AsyncTrainer
from asyncrl.trainer.rank import TrainerRank
from checkpoint_engine import WeightsConfig


VERSIONS = itertools.count()
"""The module's trainer publishes ever higher versions (a sender's versions only grow)."""


class CorruptingServer(TorchRolloutServer):
    """Loads like the torch engine, then perturbs `o_proj` of layer 0 on its first `corrupt_loads` loads."""

    def __init__(self, *args, corrupt_loads: int = 1, **kw) -> None:
        super().__init__(*args, **kw)
        self.corrupt_loads = corrupt_loads
        self.loads = 0

    async def load_update(self, update) -> None:
        await super().load_update(update)
        self.loads += 1
        if self.loads <= self.corrupt_loads:
            w = self._params["model.layers.0.self_attn.o_proj.weight"]
            w.add_(torch.randn(w.shape, generator=torch.Generator().manual_seed(self.loads)) * 0.5)


@pytest.fixture(scope="module")
def trainer(tiny_model):
    from asyncrl.trainer.engine import TrainerEngine

    cfg = WeightsConfig(backend="shm", bucket_size_mb=0.3, timeout_s=20)  # the demo model spans 7 buckets
    engine = TrainerEngine(str(tiny_model), trainer=TrainerConfig(), algorithm=AlgorithmConfig())
    rank = TrainerRank(engine, plane=None, weights=cfg)
    yield AsyncTrainer(rank), cfg
    rank.close()


async def _manager(servers, trainer, cfg, parity) -> FleetManager:
    hosts = [ServerHost(s, name=f"main-{i}", agent=None, eval_agent=None, plane=None) for i, s in enumerate(servers)]
    manager = FleetManager(Router(), restart_dead=False)
    await manager.add_fleet(Fleet("main", hosts))
    await manager.attach_weights(trainer, cfg, "keep", parity=parity)
    return manager


def _parity(tiny_model, action: str = "stop") -> ParityCheck:
    weights = WeightsConfig(parity_action=action)
    return ParityCheck.from_config(weights, "float32", vocab_bound(None, str(tiny_model)))


@pytest.mark.timeout(120)
def test_clean_publishes_pass_and_a_corrupted_load_stops_at_the_first_publish(trainer, tiny_model):
    handle, cfg = trainer

    async def go():
        clean = TorchRolloutServer(tiny_model, threads=1)
        bad = CorruptingServer(tiny_model, threads=1)
        manager = await _manager([clean], handle, cfg, _parity(tiny_model))
        v = next(VERSIONS)
        await manager.publish(v)
        await manager.parity_settled()
        gap_clean = manager.parity.metrics()["weights/parity_max_abs/main-0"]
        stats = await manager.stats()
        await manager.close()

        manager = await _manager([TorchRolloutServer(tiny_model, threads=1), bad], handle, cfg, _parity(tiny_model))
        bad_version = next(VERSIONS)
        await manager.publish(bad_version)
        with pytest.raises(WeightParityError) as err:
            await manager.parity_settled()
        await manager.close()
        return v, gap_clean, stats, bad_version, str(err.value)

    v, gap_clean, stats, bad_version, message = asyncio.run(go())
    assert gap_clean <= 1e-5
    row = stats["fleets"]["main"]["servers"][0]
    assert row["parity_max_abs"] == gap_clean and row["parity_version"] == v
    # one line: which server, which version, how far, which key
    assert "\n" not in message and "server main-1" in message and f"version {bad_version}" in message
    assert "weights.parity_tol=0.01" in message
    gap = float(message.split("log-probs ")[1].split(" away")[0])
    assert gap > 0.05


@pytest.mark.timeout(120)
def test_resync_action_sends_the_version_again_and_routes_the_server_once_it_passes(trainer, tiny_model):
    handle, cfg = trainer

    async def go():
        bad = CorruptingServer(tiny_model, threads=1, corrupt_loads=1)  # wrong once, then clean
        parity = _parity(tiny_model, "resync")
        manager = await _manager([TorchRolloutServer(tiny_model, threads=1), bad], handle, cfg, parity)
        await manager.publish(next(VERSIONS))
        await manager.parity_settled()
        first = parity.metrics()
        routed_after_publish = len(manager.router.servers)
        await manager.wait_restarts()
        routed = len(manager.router.servers)
        out = (first, routed_after_publish, routed, bad.loads, dict(parity.gaps), parity.failures, manager.resyncs,
               dict(manager.evicted))
        await manager.close()
        return out

    first, routed_after_publish, routed, loads, gaps, failures, resyncs, evicted = asyncio.run(go())
    assert first["weights/parity_max_abs/main-1"] > 0.05 and first["weights/parity_max_abs/main-0"] <= 1e-5
    assert routed_after_publish == 1  # taken out at once by the check
    assert routed == 2 and loads == 2 and resyncs == 1 and failures == 1  # re-sent, passed, routed again
    assert gaps["main-1"][1] <= 1e-5 and evicted == {"main-1": "parity"}


@pytest.mark.timeout(120)
def test_bf16_rollout_passes_under_its_tolerance_and_a_corrupted_bf16_load_still_stops(trainer, tiny_model):
    """`rollout.dtype=bfloat16` against the float32 trainer: the real publish lands float32 buckets in
    bfloat16 engines (cast on landing); the default tolerance is the 16-bit one, which the clean engine's
    rounding stays under and the corrupted one does not."""
    from asyncrl.config import RolloutConfig

    handle, cfg = trainer
    rollout = RolloutConfig(dtype="bfloat16")
    parity = ParityCheck.from_config(WeightsConfig(), "float32", vocab_bound(None, str(tiny_model)), rollout)
    assert (parity.tol, parity.rel_tol) == (0.25, 2**-6) and (_parity(tiny_model).tol, _parity(tiny_model).rel_tol) == (0.01, 0)

    async def go():
        bf16 = dict(dtype="bfloat16", weights_dtype="float32", threads=1)
        manager = await _manager([TorchRolloutServer(tiny_model, **bf16), CorruptingServer(tiny_model, **bf16)],
                                 handle, cfg, parity)
        bad_version = next(VERSIONS)
        await manager.publish(bad_version)
        with pytest.raises(WeightParityError) as err:
            await manager.parity_settled()
        gaps = dict(parity.gaps)
        await manager.close()
        return bad_version, gaps, str(err.value)

    bad_version, gaps, message = asyncio.run(go())
    assert 1e-5 < gaps["main-0"][1] <= 0.05  # bf16 rounding: above float32's 1e-6, far under the tolerance
    assert "server main-1" in message and f"version {bad_version}" in message and "weights.parity_tol=0.25" in message
    assert gaps["main-1"][1] > 0.25


def test_probe_ids_are_fixed_and_within_the_vocabulary():
    from asyncrl.rollout.parity import PROBE_ID_LIMIT, max_abs_gap, probe_ids

    ids = probe_ids(151_936)
    assert ids == probe_ids(151_936) and len(ids) == 64 and max(ids) < PROBE_ID_LIMIT
    assert max(probe_ids(97)) < 97
    assert max_abs_gap([-1.0, -2.0], [-1.0]) == float("inf")  # misaligned replies fail
    assert max_abs_gap([-1.0], [float("inf")]) == float("inf")
