"""MLflow's local store survives a run killed at any moment of its setup: the next run in the same
directory starts and logs to it.

A real `asyncrl train` (the embedded default, MLflow on, `./mlruns` in a fresh directory) is SIGKILLed
at a random moment of its first seconds, while MLflow makes its store (0 to 0.4 s after the store's
first file appears in `./mlruns`), four times over the same directory, each kill landing on what
the one before left;
then a run must finish and its MLflow run be in the store. Before `metrics.sqlite_store`, a kill in
MLflow's table migrations left a store no later run could open ("duplicate column name: step").
"""

from __future__ import annotations

import os
import random
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from asyncrl.metrics import sqlite_store

TRAIN = [sys.executable, "-m", "asyncrl.cli", "train", "trainer.total_steps=1", "trainer.eval_every=100",
         "logging.run_root=runs", "logging.progress=false"]


def _kill_in_setup(cwd: Path, delay_s: float) -> str:
    """Start a run in `cwd`, SIGKILL it `delay_s` after a new file of the store (`mlflow.db*`) appears in
    `./mlruns` (or, over a whole store, after the run's MLflow run is made); the store's files then."""
    before = set((cwd / "mlruns").glob("mlflow.db*"))
    ids = set((cwd / "runs").glob("*/mlflow_run_id"))
    proc = subprocess.Popen(TRAIN, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.time() + 120
    while (not set((cwd / "mlruns").glob("mlflow.db*")) - before and not set((cwd / "runs").glob("*/mlflow_run_id")) - ids
           and proc.poll() is None and time.time() < deadline):
        time.sleep(0.002)
    assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
    time.sleep(delay_s)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    return " ".join(sorted(p.name for p in (cwd / "mlruns").iterdir()))


@pytest.mark.timeout(400)
def test_runs_killed_during_mlflow_setup_leave_a_store_the_next_run_starts_with(tmp_path):
    rng = random.Random(int(os.environ.get("MLFLOW_KILL_SEED", time.time_ns() % 10_000)))
    delays = [round(rng.uniform(0.0, 0.4), 2) for _ in range(4)]
    left = [_kill_in_setup(tmp_path, d) for d in delays]
    out = subprocess.run(TRAIN, cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, (delays, left, out.stderr[-3000:])
    run_id = next((tmp_path / "runs").glob("*/mlflow_run_id")).read_text().strip()
    con = sqlite3.connect(tmp_path / "mlruns" / "mlflow.db")
    try:
        status = con.execute("SELECT status FROM runs WHERE run_uuid = ?", (run_id,)).fetchone()
    finally:
        con.close()
    assert status == ("FINISHED",), (delays, left)
    assert not list((tmp_path / "mlruns").glob("mlflow.db.init-*"))  # the killed runs' half-made copies are gone


def test_a_half_made_store_with_no_run_is_set_aside_and_one_with_runs_is_an_error(tmp_path, capsys):
    from asyncrl.config import ConfigError

    db, art = tmp_path / "mlflow.db", (tmp_path / "artifacts").as_uri()
    con = sqlite3.connect(db)  # what a kill in the migrations left: some tables, no alembic head
    con.execute("CREATE TABLE metrics (key VARCHAR(250), value FLOAT, step BIGINT)")
    con.commit()
    con.close()
    sqlite_store(db, art)
    aside = list(tmp_path.glob("mlflow.db.broken-*"))
    assert len(aside) == 1 and "set aside" in capsys.readouterr().err
    con = sqlite3.connect(db)
    try:
        assert con.execute("SELECT COUNT(*) FROM runs").fetchone() == (0,)  # made anew, whole
        con.execute("INSERT INTO runs (run_uuid, name, source_type, source_name, entry_point_name, user_id, status, "
                    "start_time, end_time, source_version, lifecycle_stage, artifact_uri, experiment_id) VALUES "
                    "('r1', 'r', 'LOCAL', '', '', 'u', 'FINISHED', 0, 0, '', 'active', '', 0)")
        con.execute("DROP TABLE alembic_version")  # a store with a run that MLflow cannot open any more
        con.commit()
    finally:
        con.close()
    with pytest.raises(ConfigError, match="logging.tracking_uri.*holds 1 runs"):
        sqlite_store(db, art)
    assert db.exists()  # never set aside: it holds a run
