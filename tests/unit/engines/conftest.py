"""Shared fixtures for the rollout engine tests: HF references of the two tiny models (tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def hf_models(tiny_model: Path, tiny_model_b: Path) -> dict[str, object]:
    """Reference HF models for teacher-forced log-probs, keyed 'a' and 'b'."""
    import torch
    from transformers import AutoModelForCausalLM

    return {
        key: AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        for key, path in (("a", tiny_model), ("b", tiny_model_b))
    }
