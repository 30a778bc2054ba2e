"""Non-finite gradients in a live run: `asyncrl train` (embedded, real FSDP2 step) skips such a step,
counts it, goes on, and stops after `trainer.max_bad_steps` in a row.

The fault: after the backward pass of chosen trainer steps, every gradient is set to NaN (as a
NaN in the logits or the loss would make it)."""

import json

import pytest
import torch

from asyncrl.cli import main
from asyncrl.trainer.engine import TrainerEngine


def _args(tmp_path, name, *extra):
    return ["train", "configs/demo.yaml", "trainer.total_steps=8", "trainer.prompts_per_step=4", "rollout.group_size=4",
            "data.eval_size=4", "trainer.eval_every=100", "trainer.save_every=0", "trainer.minibatches=1",
            "logging.mlflow=false", "logging.progress=false", f"logging.run_root={tmp_path}/runs", f"logging.run_name={name}",
            f"model.cache_dir={tmp_path}/models", *extra]


def _poison(monkeypatch, bad_steps):
    real = TrainerEngine.forward_backward

    def forward_backward(self, rows, **kw):
        out = real(self, rows, **kw)
        if self.step in bad_steps:
            for p in self.model.parameters():
                if p.grad is not None:
                    g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                    g.fill_(float("nan"))
        return out

    monkeypatch.setattr(TrainerEngine, "forward_backward", forward_backward)


@pytest.mark.timeout(300)
def test_a_bad_step_is_skipped_and_counted_and_the_run_finishes(tmp_path, monkeypatch):
    _poison(monkeypatch, {2, 5})
    assert main(_args(tmp_path, "skip")) == 0
    run = tmp_path / "runs" / "skip"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 8 and summary["bad_steps"] == 2
    lines = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines() if '"train/bad_step"' in l]
    assert [l["step"] for l in lines if l["train/bad_step"]] == [3, 6]  # engine steps 2 and 5 are run steps 3 and 6
    assert all(torch.isfinite(torch.tensor(l["train/loss"])) for l in lines)


@pytest.mark.timeout(300)
def test_bad_steps_in_a_row_stop_the_run_with_the_key(tmp_path, monkeypatch, capsys):
    _poison(monkeypatch, {3, 4, 5, 6})
    assert main(_args(tmp_path, "stop", "trainer.max_bad_steps=2")) == 1  # a stop on purpose: one line, no traceback
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith("asyncrl: stopped: ")
    assert "trainer.max_bad_steps=2" in err.strip().splitlines()[-1]
    status = json.loads((tmp_path / "runs" / "stop" / "status.json").read_text())
    assert status["state"] == "failed" and "max_bad_steps" in status["error"]
