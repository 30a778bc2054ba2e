"""TorchRolloutServer.generate: log-probs match a teacher-forced HF forward under batching and
padding, sampling is deterministic per request seed whatever the batch, top-k / stop / max_tokens."""

from __future__ import annotations

import asyncio

from asyncrl.engines.base import SamplingParams

from .helpers import make_server, max_abs_diff, teacher_forced_logprobs

PROMPTS = [[5], [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [30, 31, 32], [40, 41, 42, 43, 44, 45, 46], [50, 51]]


async def _gather(server, prompts, params):
    return await asyncio.gather(*[server.generate(p, s) for p, s in zip(prompts, params)])


def test_logprobs_match_teacher_forced_forward_in_a_padded_batch(tiny_model, hf_models):
    temps = [0.7, 1.0, 1.3, 0.0, 0.9]
    params = [SamplingParams(temperature=t, max_tokens=12, seed=i) for i, t in enumerate(temps)]

    async def run():
        server = make_server(tiny_model)
        # a late joiner: decoded together with rows that already hold KV of other lengths
        first = asyncio.gather(*[server.generate(p, s) for p, s in zip(PROMPTS[:3], params[:3])])
        await asyncio.sleep(0.05)
        rest = await _gather(server, PROMPTS[3:], params[3:])
        outs = list(await first) + list(rest)
        await server.close()
        return outs

    outs = asyncio.run(run())
    for prompt, out, temp in zip(PROMPTS, outs, temps):
        assert len(out.token_ids) == len(out.logprobs) == len(out.versions) >= 1
        assert out.finish_reason in ("stop", "length")
        ref = teacher_forced_logprobs(hf_models["a"], prompt, out.token_ids, temp)
        assert max_abs_diff(out.logprobs, ref) <= 1e-4, (prompt, temp)
    assert sum(len(o.token_ids) for o in outs) > 2 * len(outs)  # some rows really decoded in a batch


def test_same_seed_same_tokens_whatever_the_batch(tiny_model):
    mine = [SamplingParams(temperature=1.0, max_tokens=16, seed=100 + i) for i in range(len(PROMPTS))]
    noise_prompts = [[60 + i, 61, 62][: 1 + i % 3] for i in range(7)]
    noise = [SamplingParams(temperature=0.8, top_p=0.9, max_tokens=8 + i, seed=i) for i in range(7)]

    async def alone():
        server = make_server(tiny_model, seed=1)
        outs = [await server.generate(p, s) for p, s in zip(PROMPTS, mine)]  # one at a time
        await server.close()
        return outs

    async def crowded():
        server = make_server(tiny_model, seed=2, max_batch_size=4)
        outs = await _gather(server, noise_prompts + PROMPTS[::-1], noise + mine[::-1])
        await server.close()
        return outs[len(noise):][::-1]

    a, b = asyncio.run(alone()), asyncio.run(crowded())
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert max(max_abs_diff(x.logprobs, y.logprobs) for x, y in zip(a, b)) <= 1e-4
    assert len({tuple(o.token_ids) for o in a}) == len(a)


def test_engine_seed_fixes_unseeded_requests(tiny_model):
    params = SamplingParams(temperature=1.0, max_tokens=10)

    async def run(seed):
        server = make_server(tiny_model, seed=seed)
        outs = await _gather(server, PROMPTS, [params] * len(PROMPTS))
        await server.close()
        return [o.token_ids for o in outs]

    first, again, other = asyncio.run(run(7)), asyncio.run(run(7)), asyncio.run(run(8))
    assert first == again
    assert first != other


def test_top_k_one_is_greedy_and_greedy_ignores_seed(tiny_model):
    async def run():
        server = make_server(tiny_model)
        greedy = await _gather(server, PROMPTS, [SamplingParams(temperature=0.0, max_tokens=10, seed=i) for i in range(5)])
        top1 = await _gather(server, PROMPTS, [SamplingParams(temperature=1.5, top_k=1, max_tokens=10, seed=50 + i) for i in range(5)])
        sampled = await _gather(server, PROMPTS, [SamplingParams(temperature=1.5, max_tokens=10, seed=50 + i) for i in range(5)])
        await server.close()
        return greedy, top1, sampled

    greedy, top1, sampled = asyncio.run(run())
    assert [o.token_ids for o in greedy] == [o.token_ids for o in top1]
    assert [o.token_ids for o in greedy] != [o.token_ids for o in sampled]


def test_stop_tokens_and_max_tokens(tiny_model):
    prompt = PROMPTS[1]

    async def run():
        server = make_server(tiny_model)
        server.eos_token_ids = frozenset()  # the random model may emit EOS anywhere; test the other rules
        full = await server.generate(prompt, SamplingParams(temperature=1.0, max_tokens=20, seed=3))
        stop_at = next(i for i, t in enumerate(full.token_ids) if i >= 2 and t not in full.token_ids[:i])
        stopped = await server.generate(
            prompt, SamplingParams(temperature=1.0, max_tokens=20, seed=3, stop_token_ids=[full.token_ids[stop_at]])
        )
        short = await server.generate(prompt, SamplingParams(temperature=1.0, max_tokens=5, seed=3))
        await server.close()
        return full, stop_at, stopped, short

    full, stop_at, stopped, short = asyncio.run(run())
    assert len(full.token_ids) == 20 and full.finish_reason == "length"
    assert stopped.token_ids == full.token_ids[: stop_at + 1] and stopped.finish_reason == "stop"
    assert short.token_ids == full.token_ids[:5] and short.finish_reason == "length"


def test_eos_stops_generation(tiny_model):
    async def run():
        server = make_server(tiny_model)
        outs = await _gather(server, [[5 + i % 50] for i in range(64)], [SamplingParams(max_tokens=64, seed=i) for i in range(64)])
        stats = server.stats()
        await server.close()
        return outs, stats

    outs, stats = asyncio.run(run())
    eos = 2
    stopped = [o for o in outs if o.finish_reason == "stop"]
    assert stopped and all(o.token_ids[-1] == eos and eos not in o.token_ids[:-1] for o in stopped)
    assert all(eos not in o.token_ids for o in outs if o.finish_reason == "length")
    assert stats.generated_tokens == sum(len(o.token_ids) for o in outs)
    assert stats.in_flight == 0 and stats.version == 0 and stats.healthy and stats.tokens_per_s > 0
