"""What a run shows its user: the progress line, reward_curve.png's panels, generations in jsonl and MLflow."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from asyncrl.progress import Progress


@pytest.mark.timeout(10)
def test_first_progress_line_has_no_nan(capsys: pytest.CaptureFixture[str]) -> None:
    p = Progress(10, enabled=True)  # stdout is captured, not a tty: one printed line per update
    p.update(0, {})  # before any step: no training reward, no held-out reward yet, no ETA
    p.update(0, {"eval/reward": 0.25})
    p.update(1, {"rollout/reward": 0.5, "throughput/generated_tokens_per_s": 123.4, "eval/reward": float("nan")})
    p.update(2, {"rollout/reward": 0.75})
    first, second, third, fourth = capsys.readouterr().out.strip().splitlines()
    assert "nan" not in first.lower() and "reward - eval - tok/s -" in first and first.endswith("ETA -")
    assert "eval 0.250" in second and second.endswith("ETA -")
    assert "reward 0.500 eval - tok/s 123" in third and "nan" not in third  # a non-finite value also reads '-'
    assert "reward 0.750" in fourth and fourth.rstrip("s").split("ETA ")[1].isdigit()


def _write_metrics(run: Path, steps: int, reward: float = 0.1) -> list[tuple[int, float]]:
    lines = [{"step": 0, "eval/reward": 0.0}]
    for s in range(1, steps + 1):
        lines.append({"step": s, "rollout/reward": reward * s / steps, "rollout/response_length": 10.0 + s,
                      "staleness/mean": 0.5 * (s % 3), "staleness/max": float(s % 3), **({"eval/reward": 0.05 * s} if s % 5 == 0 else {})})
    (run / "metrics.jsonl").write_text("".join(json.dumps(l) + "\n" for l in lines))
    return [(l["step"], l["eval/reward"]) for l in lines if "eval/reward" in l]


@pytest.mark.timeout(30)
def test_reward_curve_panels_for_a_10_step_run(tmp_path: Path) -> None:
    import matplotlib.pyplot as plt

    from asyncrl.run_dir import curve_figure, plot_curve

    curve = _write_metrics(tmp_path, 10)
    fig = curve_figure(tmp_path, curve, "r (fully_async)")
    ax_r, ax_l, ax_s = fig.axes
    train, held = ax_r.get_lines()
    assert list(train.get_xdata()) == list(range(1, 11)) and train.get_marker() == "o"
    assert list(held.get_xdata()) == [0, 5, 10] and held.get_marker() not in ("", "None", None)
    lo, hi = ax_r.get_ylim()
    assert -0.05 <= lo <= 0.0 and 1.0 <= hi <= 1.05  # rewards in [0, 1]: the whole [0, 1] range, not +-0.04 around a flat line
    assert ax_l.get_lines()[0].get_ydata()[-1] == 20.0 and ax_l.get_ylim()[0] == 0.0
    mean, mx = ax_s.get_lines()
    assert max(mx.get_ydata()) == 2.0 and ax_s.get_ylim()[1] > 2.0 and ax_s.get_ylim()[0] < 0.0
    plt.close(fig)
    path = plot_curve(tmp_path, curve, "r")
    assert path == tmp_path / "reward_curve.png" and path.stat().st_size > 10_000


@pytest.mark.timeout(30)
def test_reward_curve_limits_follow_rewards_outside_unit_range(tmp_path: Path) -> None:
    import matplotlib.pyplot as plt

    from asyncrl.run_dir import curve_figure

    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "rollout/reward": -2.0 + s}) + "\n" for s in range(1, 5)))
    fig = curve_figure(tmp_path, [(0, -1.5), (4, 1.5)], "t")
    lo, hi = fig.axes[0].get_ylim()
    assert lo < -1.5 and hi > 2.0
    plt.close(fig)


@pytest.mark.timeout(60)
def test_generations_go_to_jsonl_and_mlflow(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from asyncrl.config import LoggingConfig
    from asyncrl.metrics import Generation, MetricsLogger

    monkeypatch.chdir(tmp_path)  # the default MLflow store is ./mlruns
    run = tmp_path / "run"
    run.mkdir()
    log = MetricsLogger(LoggingConfig(mlflow=True, experiment="gen-test"), run, {"a": 1})
    rows = [Generation(step=3, version=3, uid=f"eval-{i}", prompt=f"<|im_start|>user\nq{i}", response=f"a{i}", answer=str(i),
                       reward=i / 2, finish_reason="stop", response_length=2) for i in range(2)]
    log.generations(3, rows)
    log.generations(3, [])  # nothing to write: no empty artifact
    run_id = (run / "mlflow_run_id").read_text()
    log.close()
    lines = [json.loads(l) for l in (run / "generations.jsonl").read_text().splitlines()]
    assert lines == [{"step": 3, "version": 3, "uid": f"eval-{i}", "prompt": f"<|im_start|>user\nq{i}", "response": f"a{i}",
                      "answer": str(i), "reward": i / 2, "finish_reason": "stop", "response_length": 2} for i in range(2)]
    import mlflow

    client = mlflow.MlflowClient()
    assert [a.path for a in client.list_artifacts(run_id, "generations")] == ["generations/step_000003.jsonl"]
    local = mlflow.artifacts.download_artifacts(run_id=run_id, artifact_path="generations/step_000003.jsonl", dst_path=str(tmp_path / "dl"))
    assert Path(local).read_text() == (run / "generations.jsonl").read_text()


@pytest.mark.timeout(30)
def test_generations_show_the_prompt_as_rendered(tmp_path: Path) -> None:
    """The logged prompt keeps the chat template's special tokens; only the first logging.num_generations samples."""
    from types import SimpleNamespace

    from asyncrl.engines.sample import Sample
    from asyncrl.config import LoggingConfig
    from asyncrl.controller import Pipeline
    from asyncrl.data.tiny_model import build_tokenizer
    from asyncrl.metrics import MetricsLogger

    tok = build_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    rendered = [f"<|im_start|>user\n{i}{i}={i}<|im_end|>\n<|im_start|>assistant\n" for i in range(3)]
    samples = [Sample(uid=f"eval-{i}", group_id=f"eval-{i}", index_in_group=0, group_size=1,
                      prompt_ids=tok(t, add_special_tokens=False)["input_ids"], answer=str(i)) for i, t in enumerate(rendered)]
    assert tok.decode(samples[0].prompt_ids, skip_special_tokens=True) != rendered[0]  # what the agents' decode would show
    run = tmp_path / "run"
    run.mkdir()
    metrics = MetricsLogger(LoggingConfig(mlflow=False), run, {})
    fake = SimpleNamespace(cfg=SimpleNamespace(logging=LoggingConfig(num_generations=2)), step=4, metrics=metrics,
                           staleness=SimpleNamespace(version=3), parts=SimpleNamespace(tokenizer=tok, eval_samples=samples))
    results = [{"reward": 1.0, "reward_info": {}, "response": "42", "finish_reason": "length", "response_length": 9}] * 3
    Pipeline._log_generations(fake, results)  # type: ignore[arg-type]
    metrics.close()
    lines = [json.loads(l) for l in (run / "generations.jsonl").read_text().splitlines()]
    assert [l["prompt"] for l in lines] == rendered[:2] and [l["uid"] for l in lines] == ["eval-0", "eval-1"]
    assert all(l["step"] == 4 and l["version"] == 3 and l["answer"] == str(i) for i, l in enumerate(lines))
