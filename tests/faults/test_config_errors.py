"""A recipe that is not YAML, a missing data file or model, an unset `???` key, a verl key, a bad override:
`asyncrl train` says so in one line naming the key, before a run directory or a server exists.

Runs the real CLI as a subprocess (`python -m asyncrl.cli train ...`) in a scratch directory.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
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


def recipe_overrides(tmp_path: Path, *extra: str) -> list[str]:
    """The GSM8K recipe with its mandatory keys set (a real data file) and `extra` overrides."""
    data = tmp_path / "train.jsonl"
    data.write_text('{"question": "1+1?", "answer": "#### 2"}\n')
    return [str(ROOT / "configs" / "gsm8k_qwen2.5_0.5b.yaml"), f"data.train_path={data}", *extra]


@pytest.mark.timeout(90)
def test_unset_mandatory_key_of_a_recipe_is_one_line_naming_it(tmp_path):
    recipe = ROOT / "configs" / "gsm8k_qwen2.5_0.5b.yaml"
    assert "path: ???" in recipe.read_text()  # the recipe marks what it cannot guess
    out = cli(tmp_path, str(recipe))
    assert out.returncode == 2
    line = one_line(out.stderr)
    assert line.startswith(f"asyncrl: config error: model.path: required by {recipe}, not set"), line
    assert "data.train_path" in line
    assert not (tmp_path / "runs").exists()


@pytest.mark.timeout(90)
def test_verl_key_is_one_line_with_the_asyncrl_key(tmp_path):
    out = cli(tmp_path, "actor_rollout_ref.rollout.n=4", "rollout.engine=vllm")
    assert out.returncode == 2
    line = one_line(out.stderr)
    assert line == ("asyncrl: config error: actor_rollout_ref.rollout.n: unknown key (in the overrides); in asyncrl it is "
                    "rollout.group_size (and 1 more unknown: rollout.engine: unknown key (in the overrides); in asyncrl it is "
                    "rollout.backend (`vllm`, `torch` (embedded), `openai` (OpenAI-compatible servers you run, at "
                    "`rollout.server_urls`) or `cost_model` (simulated)))")  # every unknown key, not only the first


def fake_model_folder(tmp_path: Path, tokenizer_json: str | None) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}')
    if tokenizer_json is not None:
        (folder / "tokenizer.json").write_text(tokenizer_json)
        (folder / "tokenizer_config.json").write_text('{"tokenizer_class": "PreTrainedTokenizerFast"}')
    return folder


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", ["no_folder", "no_config", "bad_tokenizer"])
def test_model_problems_fail_before_anything_starts(tmp_path, case):
    if case == "no_folder":
        model, want = tmp_path / "gone", "is not a local folder"
    elif case == "no_config":
        model, want = tmp_path / "empty", "has no config.json"
        model.mkdir()
    else:
        model, want = fake_model_folder(tmp_path, '{"version": "1.0", "model": {"type": "BPE", "vocab": ['), "cannot read the tokenizer"
    t0 = time.monotonic()
    out = cli(tmp_path, *recipe_overrides(tmp_path, f"model.path={model}"))
    took = time.monotonic() - t0
    assert out.returncode == 2
    line = one_line(out.stderr)
    assert line.startswith("asyncrl: config error: model.path: ") and want in line and str(model) in line, line
    assert not (tmp_path / "runs").exists()  # no run directory, no server, no Ray
    assert took < 30, f"{took:.1f}s: the check must come before any server starts"
