"""Stopping in the torch engine (EOS from generation config + tokenizer, stop strings), the
vLLM sampling mapping, and where vLLM's log lines go."""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
from pathlib import Path
from typing import Any

import pytest

from asyncrl.engines.base import SamplingParams
from asyncrl.engines.torch_sampling import StopRule, folder_eos_ids, model_eos_ids

pytestmark = pytest.mark.timeout(60)


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 30))


class _Tok:
    eos_token_id = 11


def test_eos_ids_are_the_union_of_generation_config_config_and_tokenizer() -> None:
    assert model_eos_ids([7, 9], 2, _Tok()) == {2, 7, 9, 11}
    assert model_eos_ids(None, None, None) == frozenset()


def test_stop_rule_matches_a_string_spanning_tokens_only_when_completed() -> None:
    chars = {1: "a", 2: "b", 3: "c"}
    tokens: list[int] = []
    rule = StopRule({9}, ["bc"], tokens, lambda ids: "".join(chars[i] for i in ids))
    seen = []
    for t in [1, 2, 1, 2, 3, 1]:
        tokens.append(t)
        seen.append(t in rule)
    assert seen == [False, False, False, False, True, True]
    assert 9 in rule
    with pytest.raises(ValueError, match="sampling.stop"):
        SamplingParams(stop=[""])


def _folder_with_eos(src: Path, dst: Path, eos: list[int]) -> Path:
    shutil.copytree(src, dst)
    gen = json.loads((dst / "generation_config.json").read_text())
    gen["eos_token_id"] = eos
    (dst / "generation_config.json").write_text(json.dumps(gen))
    return dst


def test_torch_engine_stops_on_generation_config_eos_and_stop_strings(tiny_model: Path, tmp_path: Path) -> None:
    from asyncrl.engines.torch_engine import TorchRolloutServer

    sampling = SamplingParams(max_tokens=24, seed=5)

    async def free_run() -> Any:
        server = TorchRolloutServer(tiny_model, seed=0)
        assert 2 in server.eos_token_ids  # the tokenizer's <eos>
        server.eos_token_ids = frozenset()
        out = await server.generate([5, 6, 7], sampling)
        text = [server.tokenizer.decode([t]) for t in out.token_ids]
        await server.close()
        return out, text

    free, text = run(free_run())
    assert free.finish_reason == "length" and len(free.token_ids) == 24
    # a token of the free run, declared EOS in generation_config.json only (a ChatML <|im_end|>)
    k = next(i for i in range(3, 24) if free.token_ids[i] not in free.token_ids[:i] and free.token_ids[i] > 3)
    folder = _folder_with_eos(tiny_model, tmp_path / "m", [free.token_ids[k]])
    assert folder_eos_ids(folder) == {2, free.token_ids[k]}  # the vLLM engine reads the same set
    # a two-character stop string that first completes at some position j
    j = next(i for i in range(2, 24) if text[i - 1] + text[i] not in "".join(text[:i]) and text[i - 1] and text[i])
    stop = text[j - 1] + text[j]

    async def stopped() -> Any:
        server = TorchRolloutServer(folder, seed=0)
        assert server.eos_token_ids == {2, free.token_ids[k]}
        eos_out = await server.generate([5, 6, 7], sampling)
        server.eos_token_ids = frozenset()
        str_out = await server.generate([5, 6, 7], SamplingParams(max_tokens=24, seed=5, stop=[stop]))
        await server.close()
        return eos_out, str_out

    eos_out, str_out = run(stopped())
    assert eos_out.finish_reason == "stop" and eos_out.token_ids == free.token_ids[: k + 1]
    assert eos_out.logprobs == pytest.approx(free.logprobs[: k + 1], abs=1e-6)
    # the stop string's tokens are kept, with their log-probs: ids are what was sampled
    assert str_out.finish_reason == "stop" and str_out.token_ids == free.token_ids[: j + 1]
    assert str_out.logprobs == pytest.approx(free.logprobs[: j + 1], abs=1e-6)
    assert len(str_out.versions) == j + 1


def test_torch_engine_stop_strings_without_tokenizer_name_the_key(tiny_model: Path, tmp_path: Path) -> None:
    from asyncrl.engines.torch_engine import TorchRolloutServer

    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy(tiny_model / name, bare / name)

    async def go() -> None:
        server = TorchRolloutServer(bare, seed=0)
        assert server.tokenizer is None and server.eos_token_ids == {2}
        with pytest.raises(ValueError, match=r"rollout.stop: .*need a tokenizer"):
            await server.generate([5, 6], SamplingParams(stop=["x"]))
        assert server.stats().in_flight == 0
        await server.close()

    run(go())


def test_vllm_sampling_gets_stop_strings_and_eos_ids() -> None:
    pytest.importorskip("vllm")
    from asyncrl.engines.vllm_engine import _vllm_sampling

    vs = _vllm_sampling(SamplingParams(stop=["\n\n"], stop_token_ids=[5]), frozenset({2, 7}))
    assert vs.stop == ["\n\n"] and sorted(vs.stop_token_ids) == [2, 5, 7]


def test_vllm_logging_goes_to_the_run_dir_not_the_console(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("vllm")
    from asyncrl.engines.vllm_engine import route_vllm_logging

    monkeypatch.delenv("VLLM_LOGGING_CONFIG_PATH", raising=False)
    monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)
    logger = logging.getLogger("vllm")
    before = list(logger.handlers)
    levels = [(h, h.level) for h in before]
    try:
        route_vllm_logging(tmp_path / "run" / "vllm.log")
        route_vllm_logging(tmp_path / "run" / "vllm.log")  # a second server: no second file handler
        files = [h for h in logger.handlers if isinstance(h, logging.FileHandler)]
        assert len(files) == 1
        logging.getLogger("vllm.engine").info("engine started %d", 42)
        files[0].flush()
        assert "engine started 42" in (tmp_path / "run" / "vllm.log").read_text()
        consoles = [h for h in logger.handlers if not isinstance(h, logging.FileHandler)]
        assert all(h.level >= logging.WARNING for h in consoles)
        import os

        child = json.loads(Path(os.environ["VLLM_LOGGING_CONFIG_PATH"]).read_text())
        assert child["handlers"]["file"]["filename"] == str(tmp_path / "run" / "vllm.log")
        assert child["handlers"]["console"]["level"] == "WARNING" and os.environ["VLLM_LOGGING_LEVEL"] == "WARNING"
    finally:
        for h in logger.handlers[:]:
            if h not in before:
                logger.removeHandler(h)
                h.close()
        for h, level in levels:
            h.setLevel(level)
