"""TorchRolloutServer.update_weights and the prefix cache: after an update the engine samples and
scores exactly like a fresh engine built from the new weights, stamps the new version, and
recomputes cached prompts."""

from __future__ import annotations

import asyncio

import pytest
import torch
from safetensors.torch import load_file

from asyncrl.engines.base import SamplingParams

from .helpers import make_server, max_abs_diff

PROMPTS = [[7, 8, 9], [20, 21, 22, 23, 24, 25], [33]]


def _params(i: int) -> SamplingParams:
    return SamplingParams(temperature=0.9, max_tokens=10, seed=1000 + i)


def _state(path) -> list[tuple[str, torch.Tensor]]:
    return sorted(load_file(str(path / "model.safetensors")).items(), reverse=True)  # any order


def test_update_matches_fresh_engine_with_new_weights(tiny_model, tiny_model_b):
    async def run():
        fresh = make_server(tiny_model_b)
        want = await asyncio.gather(*[fresh.generate(p, _params(i)) for i, p in enumerate(PROMPTS)])
        await fresh.close()

        server = make_server(tiny_model)
        before = await asyncio.gather(*[server.generate(p, _params(i)) for i, p in enumerate(PROMPTS)])
        await server.update_weights(_state(tiny_model_b), version=3)
        after = await asyncio.gather(*[server.generate(p, _params(i)) for i, p in enumerate(PROMPTS)])
        version, stats = server.version, server.stats()
        await server.close()
        return want, before, after, version, stats

    want, before, after, version, stats = asyncio.run(run())
    assert [o.token_ids for o in after] == [o.token_ids for o in want]
    assert max(max_abs_diff(a.logprobs, w.logprobs) for a, w in zip(after, want)) <= 1e-5
    assert [o.token_ids for o in before] != [o.token_ids for o in after]
    assert all(set(o.versions) == {0} for o in before) and all(set(o.versions) == {3} for o in after)
    assert version == 3 and stats.version == 3


def test_prefix_cache_hits_and_is_dropped_by_update(tiny_model, tiny_model_b):
    prompt = PROMPTS[1]

    async def run():
        server = make_server(tiny_model)
        cache = server.prefix_cache
        first = await server.generate(prompt, _params(0))
        assert (cache.hits, cache.misses) == (0, 1)
        again = await server.generate(prompt, _params(0))
        assert (cache.hits, cache.misses) == (1, 1)
        await server.update_weights(_state(tiny_model_b), version=1)
        assert len(cache) == 0
        updated = await server.generate(prompt, _params(0))
        assert (cache.hits, cache.misses) == (1, 2)
        await server.reset_prefix_cache()
        assert len(cache) == 0
        await server.generate(prompt, _params(0))
        assert (cache.hits, cache.misses) == (1, 3)
        await server.close()
        return first, again, updated

    first, again, updated = asyncio.run(run())
    assert again.token_ids == first.token_ids and max_abs_diff(again.logprobs, first.logprobs) <= 1e-6
    assert abs(updated.logprobs[0] - first.logprobs[0]) > 1e-3  # first token scored from recomputed KV


def test_partial_update_and_clear_errors(tiny_model, tiny_model_b):
    new = dict(_state(tiny_model_b))

    async def run():
        server = make_server(tiny_model)
        out0 = await server.generate(PROMPTS[0], _params(0))
        await server.update_weights([("lm_head.weight", new["lm_head.weight"])], version=1)
        out1 = await server.generate(PROMPTS[0], _params(0))
        with pytest.raises(KeyError, match="no parameter 'lm_head.bias'"):
            await server.update_weights([("lm_head.bias", torch.zeros(3))], version=2)
        with pytest.raises(ValueError, match="shape"):
            await server.update_weights([("lm_head.weight", new["lm_head.weight"][:5])], version=2)
        with pytest.raises(ValueError, match="dtype"):
            await server.update_weights([("lm_head.weight", new["lm_head.weight"].double())], version=2)
        version = server.version
        head = server.model.lm_head.weight.clone()
        await server.close()
        return out0, out1, version, head

    out0, out1, version, head = asyncio.run(run())
    assert version == 1  # rejected updates change nothing
    assert torch.equal(head, new["lm_head.weight"])
    assert max_abs_diff(out0.logprobs[:1], out1.logprobs[:1]) > 1e-3
