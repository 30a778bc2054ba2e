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
import sys
import time
from pathlib import Path
from typing import Any

import msgspec

from asyncrl.config import ConfigError, LoggingConfig


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


INIT_SUFFIX = ".init-"
"""A SQLite store being created: `mlflow.db.init-<pid>-<hex>`, linked to `mlflow.db` once whole."""


def sqlite_store(db: Path, artifacts: str) -> None:
    """Make the SQLite store `db` whole or not at all: MLflow creates its tables by a long chain of
    migrations, and a run killed halfway (seen: 0.3 s into a run's first seconds) left a store that
    no later run could open (`duplicate column name: step`, `table ... already exists`). The store is
    created under a temporary name and linked into place once complete (two runs starting at once:
    the first link wins, the other's copy is dropped); temporaries of creators that died are removed.
    A store that exists but cannot be opened and holds no run (one left half-made before this) is
    set aside as `mlflow.db.broken-<time>` and made again, with a line saying so; one that holds runs
    is an error naming `logging.tracking_uri`."""
    from plane_common.liveness import pid_alive

    for p in db.parent.glob(db.name + INIT_SUFFIX + "*"):
        pid = p.name[len(db.name + INIT_SUFFIX):].split("-", 1)[0]
        if pid.isdigit() and not pid_alive(int(pid)) and p.stat().st_uid == os.getuid():
            p.unlink(missing_ok=True)
    if db.exists() and _opens(db, artifacts):
        return
    if db.exists():
        runs = _count_runs(db)
        if runs:
            raise ConfigError(f"logging.tracking_uri: the MLflow store {str(db)!r} holds {runs} runs but cannot be "
                              "opened (see the error above); repair or move it, or set logging.tracking_uri")
        aside = db.with_name(f"{db.name}.broken-{time.strftime('%Y%m%d-%H%M%S')}")
        os.replace(db, aside)
        print(f"asyncrl: {db} was an MLflow store left half-made (no run in it): set aside as {aside.name}, "
              "made anew", file=sys.stderr, flush=True)
    tmp = db.with_name(f"{db.name}{INIT_SUFFIX}{os.getpid()}-{os.urandom(3).hex()}")
    try:
        _open(tmp, artifacts)
        try:
            os.link(tmp, db)  # atomic, and never over a store another run linked first
        except FileExistsError:
            pass
    finally:
        tmp.unlink(missing_ok=True)


def _open(db: Path, artifacts: str) -> None:
    """Open (creating its tables where there are none) the SQLite store `db` as MLflow does."""
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    SqlAlchemyStore(f"sqlite:///{db}", artifacts).engine.dispose()


def _opens(db: Path, artifacts: str) -> bool:
    """Whether MLflow opens the SQLite store `db` (`_open` without raising)."""
    try:
        _open(db, artifacts)
        return True
    except Exception:  # noqa: BLE001 - any failure to open is judged by the caller
        return False


def _count_runs(db: Path) -> int:
    """Runs recorded in the SQLite store `db` (0: none, or no `runs` table)."""
    import sqlite3

    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        return int(con.execute("SELECT COUNT(*) FROM runs").fetchone()[0])
    except sqlite3.DatabaseError:
        return 0
    finally:
        con.close()


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
                sqlite_store(root / "mlflow.db", (root / "artifacts").as_uri())
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
                from asyncrl.config.io import redacted  # and a URL's password (queue.redis_url)

                flat = {k: str(v)[:500] for k, v in _flatten(redacted(params)).items()}
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
