"""Fleets of real Ray server actors (tiny torch engines), one Ray for the module: a partial
rollout across an abort-mode weight update, a server killed mid-request, fleets added and
removed while requests run. Weights travel on the real weight plane (a `Sender` in this
process standing in for trainer rank 0, a `Receiver` in every actor)."""

from __future__ import annotations

import asyncio

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from asyncrl.config import RolloutConfig
from asyncrl.engines.base import SamplingParams
from asyncrl.rollout.fleet import FleetManager
from asyncrl.rollout.fleet_build import Fleet
from asyncrl.rollout.router import NoServerError, Router
from asyncrl.rollout.server_actor import kill
from tests.integration.fleet.weights import weight_source

CFG = RolloutConfig(num_servers=2, torch_threads=1, cpus_per_server=1, max_batch_size=64)
GREEDY = SamplingParams(temperature=0.0, max_tokens=400)
SHORTER = SamplingParams(temperature=0.0, max_tokens=150)
PROMPTS = [[4, 5], [5, 5], [7, 5], [8, 5], [9, 5], [4, 5, 5]]
"""Greedy on the tiny model, these run long (most reach 400 tokens before EOS)."""


def _state(path) -> list[tuple[str, torch.Tensor]]:
    return list(load_file(str(path / "model.safetensors")).items())


async def _until(cond, timeout_s: float = 60.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await cond():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


@torch.no_grad()
def _teacher_forced(path, prompt: list[int], response: list[int]) -> list[float]:
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    logits = model(input_ids=torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(response).unsqueeze(1)).squeeze(1).tolist()


def test_partial_rollout_spans_a_weight_update(ray_cluster, tiny_model, tiny_model_b):
    """One `generate` call returns the whole response; per-token versions show both policies and
    each token's log-prob is its policy's (teacher-forced reference, fp32)."""

    async def go():
        manager = FleetManager(Router())
        cfg = RolloutConfig(num_servers=1, torch_threads=1)
        await manager.add_fleet(await Fleet.spawn("main", cfg, str(tiny_model), dtype="float32", seed=0))
        trainer, _, wcfg = weight_source(_state(tiny_model_b))
        await manager.attach_weights(trainer, wcfg, pause_mode="abort")
        (server,) = manager.router.servers
        t = asyncio.create_task(manager.router.generate(PROMPTS[0], GREEDY))
        while (await server.refresh()).generated_tokens < 20:
            await asyncio.sleep(0.02)
        await manager.publish(1)
        out = await t
        await manager.close()
        trainer.impl.close()
        return out, manager.router.resubmits

    out, resubmits = asyncio.run(go())
    cut = out.versions.index(1)
    assert resubmits == 1 and 20 <= cut < 400 and out.versions == [0] * cut + [1] * (len(out.versions) - cut)
    assert len(out.token_ids) == len(out.logprobs) == len(out.versions) and out.finish_reason in ("length", "stop")
    old = _teacher_forced(tiny_model, PROMPTS[0], out.token_ids[:cut])
    new = _teacher_forced(tiny_model_b, PROMPTS[0], out.token_ids)[cut:]
    assert max(abs(a - b) for a, b in zip(out.logprobs[:cut], old)) <= 1e-4
    assert max(abs(a - b) for a, b in zip(out.logprobs[cut:], new)) <= 1e-4
    # and the new-policy tokens are not scored like the old policy would have
    assert max(abs(a - b) for a, b in zip(out.logprobs[cut:], _teacher_forced(tiny_model, PROMPTS[0], out.token_ids)[cut:])) > 1e-2


def test_killed_server_fails_over_and_rejoins_at_current_version(ray_cluster, tiny_model, tiny_model_b):
    async def go():
        manager = await FleetManager.spawn(CFG, str(tiny_model), dtype="float32", seed=0)
        trainer, _, wcfg = weight_source(_state(tiny_model_b))
        await manager.attach_weights(trainer, wcfg, pause_mode="wait")
        await manager.publish(1)
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
        want = _teacher_forced(tiny_model_b, [9, 9], oa.token_ids)  # the weights it got are tiny_model_b's
        assert max(abs(x - y) for x, y in zip(oa.logprobs, want)) <= 1e-4
        await manager.close()
        trainer.impl.close()

    asyncio.run(go())


def test_fleets_added_and_removed_while_requests_run(ray_cluster, tiny_model):
    async def go():
        manager = FleetManager(Router())
        one = RolloutConfig(num_servers=1, torch_threads=1, max_batch_size=64)
        main, extra = await asyncio.gather(*(Fleet.spawn(n, one, str(tiny_model), dtype="float32", seed=0) for n in ("main", "extra")))
        await manager.add_fleet(main)
        first = [asyncio.create_task(manager.router.generate(p, SHORTER)) for p in PROMPTS[:3]]
        await asyncio.sleep(0.05)
        await manager.add_fleet(extra)  # while `first` runs on main
        second = [asyncio.create_task(manager.router.generate(p, SHORTER)) for p in PROMPTS[3:]]
        await asyncio.sleep(0.05)
        assert manager.router.in_flight == [3, 3]  # least-in-flight sent the new ones to the new fleet
        order: list[str] = []
        for t in first:
            t.add_done_callback(lambda _: order.append("request on main"))
        removing = asyncio.create_task(manager.remove_fleet("main"))  # drains: its requests finish
        removing.add_done_callback(lambda _: order.append("main removed"))
        await asyncio.sleep(0.01)  # remove_fleet's drains begin
        assert [s.name for s in manager.router.servers] == ["extra-0"]  # no new request goes to main
        outs = await asyncio.gather(*first, *second)  # one result per call, none cut short
        await removing
        assert order == ["request on main"] * 3 + ["main removed"]  # removed only once drained
        assert [o.finish_reason in ("length", "stop") for o in outs] == [True] * 6
        assert all(len(o.token_ids) == len(o.versions) > 0 for o in outs)
        assert list(manager.fleets) == ["extra"] and manager.router.servers == extra.servers
        stats = await manager.stats()
        assert stats["fleets"]["extra"]["servers"][0]["generated_tokens"] == sum(len(o.token_ids) for o in outs[3:])
        with pytest.raises(NoServerError):
            await manager.router.generate([1], SHORTER, fleet="main")
        await manager.close()

    asyncio.run(go())


def test_a_server_killed_mid_sample_hands_its_tokens_on(ray_cluster, tiny_model, tmp_path):
    """A sample whose server is SIGKILLed mid-generation continues on the other server from the tokens
    the dead one had written to the data plane (its snapshot, collected by the health probe), not from
    the prompt; the shm plane (one file per tensor) outlives the dead process. The snapshot's file is
    freed once used, and the record's first tokens are the snapshot's."""
    import dataclasses
    import os
    import signal

    from asyncrl.config import Config
    from asyncrl.launch import host_spec
    from asyncrl.rollout.resume import run_moving
    from asyncrl.engines.sample import Sample
    from transfer_queue import make_storage

    cfg = Config()
    cfg.queue.storage, cfg.queue.shm_arena_bytes, cfg.queue.shm_dir, cfg.queue.run_id = "shm", 0, str(tmp_path), "snapshots"
    long = SamplingParams(temperature=0.0, max_tokens=400)
    spec = dataclasses.asdict(host_spec(cfg, "digits", long, long))
    plane = make_storage(cfg.queue)  # the controller's: frees the dead server's snapshot, reads the record here
    sample = Sample(uid="g0-0", group_id="g0", index_in_group=0, group_size=1, prompt_ids=PROMPTS[0], answer="5678")

    async def go():
        manager = await FleetManager.spawn(CFG, str(tiny_model), dtype="float32", seed=0, spec=spec)
        victim, other = manager.router.servers
        t = asyncio.create_task(run_moving(manager.router, sample, free=plane.free))  # -> victim (least, first)

        async def far_enough() -> bool:
            return (await victim.refresh()).generated_tokens >= 60

        await _until(far_enough)
        await victim.probe()  # what the fleet's health loop does every rollout.health_interval_s
        snap = victim.snapshots[sample.uid]
        saved = plane.read([snap])[0].tobytes()
        assert any(f.name.startswith("tq-snapshots") for f in tmp_path.iterdir())
        os.kill(await victim.handle.pid.remote(), signal.SIGKILL)  # no goodbye: its files stay behind
        record, fate = await t
        await manager.close()
        return record, fate, saved, snap

    record, fate, saved, snap = asyncio.run(go())
    from asyncrl.rollout.inflight import decode_saved

    kept = decode_saved(saved)[0].calls[0].token_ids
    assert fate == "continued" and record.meta["meta"]["resumed_tokens"] == len(kept) >= 60
    response = plane.read([record.handles["response_ids"]])[0].tolist()
    assert response[: len(kept)] == kept and len(response) > len(kept)
    with pytest.raises(OSError, match="the file is gone"):  # freed by the controller once the other server continued from it
        plane.read([snap])
    plane.close()
