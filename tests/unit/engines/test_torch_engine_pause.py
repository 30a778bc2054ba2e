"""TorchRolloutServer pause modes with requests in flight: `abort` returns partial outputs at once,
`wait` drains, `keep` freezes and continues under new weights with per-token versions."""

from __future__ import annotations

import asyncio
import time

import pytest
from safetensors.torch import load_file

from asyncrl.engines.base import SamplingParams

from .helpers import make_server, max_abs_diff, teacher_forced_logprobs

LONG = 300


def _server(path):
    server = make_server(path)
    server.eos_token_ids = frozenset()  # lengths are then set by max_tokens only
    return server


async def _until_generated(server, n: int) -> None:
    while server.stats().generated_tokens < n:
        await asyncio.sleep(0.005)


def test_abort_returns_partial_outputs_promptly_and_holds_new_requests(tiny_model):
    async def run():
        server = _server(tiny_model)
        tasks = [asyncio.create_task(server.generate([5 + i, 6], SamplingParams(max_tokens=LONG, seed=i))) for i in range(4)]
        await _until_generated(server, 20)
        t0 = time.monotonic()
        await server.pause("abort")
        outs = await asyncio.wait_for(asyncio.gather(*tasks), timeout=2.0)
        abort_s = time.monotonic() - t0
        held = asyncio.create_task(server.generate([9, 9], SamplingParams(max_tokens=3, seed=0)))
        await asyncio.sleep(0.3)
        held_while_paused = held.done()
        paused_stats = server.stats()
        await server.resume()
        late = await asyncio.wait_for(held, timeout=10)
        await server.close()
        return outs, abort_s, held_while_paused, paused_stats, late

    outs, abort_s, held_while_paused, paused_stats, late = asyncio.run(run())
    assert abort_s < 1.0
    assert all(o.finish_reason == "abort" and 0 < len(o.token_ids) < LONG for o in outs)
    assert all(len(o.token_ids) == len(o.logprobs) == len(o.versions) for o in outs)
    assert not held_while_paused and paused_stats.paused and paused_stats.in_flight == 1
    assert late.finish_reason == "length" and len(late.token_ids) == 3


def test_wait_drains_in_flight_requests(tiny_model):
    async def run():
        server = _server(tiny_model)
        tasks = [asyncio.create_task(server.generate([5 + i], SamplingParams(max_tokens=40 + i, seed=i))) for i in range(3)]
        await _until_generated(server, 3)
        while len(server._worker.batch.rows) < 3:  # all three running (a queued one is not in flight: it waits)
            await asyncio.sleep(0.002)
        await server.pause("wait")
        drained = [t.done() for t in tasks]
        held = asyncio.create_task(server.generate([9], SamplingParams(max_tokens=2, seed=0)))
        await asyncio.sleep(0.2)
        held_while_paused = held.done()
        await server.resume()
        outs, late = await asyncio.gather(*tasks), await held
        await server.close()
        return drained, held_while_paused, outs, late

    drained, held_while_paused, outs, late = asyncio.run(run())
    assert all(drained) and not held_while_paused
    assert [len(o.token_ids) for o in outs] == [40, 41, 42] and {o.finish_reason for o in outs} == {"length"}
    assert len(late.token_ids) == 2


def test_keep_freezes_then_continues_under_new_weights(tiny_model, tiny_model_b, hf_models):
    prompt = [11, 12, 13]

    async def run():
        server = _server(tiny_model)
        task = asyncio.create_task(server.generate(prompt, SamplingParams(temperature=1.0, max_tokens=LONG, seed=5)))
        await _until_generated(server, 10)
        await server.pause("keep")
        frozen_at = server.stats().generated_tokens
        await asyncio.sleep(0.2)
        still_frozen = server.stats().generated_tokens == frozen_at and not task.done()
        await server.update_weights(load_file(str(tiny_model_b / "model.safetensors")).items(), version=1)
        await server.resume()
        out = await task
        await server.close()
        return out, frozen_at, still_frozen

    out, frozen_at, still_frozen = asyncio.run(run())
    assert still_frozen
    assert out.finish_reason == "length" and len(out.token_ids) == LONG
    switch = out.versions.index(1)
    assert switch == frozen_at and out.versions == [0] * switch + [1] * (LONG - switch)
    old = teacher_forced_logprobs(hf_models["a"], prompt, out.token_ids, 1.0)
    new = teacher_forced_logprobs(hf_models["b"], prompt, out.token_ids, 1.0)
    assert max_abs_diff(out.logprobs[:switch], old[:switch]) <= 1e-4
    assert max_abs_diff(out.logprobs[switch:], new[switch:]) <= 1e-4
    assert max_abs_diff(out.logprobs[switch:], old[switch:]) > 1e-2


def test_cancelled_request_leaves_the_batch(tiny_model):
    async def run():
        server = _server(tiny_model)
        task = asyncio.create_task(server.generate([5], SamplingParams(max_tokens=LONG, seed=0)))
        await _until_generated(server, 5)
        task.cancel()
        await asyncio.sleep(0.2)
        stats = server.stats()
        await server.close()
        return stats, task

    stats, task = asyncio.run(run())
    assert task.cancelled() and stats.in_flight == 0 and stats.generated_tokens < LONG


def test_close_returns_in_flight_requests_and_refuses_new_ones(tiny_model):
    async def run():
        server = _server(tiny_model)
        task = asyncio.create_task(server.generate([5], SamplingParams(max_tokens=LONG, seed=0)))
        await _until_generated(server, 5)
        await server.close()
        out = await asyncio.wait_for(task, timeout=2.0)
        with pytest.raises(RuntimeError, match="closed"):
            await server.generate([5], SamplingParams(max_tokens=2))
        await server.close()  # idempotent
        return out

    out = asyncio.run(run())
    assert out.finish_reason == "abort" and 0 < len(out.token_ids) < LONG
