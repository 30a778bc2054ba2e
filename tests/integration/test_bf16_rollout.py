"""`asyncrl train rollout.dtype=bfloat16 model.dtype=float32`: the embedded demo with a bfloat16 rollout engine
and a float32 trainer runs to the end (the publishes land float32 weights in the bfloat16 engine, the parity
probe passes under the 16-bit tolerance), and its trainer sees the numerical mismatch: in `sync` mode, where
every sample is on-policy, the float32 run's log-prob gap is float32 noise and the bfloat16 run's is larger."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from asyncrl.cli import main


def _train(tmp: Path, name: str, *overrides: str) -> list[dict]:
    args = ["train", "trainer.mode=sync", "trainer.total_steps=3", "trainer.prompts_per_step=8", "data.eval_size=8",
            "trainer.save_every=0", "logging.mlflow=false", "logging.progress=false", f"logging.run_root={tmp}",
            f"logging.run_name={name}", f"queue.shm_dir={tmp}", *overrides]
    assert main(args) == 0
    rows = [json.loads(ln) for ln in (tmp / name / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    return [r for r in rows if "train/mismatch/logprob_gap_mean" in r]


@pytest.mark.timeout(120)
def test_bf16_rollout_run_finishes_and_shows_its_mismatch(tmp_path: Path):
    fp32 = _train(tmp_path, "fp32")
    bf16 = _train(tmp_path, "bf16", "rollout.dtype=bfloat16", "model.dtype=float32")
    assert len(fp32) == len(bf16) == 3
    gap32 = max(r["train/mismatch/logprob_gap_mean"] for r in fp32)
    gap16 = min(r["train/mismatch/logprob_gap_mean"] for r in bf16)
    assert gap32 < 1e-5 and gap16 > 1e-4 and gap16 > 20 * gap32, (gap32, gap16)
    assert all(0 < r["weights/parity_max_abs"] <= 0.25 for r in bf16 if "weights/parity_max_abs" in r)
    resolved = (tmp_path / "bf16" / "config.yaml").read_text()
    assert "dtype: bfloat16" in resolved
