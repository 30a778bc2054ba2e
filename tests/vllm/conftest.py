"""Shared fixtures for the vLLM backend tests: tiny models, a module event loop, HF reference log-probs."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest

from tests.vllm._helpers import HFReference

os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")  # a compiled first logprobs call is slow on CPU


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """seed -> folder of the tiny Qwen2 (seed 0: start weights, seed 1: the 'trained' ones)."""
    from asyncrl.data.tiny_model import TinyModelSpec, ensure_tiny_model

    root = tmp_path_factory.mktemp("tiny_models")
    return {s: ensure_tiny_model(root, TinyModelSpec(seed=s)) for s in (0, 1)}


@pytest.fixture(scope="module")
def loop() -> Any:
    """One event loop per module: a server must be driven from the loop it first ran on."""
    lp = asyncio.new_event_loop()
    yield lp
    lp.close()


@pytest.fixture(scope="session")
def hf(tiny_models: dict[int, Path]) -> dict[int, HFReference]:
    return {s: HFReference(p) for s, p in tiny_models.items()}
