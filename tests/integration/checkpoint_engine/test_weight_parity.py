"""The weight plane into the torch engine through the pipeline's path, with a model of several
buckets: every CPU backend (local, shm, gloo, nixl) publishes the demo model in 0.3 MiB buckets
(9 buckets, fused-layer tensors split across them) into a `TorchRolloutServer` joined by
`ServerHost.join_weights` (its buckets land in place in the parameters, `land_into`). After a
first publish, a second with other weights, and a restart (a fresh server joining under the same
name, brought current by `Sender.sync`), its log-probs of what it generates equal those of an fp32
HF model holding exactly the published tensors (measured 9.5e-7).

The vLLM twin (the workers receive the buckets) is tests/vllm/test_vllm_weight_parity.py; the
scenario and the reference are shared (tests/vllm/_helpers.py).
"""

from __future__ import annotations

import asyncio
import importlib.util

import pytest

from checkpoint_engine import WeightsConfig
from tests.vllm._helpers import HFReference, max_gap, new_weights, publish_restart_scenario

pytest.importorskip("transformers")

BUCKET_MB = 0.3
TOL = 1e-3  # fp32 vs HF from the same tensors; measured 9.5e-7
PROMPT = [1] + list(range(20, 60))
BACKENDS = ["local", "shm", "gloo",
            pytest.param("nixl", marks=pytest.mark.skipif(
                not any(importlib.util.find_spec(m) for m in ("nixl", "nixl_cu12")), reason="nixl not installed"))]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from safetensors.torch import load_file

    from asyncrl.data.tiny_model import ensure_tiny_model

    path = ensure_tiny_model(tmp_path_factory.mktemp("parity_model"))
    template = load_file(str(path / "model.safetensors"))
    return path, [new_weights(template, seed) for seed in (11, 12)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", BACKENDS)
def test_torch_engine_serves_published_weights(backend, model) -> None:
    from asyncrl.engines.torch_engine import TorchRolloutServer

    path, states = model
    cfg = WeightsConfig(backend=backend, bucket_size_mb=BUCKET_MB, timeout_s=30)
    steps = asyncio.run(publish_restart_scenario(lambda p: TorchRolloutServer(p, threads=1), path, cfg, states, PROMPT))
    folder = HFReference(path)
    before = [folder, HFReference.from_state(path, states[0]), folder]  # what each step replaced
    for (label, state, gen, out), version, old in zip(steps, (1, 2, 2), before):
        assert out.completed == ["srv-0"] and out.buckets >= 7, (label, out)
        assert set(gen.versions) == {version} and len(gen.token_ids) == 16, label
        gap = max_gap(gen.logprobs, HFReference.from_state(path, state).logprobs(PROMPT, gen.token_ids))
        stale = max_gap(gen.logprobs, old.logprobs(PROMPT, gen.token_ids))
        print(f"\n{backend} {label}: {out.buckets} buckets, gap vs HF(published) {gap:.2e}, vs the weights replaced {stale:.2f}")
        assert gap <= TOL, (label, gap)
        assert stale > 0.1, (label, stale)
    assert steps[1][1] is steps[2][1]
