"""The weight plane's GPU paths on real GPUs: a bare `weights.device=cuda` (nccl, cuda_ipc), an NCCL
receiver killed mid-publish (evicted within the bounded wait, its group aborted, the trainer alive and
able to publish again), nixl between GPU buffers byte-exact over many reused buckets, the sender's
packing thread on the caller's GPU, and the CUDA builds `scripts/setup.sh` installs. Receivers run in
their own processes (tests/integration/checkpoint_engine/receiver_proc.py); NCCL refuses two ranks on
one GPU, so the nccl tests need 2 devices."""

from __future__ import annotations

from tests.gpu import GPU

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from checkpoint_engine import Sender, WeightsConfig

pytestmark = GPU

ROOT = Path(__file__).resolve().parents[2]
PROC = ROOT / "tests" / "integration" / "checkpoint_engine" / "receiver_proc.py"
TWO_GPUS = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")


def state(seed: int, device: str = "cuda") -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    sd = {f"layers.{i}.weight": torch.randn(256, 256, generator=g) for i in range(8)}
    sd["embed.weight"] = torch.randn(1000, 512, generator=g).to(torch.bfloat16)
    return {k: v.to(device) for k, v in sd.items()}


def digests(sd: dict[str, torch.Tensor]) -> dict[str, int]:
    import zlib

    return {k: zlib.crc32(memoryview(v.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())) for k, v in sd.items()}


def spawn(cfg: WeightsConfig, rid: str, endpoint: str, out: Path, *, gpu: int, updates: int = 1, slow: float = 0.0):
    env = dict(os.environ, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES=str(gpu))
    return subprocess.Popen([sys.executable, str(PROC), "--config", json.dumps(asdict(cfg)), "--id", rid, "--endpoint", endpoint,
                             "--out", str(out), "--updates", str(updates), "--slow", str(slow)], env=env)


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.timeout(180)
@TWO_GPUS
def test_nccl_with_a_bare_cuda_device_and_a_receiver_killed_mid_publish(tmp_path):
    torch.cuda.set_device(0)
    cfg = WeightsConfig(backend="nccl", device="cuda", bucket_size_mb=0.5, timeout_s=5.0)  # bare `cuda` on both ends
    sender = Sender(cfg)
    victim = spawn(cfg, "victim", sender.endpoint, tmp_path / "victim.jsonl", gpu=1, slow=0.3)
    procs = [victim]
    try:
        sender.wait_for(1, timeout_s=120)
        result = {}
        pub = threading.Thread(target=lambda: result.update(o=sender.publish(state(1).items(), 1)))
        pub.start()
        progress = Path(str(tmp_path / "victim.jsonl") + ".progress")
        deadline = time.monotonic() + 60
        while not progress.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert progress.exists(), "the victim never received a tensor"
        t0 = time.monotonic()
        victim.send_signal(signal.SIGKILL)
        pub.join(60)
        assert not pub.is_alive(), "publish blocked by a dead NCCL receiver"
        assert time.monotonic() - t0 < 4 * cfg.timeout_s + 10  # the bounded wait, not the watchdog's 2*timeout+30
        assert result["o"].evicted in ({"victim": "timeout"}, {"victim": "disconnected"})  # its death seen by its connection, or its silence
        # the trainer is alive and the plane works again with a new member
        fresh = spawn(cfg, "fresh", sender.endpoint, tmp_path / "fresh.jsonl", gpu=1)
        procs.append(fresh)
        sender.wait_for(1, timeout_s=120)
        out = sender.publish(state(2).items(), 2)
        assert out.completed == ["fresh"] and fresh.wait(60) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        sender.close()
    (rec,) = records(tmp_path / "fresh.jsonl")
    assert rec["received"] == 2 and rec["digest"] == digests(state(2))


@pytest.mark.timeout(180)
def test_cuda_ipc_with_a_bare_cuda_device(tmp_path):
    cfg = WeightsConfig(backend="cuda_ipc", device="cuda", bucket_size_mb=0.5, timeout_s=30, checksum=True)
    sender = Sender(cfg)
    proc = spawn(cfg, "r0", sender.endpoint, tmp_path / "r0.jsonl", gpu=torch.cuda.current_device())
    try:
        sender.wait_for(1, timeout_s=120)
        out = sender.publish(state(3).items(), 1)
        assert out.completed == ["r0"] and out.buckets > 4 and proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        sender.close()
    (rec,) = records(tmp_path / "r0.jsonl")
    assert rec["digest"] == digests(state(3))


@pytest.mark.timeout(180)
def test_nixl_between_gpu_buffers_is_byte_exact_over_reused_buckets(tmp_path):
    pytest.importorskip(f"nixl_cu{(torch.version.cuda or '12').split('.')[0]}")  # the wheel setup.sh installs
    cfg = WeightsConfig(backend="nixl", device="cuda", bucket_size_mb=0.25, timeout_s=30, checksum=True)
    sender = Sender(cfg)
    proc = spawn(cfg, "r0", sender.endpoint, tmp_path / "r0.jsonl", gpu=torch.cuda.current_device(), updates=2)
    try:
        sender.wait_for(1, timeout_s=120)
        for v in (1, 2):  # ~3 MiB through two 0.25 MiB slots: every slot and the landing buffer reused many times
            out = sender.publish(state(10 + v).items(), v)
            assert out.completed == ["r0"] and not out.evicted and out.buckets > 8
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        sender.close()
    first, second = records(tmp_path / "r0.jsonl")
    assert first["digest"] == digests(state(11)) and second["digest"] == digests(state(12))


@pytest.mark.timeout(120)
@TWO_GPUS
def test_the_packing_thread_works_on_the_callers_gpu():
    from checkpoint_engine import Receiver

    torch.cuda.set_device(1)  # as torchrun's LOCAL_RANK=1 does
    cfg = WeightsConfig(backend="local", bucket_size_mb=0.5, timeout_s=30)
    sender = Sender(cfg)
    rx = Receiver(cfg, "r0", endpoint=sender.endpoint)
    seen: list[int] = []
    got: dict = {}

    def tensors():  # consumed on the sender's packing thread
        for k, v in state(4, "cuda:1").items():
            seen.append(torch.cuda.current_device())
            yield k, torch.empty_like(v, device="cuda").copy_(v)  # `cuda` is the packing thread's current device

    t = threading.Thread(target=lambda: got.update(dict(rx.receive(timeout_s=60))), daemon=True)
    t.start()
    try:
        sender.wait_for(1, timeout_s=30)
        sender.publish(tensors(), 1)
        t.join(60)
    finally:
        rx.close()
        sender.close()
        torch.cuda.set_device(0)
    assert set(seen) == {1}
    assert digests(got) == digests(state(4))


def test_setup_installed_cuda_torch_and_the_nixl_of_its_cuda_major():
    import importlib

    assert torch.version.cuda, f"torch {torch.__version__} is a CPU build"
    importlib.import_module(f"nixl_cu{torch.version.cuda.split('.')[0]}")
