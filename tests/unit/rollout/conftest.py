"""Shared fixtures for the rollout engine tests: two tiny models (different seeds) built once."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncrl.data.tiny_model import TinyModelSpec, ensure_tiny_model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tiny_model(tmp_path_factory.mktemp("tiny_models"))


@pytest.fixture(scope="session")
def tiny_model_b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Same architecture as `tiny_model`, other weights (seed 1): the 'new policy' of update tests."""
    return ensure_tiny_model(tmp_path_factory.mktemp("tiny_models_b"), TinyModelSpec(seed=1))


@pytest.fixture(scope="session")
def hf_models(tiny_model: Path, tiny_model_b: Path) -> dict[str, object]:
    """Reference HF models for teacher-forced log-probs, keyed 'a' and 'b'."""
    import torch
    from transformers import AutoModelForCausalLM

    return {
        key: AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        for key, path in (("a", tiny_model), ("b", tiny_model_b))
    }
