"""The weight plane into real rollout engines: after a publish, the engine scores exactly
like a fresh engine built from the new weights, a cached prefix is recomputed, the pause
modes behave with a request in flight, and the version is bumped.

Sender and server share this process (the server on its asyncio loop, `publish` on a
thread); bytes go through real ZeroMQ and /dev/shm (or a gloo group).
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from safetensors.torch import load_file

from checkpoint_engine import Receiver, Sender, WeightsConfig
from checkpoint_engine.server_loop import apply_update

pytest.importorskip("transformers")
from asyncrl.data.tiny_model import TinyModelSpec, ensure_tiny_model  # noqa: E402
from asyncrl.engines.base import SamplingParams  # noqa: E402

PROMPT = [20, 21, 22, 23, 24, 25]
LONG = 300


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    a = ensure_tiny_model(tmp_path_factory.mktemp("ckpt_models_a"))
    b = ensure_tiny_model(tmp_path_factory.mktemp("ckpt_models_b"), TinyModelSpec(seed=1))
    return a, b


def _state(path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "model.safetensors"))


def _params(i: int = 0) -> SamplingParams:
    return SamplingParams(temperature=0.9, max_tokens=10, seed=1000 + i)


def _diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b))


async def _until_generated(server, n: int) -> None:
    while server.stats().generated_tokens < n:
        await asyncio.sleep(0.005)


async def _publish_into(server, sender: Sender, rx: Receiver, state, version: int, mode: str):
    publish = asyncio.create_task(asyncio.to_thread(sender.publish, state.items(), version))
    update = await asyncio.to_thread(rx.next_update, 30)
    await apply_update(server, update, mode)
    return await publish


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend,mode", [("shm", "keep"), ("shm", "abort"), ("gloo", "wait")])
def test_torch_engine_update_through_weight_plane(models, backend, mode):
    from asyncrl.engines.torch_engine import TorchRolloutServer

    model_a, model_b = models
    cfg = WeightsConfig(backend=backend, bucket_size_mb=0.25, timeout_s=10)

    async def run():
        fresh = TorchRolloutServer(model_b, threads=1)
        want = await fresh.generate(PROMPT, _params())
        await fresh.close()

        sender = Sender(cfg)
        server = TorchRolloutServer(model_a, threads=1)
        server.eos_token_ids = frozenset()  # the in-flight request runs to max_tokens
        rx = Receiver(cfg, "torch-0", endpoint=sender.endpoint)
        sender.wait_for(1, timeout_s=10)
        before = await server.generate(PROMPT, _params())  # PROMPT's KV is now cached
        inflight = asyncio.create_task(server.generate([5, 6], SamplingParams(max_tokens=LONG, seed=3)))
        await _until_generated(server, len(before.token_ids) + 5)
        out = await _publish_into(server, sender, rx, _state(model_b), 1, mode)
        long = await inflight
        cache = server.prefix_cache
        counts = (cache.hits, cache.misses)
        after = await server.generate(PROMPT, _params())
        result = (want, before, after, long, out, server.version, counts, (cache.hits, cache.misses))
        await server.close()
        rx.close()
        sender.close()
        return result

    want, before, after, long, out, version, counts, counts_after = asyncio.run(run())
    assert out.completed == ["torch-0"] and version == 1
    assert after.token_ids == want.token_ids and _diff(after.logprobs, want.logprobs) <= 1e-5
    assert _diff(before.logprobs, after.logprobs) > 1e-3 and set(after.versions) == {1}
    # the cached prefix was recomputed, not reused: one more miss, no new hit
    assert counts_after == (counts[0], counts[1] + 1)
    if mode == "abort":
        assert long.finish_reason == "abort" and 0 < len(long.token_ids) < LONG
        assert set(long.versions) == {0}
    elif mode == "wait":
        assert long.finish_reason == "length" and set(long.versions) == {0}
    else:  # keep: the request continued under the new weights, tokens carry their version
        assert long.finish_reason == "length" and len(long.token_ids) == LONG
        assert long.versions == sorted(long.versions) and set(long.versions) == {0, 1}
