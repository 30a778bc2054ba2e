"""Fixtures shared by every test package: the tiny demo models, built once per test session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from asyncrl.data.tiny_model import TinyModelSpec, ensure_tiny_model


@pytest.fixture(autouse=True)
def _umask_of_the_session():
    """A run started in this process makes the umask 077 (asyncrl/run_dir.py) and keeps it, as the
    `asyncrl train` process does: every test starts from the session's umask instead, whatever ran before."""
    before = os.umask(0o022)
    os.umask(before)
    yield
    os.umask(before)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo's tiny Qwen2 (seed 0), built locally."""
    return ensure_tiny_model(tmp_path_factory.mktemp("tiny_models"))


@pytest.fixture(scope="session")
def tiny_model_b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Same architecture as `tiny_model`, other weights (seed 1): the 'new policy' of update tests."""
    return ensure_tiny_model(tmp_path_factory.mktemp("tiny_models_b"), TinyModelSpec(seed=1))
