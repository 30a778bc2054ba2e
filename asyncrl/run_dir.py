"""The run directory: resolved config, metrics, checkpoints, summary and the reward curve.

Layout of `<logging.run_root>/<run name>/`:
    config.yaml            the resolved config (every key)
    metrics.jsonl          one line per logged step (also in MLflow)
    trained_uids.jsonl     audit: the trajectory uids trained at each step
    checkpoints/step_NNNNNN/{trainer/, state.json}
    summary.json           written at the end of the run
    reward_curve.png       held-out reward against step
    status.json            heartbeat: pid, state (running / finished / failed), step, time
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

from asyncrl.config import Config, ConfigError


def resolve_run_dir(cfg: Config) -> Path:
    root = Path(cfg.logging.run_root)
    if cfg.resume:
        if cfg.logging.run_name:
            d = root / cfg.logging.run_name
            if not d.is_dir():
                raise ConfigError(f"resume: run directory {str(d)!r} does not exist (logging.run_name)")
            return d
        runs = sorted((p for p in root.glob("*") if (p / "checkpoints").is_dir()), key=lambda p: p.stat().st_mtime)
        if not runs:
            raise ConfigError(f"resume: no run with checkpoints under {str(root)!r} (set logging.run_name)")
        return runs[-1]
    name = cfg.logging.run_name or f"{cfg.trainer.mode}-{time.strftime('%Y%m%d-%H%M%S')}"
    d = root / name
    if (d / "checkpoints").is_dir() and any((d / "checkpoints").iterdir()):
        raise ConfigError(f"logging.run_name: {str(d)!r} already holds checkpoints; pass resume=true or another name")
    d.mkdir(parents=True, exist_ok=True)
    return d


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:06d}"


def latest_checkpoint(run_dir: Path) -> Path | None:
    """Newest complete checkpoint (one whose state.json was written last, after the trainer state)."""
    done = sorted(p for p in (run_dir / "checkpoints").glob("step_*") if (p / "state.json").exists())
    return done[-1] if done else None


def write_state(ckpt: Path, state: dict[str, Any]) -> None:
    tmp = ckpt / "state.json.tmp"
    tmp.write_text(json.dumps(state, indent=1))
    os.replace(tmp, ckpt / "state.json")


def prune_checkpoints(run_dir: Path, keep: int) -> None:
    done = sorted(p for p in (run_dir / "checkpoints").glob("step_*") if (p / "state.json").exists())
    for p in done[: max(len(done) - keep, 0)]:
        shutil.rmtree(p, ignore_errors=True)


def write_status(run_dir: Path, **fields: Any) -> None:
    tmp = run_dir / "status.json.tmp"
    tmp.write_text(json.dumps({"pid": os.getpid(), "time": time.time(), **fields}))
    os.replace(tmp, run_dir / "status.json")


def plot_curve(run_dir: Path, curve: list[tuple[int, float]], title: str) -> Path | None:
    """reward_curve.png from (step, held-out reward) points."""
    if not curve:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.2), dpi=100)
    ax.plot([s for s, _ in curve], [r for _, r in curve], marker="o")
    ax.set_xlabel("step")
    ax.set_ylabel("held-out reward")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path = run_dir / "reward_curve.png"
    fig.savefig(path)
    plt.close(fig)
    return path
