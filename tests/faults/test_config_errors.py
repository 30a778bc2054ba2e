"""A recipe that is not YAML, a missing data file, a bad override: `asyncrl train` says so in one line.

Runs the real CLI as a subprocess (`python -m asyncrl.cli train ...`) in a scratch directory.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl.config import ConfigError, load

ROOT = Path(__file__).resolve().parents[2]


def cli(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "asyncrl.cli", "train", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=60)


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.timeout(90)
def test_yaml_syntax_error_is_one_line_naming_file_and_line(tmp_path):
    recipe = tmp_path / "bad.yaml"
    recipe.write_text("trainer:\n  lr: 0.1\n  betas: [0.9, 0.99\n  total_steps: 3\n")
    out = cli(tmp_path, str(recipe))
    assert out.returncode != 0
    line = one_line(out.stderr)
    assert str(recipe) in line and "line 4" in line and "YAML syntax error" in line
    assert not (tmp_path / "runs").exists()  # nothing started


@pytest.mark.timeout(90)
def test_missing_data_file_is_one_line_naming_the_key_and_path(tmp_path):
    recipe = tmp_path / "jsonl.yaml"
    recipe.write_text("data:\n  task: jsonl\n  train_path: gone/train.jsonl\n")
    out = cli(tmp_path, str(recipe))
    assert out.returncode != 0
    line = one_line(out.stderr)
    assert "data.train_path" in line and "gone/train.jsonl" in line and "not found" in line
    assert not (tmp_path / "runs").exists()  # checked before a run directory or a model is made


@pytest.mark.timeout(90)
def test_override_that_is_not_yaml_is_one_line(tmp_path):
    out = cli(tmp_path, "trainer.betas=[0.9")
    assert out.returncode != 0
    line = one_line(out.stderr)
    assert "trainer.betas" in line and "not valid YAML" in line


@pytest.mark.timeout(30)
def test_load_translates_yaml_and_encoding_errors(tmp_path):
    tab = tmp_path / "tab.yaml"
    tab.write_text("trainer:\n\tlr: 0.1\n")
    with pytest.raises(ConfigError, match=r"tab\.yaml', line 2, column 1: YAML syntax error"):
        load(tab)
    binary = tmp_path / "bin.yaml"
    binary.write_bytes(b"trainer:\n  lr: \xff\xfe\n")
    with pytest.raises(ConfigError, match=r"bin\.yaml': not UTF-8"):
        load(binary)
