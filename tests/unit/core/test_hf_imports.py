"""A rollout server or trainer rank loads its model without scikit-learn and scipy (asyncrl/hf_imports.py).

Each case runs in a fresh interpreter: whether transformers imports them is decided once per process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("sklearn")  # mlflow installs both; without them there is nothing to skip

CHECK = """
import json, sys
from asyncrl.data.tiny_model import ensure_tiny_model
from asyncrl.engines.torch_engine import TorchRolloutServer
server = TorchRolloutServer(ensure_tiny_model(sys.argv[1]))
loaded = sorted(m for m in ("sklearn", "scipy") if m in sys.modules)
import sklearn, scipy.optimize  # code of the process's own still gets them
from transformers.generation import candidate_generator
print(json.dumps({"loaded": loaded, "roc_curve": hasattr(candidate_generator, "roc_curve"), "params": sum(p.numel() for p in server.model.parameters())}))
"""


def _run(tmp_path, **env) -> dict:
    out = subprocess.run([sys.executable, "-c", CHECK, str(tmp_path / "models")], capture_output=True, text=True, timeout=300,
                         env={**os.environ, **env}, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_model_loads_without_transformers_importing_sklearn_or_scipy(tmp_path):
    got = _run(tmp_path)
    assert got["params"] > 0
    assert got["loaded"] == []
    assert got["roc_curve"] is False  # transformers saw scikit-learn as absent when it loaded its generation code


TOKENIZER_ONLY = """
import json, sys
from asyncrl.data.tiny_model import ensure_tiny_model
from asyncrl.engines.torch_sampling import load_tokenizer
tok = load_tokenizer(ensure_tiny_model(sys.argv[1]))
print(json.dumps({"loaded": sorted(m for m in ("sklearn", "scipy") if m in sys.modules), "ids": tok("1 + 2")["input_ids"]}))
"""


def test_a_tokenizer_alone_loads_without_them(tmp_path):
    """What a cost-model server (a tokenizer, no model) and the controller load: transformers' tokenizer
    classes import its model classes' modules too."""
    from asyncrl.data.tiny_model import ensure_tiny_model

    ensure_tiny_model(tmp_path / "models")  # built here: the check's process only loads it
    out = subprocess.run([sys.executable, "-c", TOKENIZER_ONLY, str(tmp_path / "models")], capture_output=True, text=True,
                         timeout=300, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["loaded"] == [] and len(got["ids"]) > 0


def test_the_environment_keeps_transformers_backends(tmp_path):
    got = _run(tmp_path, ASYNCRL_TRANSFORMERS_BACKENDS="1")
    assert got["roc_curve"] is True
    assert got["loaded"] == ["scipy", "sklearn"]


def test_too_late_once_transformers_loaded_them():
    from asyncrl.hf_imports import LOADERS

    code = f"import {LOADERS[0]}; from asyncrl.hf_imports import skip_unused_backends; print(skip_unused_backends())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip().splitlines()[-1] == "False"
