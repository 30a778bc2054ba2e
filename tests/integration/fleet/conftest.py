"""Fixtures of the fleet integration tests: tiny models (two weight sets) and a Ray per module."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncrl.data.tiny_model import TinyModelSpec, ensure_tiny_model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tiny_model(tmp_path_factory.mktemp("tiny_models"))


@pytest.fixture(scope="session")
def tiny_model_b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Same architecture as `tiny_model`, other weights: the 'new policy' of update tests."""
    return ensure_tiny_model(tmp_path_factory.mktemp("tiny_models_b"), TinyModelSpec(seed=1))


@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()
