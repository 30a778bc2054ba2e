"""The tiny demo model, built once per test session under a temporary folder."""

import pytest


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory) -> str:
    from asyncrl.data.tiny_model import ensure_tiny_model

    return str(ensure_tiny_model(tmp_path_factory.mktemp("models")))
