"""The `nccl` backend: the gloo code path with device buckets, one GPU per process (NCCL
refuses two ranks on one GPU). Needs >= 2 CUDA devices; CPU machines skip it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from checkpoint_engine import Sender, WeightsConfig

from .test_ckpt_processes import PROC, ROOT, digests, records, state

pytestmark = pytest.mark.gpu


@pytest.mark.timeout(120)
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="needs 2 CUDA devices")
def test_nccl_publish_to_a_receiver_on_another_gpu(tmp_path: Path):
    cfg = WeightsConfig(backend="nccl", device="cuda:0", bucket_size_mb=1, timeout_s=30)
    sender = Sender(cfg)
    out = tmp_path / "r0.jsonl"
    rcfg = dict(asdict(cfg), device="cuda:1")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, str(PROC), "--config", json.dumps(rcfg), "--id", "r0",
                             "--endpoint", sender.endpoint, "--out", str(out)], env=env)
    try:
        sender.wait_for(1, timeout_s=60)
        sd = {k: v.to("cuda:0") for k, v in state(1).items()}
        result = sender.publish(sd.items(), 1)
        assert result.completed == ["r0"] and proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        sender.close()
    (rec,) = records(out)
    assert rec["received"] == 1 and rec["digest"] == digests(state(1))
