"""Fleets of real Ray server actors (tiny torch engines): a server killed mid-request, fleets
added and removed while requests run."""

from __future__ import annotations

import asyncio

import pytest
import torch
from safetensors.torch import load_file

from asyncrl.config import RolloutConfig
from asyncrl.rollout.base import SamplingParams
from asyncrl.rollout.fleet import Fleet, FleetManager
from asyncrl.rollout.router import NoServerError, Router
from asyncrl.rollout.server_actor import kill

CFG = RolloutConfig(num_servers=2, torch_threads=1, cpus_per_server=1, max_batch_size=64)
GREEDY = SamplingParams(temperature=0.0, max_tokens=400)
PROMPTS = [[4, 5], [5, 5], [7, 5], [8, 5], [9, 5], [4, 5, 5]]
"""Greedy on the tiny model, these run long (most reach 400 tokens before EOS)."""


def _state(path) -> list[tuple[str, torch.Tensor]]:
    return list(load_file(str(path / "model.safetensors")).items())


async def _until(cond, timeout_s: float = 60.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await cond():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


def test_killed_server_fails_over_and_rejoins_at_current_version(ray_cluster, tiny_model, tiny_model_b):
    async def go():
        manager = FleetManager(Router(max_failovers=2))
        await manager.add_fleet(await Fleet.spawn("main", CFG, str(tiny_model), dtype="float32", seed=0))
        await manager.update_weights(_state(tiny_model_b), version=1, pause_mode="wait")
        victim = manager.router.servers[0]
        sp = SamplingParams(temperature=1.0, max_tokens=40, seed=5)
        t = asyncio.create_task(manager.router.generate([5, 6, 7], sp, session_id="s"))  # -> victim (least, first)

        async def started() -> bool:
            return (await victim.refresh()).generated_tokens > 0

        await _until(started)
        kill(victim)
        out = await t
        assert len(out.token_ids) == len(out.logprobs) == len(out.versions) > 0 and set(out.versions) == {1}
        assert manager.router.failovers == 1 and victim not in manager.router.servers
        await manager.wait_restarts()
        stats = await manager.stats()
        rows = stats["fleets"]["main"]["servers"]
        assert stats["restarts"] == 1 and [r["version"] for r in rows] == [1, 1] and all(r["healthy"] for r in rows)
        assert len(manager.router.servers) == 2 and victim not in manager.fleets["main"].servers
        # the rejoined server serves like the other (same weights, same seed -> same tokens)
        a, b = manager.router.servers
        oa, ob = await asyncio.gather(a.generate([9, 9], sp), b.generate([9, 9], sp))
        assert oa.token_ids == ob.token_ids and set(oa.versions) == {1}
        await manager.close()

    asyncio.run(go())


def test_fleets_added_and_removed_while_requests_run(ray_cluster, tiny_model):
    async def go():
        manager = FleetManager(Router())
        one = RolloutConfig(num_servers=1, torch_threads=1, max_batch_size=64)
        main, extra = await asyncio.gather(*(Fleet.spawn(n, one, str(tiny_model), dtype="float32", seed=0) for n in ("main", "extra")))
        await manager.add_fleet(main)
        first = [asyncio.create_task(manager.router.generate(p, GREEDY)) for p in PROMPTS[:3]]
        await asyncio.sleep(0.05)
        await manager.add_fleet(extra)  # while `first` runs on main
        second = [asyncio.create_task(manager.router.generate(p, GREEDY)) for p in PROMPTS[3:]]
        await asyncio.sleep(0.05)
        assert manager.router.in_flight == [3, 3]  # least-in-flight sent the new ones to the new fleet
        removing = asyncio.create_task(manager.remove_fleet("main"))  # drains: its requests finish
        await asyncio.sleep(0.05)
        assert [s.name for s in manager.router.servers] == ["extra-0"] and not removing.done()
        outs = await asyncio.gather(*first, *second)  # one result per call, none cut short
        await removing
        assert [o.finish_reason in ("length", "stop") for o in outs] == [True] * 6
        assert all(len(o.token_ids) == len(o.versions) > 0 for o in outs)
        assert list(manager.fleets) == ["extra"] and manager.router.servers == extra.servers
        stats = await manager.stats()
        assert stats["fleets"]["extra"]["servers"][0]["generated_tokens"] == sum(len(o.token_ids) for o in outs[3:])
        with pytest.raises(NoServerError):
            await manager.router.generate([1], GREEDY, fleet="main")
        await manager.close()

    asyncio.run(go())
