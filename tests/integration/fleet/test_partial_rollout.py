"""A partial rollout across a weight update (abort mode) on a real Ray server actor: one
`generate` call returns the whole response; per-token versions show both policies, and each
token's log-prob is the one its policy gives (teacher-forced reference, fp32)."""

from __future__ import annotations

import asyncio

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from asyncrl.config import RolloutConfig
from asyncrl.rollout.base import SamplingParams
from asyncrl.rollout.fleet import Fleet, FleetManager
from asyncrl.rollout.router import Router

PROMPT = [4, 5]
"""Greedy under the old weights this prompt runs for 400 tokens (no early EOS)."""


@torch.no_grad()
def _teacher_forced(path, prompt: list[int], response: list[int]) -> list[float]:
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    logits = model(input_ids=torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(response).unsqueeze(1)).squeeze(1).tolist()


def test_partial_rollout_spans_a_weight_update(ray_cluster, tiny_model, tiny_model_b):
    async def go():
        manager = FleetManager(Router())
        cfg = RolloutConfig(num_servers=1, torch_threads=1)
        await manager.add_fleet(await Fleet.spawn("main", cfg, str(tiny_model), dtype="float32", seed=0))
        (server,) = manager.router.servers
        t = asyncio.create_task(manager.router.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=400)))
        while (await server.refresh()).generated_tokens < 20:
            await asyncio.sleep(0.02)
        new = list(load_file(str(tiny_model_b / "model.safetensors")).items())
        await manager.update_weights(new, version=1, pause_mode="abort")
        out = await t
        await manager.close()
        return out, manager.router.resubmits

    out, resubmits = asyncio.run(go())
    cut = out.versions.index(1)
    assert resubmits == 1 and 20 <= cut < 400 and out.versions == [0] * cut + [1] * (len(out.versions) - cut)
    assert len(out.token_ids) == len(out.logprobs) == len(out.versions) and out.finish_reason in ("length", "stop")
    old = _teacher_forced(tiny_model, PROMPT, out.token_ids[:cut])
    new = _teacher_forced(tiny_model_b, PROMPT, out.token_ids)[cut:]
    assert max(abs(a - b) for a, b in zip(out.logprobs[:cut], old)) <= 1e-4
    assert max(abs(a - b) for a, b in zip(out.logprobs[cut:], new)) <= 1e-4
    # and the new-policy tokens are not scored like the old policy would have
    assert max(abs(a - b) for a, b in zip(out.logprobs[cut:], _teacher_forced(tiny_model, PROMPT, out.token_ids)[cut:])) > 1e-2
