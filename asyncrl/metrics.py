"""Metrics sink of a run: MLflow (the only module that imports mlflow) plus `metrics.jsonl`.

Every `log(step, metrics)` goes to both: MLflow for browsing (`mlflow ui`, file store
`./mlruns` by default) and a jsonl file in the run directory that tests and tools read
without MLflow. `generations(step, rows)` does the same for evaluated samples (`generations.jsonl`,
and text artifacts `generations/step_NNNNNN.jsonl`). The default store is SQLite at `./mlruns/mlflow.db` with artifacts in
`./mlruns/artifacts` (`mlflow ui --backend-store-uri sqlite:///mlruns/mlflow.db`). On resume the same MLflow run continues (its id is kept in
the run directory). That default store is private like the run directory (`run_dir.make_private`: `./mlruns` 0700,
its database 0600; `logging.shared_group` opens both to that group), and no secret reaches it (params say `<set>`).
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

import msgspec

from asyncrl.config import LoggingConfig


class Generation(msgspec.Struct, kw_only=True):
    """One evaluated sample, a line of `RUN_DIR/generations.jsonl` (and of MLflow's `generations/` artifacts).

    Texts are clipped to `rollout.host.EVAL_TEXT_CHARS` characters (head and tail kept)."""

    step: int
    """The trainer step at which the evaluation ran."""
    version: int
    """The policy version that generated the response: the last published one (the step itself when it published at this step)."""
    uid: str
    """The held-out sample (`eval-<row>`): the same prompts at every evaluation, in the same order."""
    prompt: str
    """The prompt as the model saw it (rendered by the chat template where there is one), decoded from its token ids."""
    response: str
    """The generated text, decoded."""
    answer: str
    """The reference answer the reward compared against."""
    reward: float
    finish_reason: str
    """`stop` (EOS or a stop string) or `length` (`rollout.max_tokens`)."""
    response_length: int
    """Response tokens."""


def idle_ratio(idle_s: float, wall_s: float) -> float:
    """The share of `wall_s` that a side of the pipeline (trainer waiting for a batch, rollout with
    no group generating) stood idle, in [0, 1]: `trainer/idle_ratio`, `rollout/idle_ratio` and
    `asyncrl status`' `idle_ratio`. A wall time of 0 (nothing measured yet) counts as 1 ns.

    >>> idle_ratio(1.0, 4.0), idle_ratio(5.0, 4.0), idle_ratio(0.0, 0.0)
    (0.25, 1.0, 0.0)
    """
    return min(idle_s / max(wall_s, 1e-9), 1.0)


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


class MetricsLogger:
    def __init__(self, cfg: LoggingConfig, run_dir: Path, params: dict[str, Any]) -> None:
        self.run_dir = run_dir
        self._jsonl = (run_dir / "metrics.jsonl").open("a")
        self._mlflow = None
        if cfg.mlflow:
            os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
            import mlflow

            from asyncrl.run_dir import make_private

            root = Path("mlruns").resolve()
            uri = cfg.tracking_uri
            if not uri:  # a local SQLite store with artifacts beside it in ./mlruns
                root.mkdir(exist_ok=True, mode=0o700)
                if root.stat().st_uid == os.getuid():
                    make_private(root, cfg.shared_group, umask=False, recursive=False)
                uri = f"sqlite:///{root / 'mlflow.db'}"
            mlflow.set_tracking_uri(uri)
            if mlflow.get_experiment_by_name(cfg.experiment) is None:
                art = (root / "artifacts").as_uri() if uri.startswith("sqlite:") else None
                mlflow.create_experiment(cfg.experiment, artifact_location=art)
            mlflow.set_experiment(cfg.experiment)
            if not cfg.tracking_uri:
                for p in (root / "mlflow.db", root / "artifacts"):
                    if p.exists() and p.stat().st_uid == os.getuid():
                        make_private(p, cfg.shared_group, umask=False, recursive=False)
            id_file = run_dir / "mlflow_run_id"
            run_id = id_file.read_text().strip() if id_file.exists() else None
            run = mlflow.start_run(run_id=run_id, run_name=None if run_id else run_dir.name)
            id_file.write_text(run.info.run_id)
            if run_id is None:
                # the run's secret (`queue.secret`, `weights.secret`) never reaches the tracking store
                flat = {k: "<set>" if k.endswith("secret") and v else str(v)[:500] for k, v in _flatten(params).items()}
                items = list(flat.items())
                for i in range(0, len(items), 100):
                    mlflow.log_params(dict(items[i : i + 100]))
            self._mlflow = mlflow

    def log(self, step: int, metrics: dict[str, float]) -> None:
        clean = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(float(v))}
        self._jsonl.write(json.dumps({"step": step, "time": time.time(), **clean}) + "\n")
        self._jsonl.flush()
        if self._mlflow is not None:
            self._mlflow.log_metrics(clean, step=step)

    def generations(self, step: int, rows: list[Generation]) -> None:
        """Append evaluated samples to `generations.jsonl` (one line each) and, with MLflow on, log them
        as the text artifact `generations/step_NNNNNN.jsonl`."""
        if not rows:
            return
        text = "".join(msgspec.json.encode(r).decode() + "\n" for r in rows)
        with (self.run_dir / "generations.jsonl").open("a") as f:
            f.write(text)
        if self._mlflow is not None:
            self._mlflow.log_text(text, f"generations/step_{step:06d}.jsonl")

    def artifact(self, path: Path) -> None:
        if self._mlflow is not None and path.exists():
            self._mlflow.log_artifact(str(path))

    def close(self, status: str = "FINISHED") -> None:
        self._jsonl.close()
        if self._mlflow is not None:
            self._mlflow.end_run(status=status)
            self._mlflow = None
