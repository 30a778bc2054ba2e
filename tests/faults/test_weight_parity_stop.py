"""A corrupted weight load in a live run: `asyncrl train` (embedded, real trainer, real torch engine,
real shm weight plane of several buckets) stops at the first publish with one line naming the
server, the version and the gap, and the run's status records it.

The fault: after the real load, the server's copy of one weight is negated (what a bucket built
from a refilled transport buffer did to vLLM's layerwise reload: weights that look plausible and
are not the trainer's)."""

import json

import pytest

from asyncrl.cli import main
from asyncrl.observe.command import main as status_main
from asyncrl.engines.torch_engine import TorchRolloutServer


def _args(tmp_path, name, *extra):
    return ["train", "configs/demo.yaml", "trainer.total_steps=4", "trainer.prompts_per_step=4", "rollout.group_size=4",
            "data.eval_size=4", "trainer.eval_every=100", "trainer.save_every=0", "trainer.minibatches=1",
            "logging.mlflow=false", "logging.progress=false", f"logging.run_root={tmp_path}/runs", f"logging.run_name={name}",
            f"model.cache_dir={tmp_path}/models", "weights.backend=shm", "weights.bucket_size_mb=0.3", *extra]


@pytest.mark.timeout(300)
def test_a_corrupted_load_stops_the_run_at_the_first_publish(tmp_path, monkeypatch, capsys):
    real = TorchRolloutServer.load_update

    async def corrupted(self, update):
        await real(self, update)
        self._params["model.layers.1.mlp.down_proj.weight"].neg_()

    monkeypatch.setattr(TorchRolloutServer, "load_update", corrupted)
    assert main(_args(tmp_path, "bad")) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    line = err.strip().splitlines()[-1]
    assert line.startswith("asyncrl: stopped: weights: server main-0 serves version 0 with log-probs ")
    assert "weights.parity_tol=0.01" in line
    run = tmp_path / "runs" / "bad"
    status = json.loads((run / "status.json").read_text())
    assert status["state"] == "failed" and status["step"] == 0 and "server main-0" in status["error"]
    assert status_main(["--run", str(run)]) == 0
    assert "server main-0 serves version 0" in capsys.readouterr().out.replace("\n", " ")


@pytest.mark.timeout(300)
def test_a_clean_run_logs_the_parity_of_every_publish(tmp_path):
    assert main(_args(tmp_path, "clean", "trainer.mode=sync")) == 0
    rows = [json.loads(l) for l in (tmp_path / "runs" / "clean" / "metrics.jsonl").read_text().splitlines()[1:]]
    assert len(rows) == 4 and all(r["weights/parity_max_abs"] <= 1e-5 for r in rows)
    assert all(r["weights/parity_max_abs/main-0"] == r["weights/parity_max_abs"] for r in rows)
    # sync: every trained token was sampled by the weights the trainer scores it with
    assert all(r["train/rollout_probs_diff_max"] <= 1e-4 and r["train/rollout_probs_diff_tokens"] > 0 for r in rows)
