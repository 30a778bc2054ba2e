"""What runs that are gone left in shared memory (`queue.shm_dir`, /dev/shm by default), and its removal.

A run killed (SIGKILL, an OOM kill, a lost node) cannot remove its `shm` arenas: each stays in /dev/shm,
memory held until someone deletes it. `collect` finds this user's files there by run
(`transfer_queue.storage.shm_runs.scan`: a run is live on this host while any of its processes holds its
mark or an arena) and removes those of runs that are gone and can no longer need them:

| a run that is gone, whose queue was | its files are |
|---|---|
| in memory (`queue.metadata=memory`) | removed: the queue died with its controller, a resume restores its records from the checkpoint (`async_state.msgpack`), never from these files |
| durable (`redis`), its run finished, or with no checkpoint in its run directory (or that directory gone) | removed: nothing will read them again |
| durable, with a checkpoint | kept `queue.shm_keep_s` (1 day) after its last write: a resume reads the records the queue still names from them; past that they are removed (a resume then drops those records, counted `unreadable`, and generates their groups again) |
| unknown (no mark: a run of an older version, or of a host that never held its controller) | kept `queue.shm_keep_s` after its last write, then removed |

The weight plane's `shm` slots (`asyncrl-weights-<pid>-...`, two per sender) of a sender that is gone are
removed too (a version is always sent again whole; a new `shm` sender removes them as well).

Never touched: a live run's files (its processes hold their locks), another user's files. It runs at
the start of every `asyncrl train` (a line says what it removed) and as `asyncrl status --gc`;
`asyncrl status` shows what dead runs hold (`shm_dead`).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from checkpoint_engine.backends.shm import PREFIX as WEIGHTS_PREFIX
from checkpoint_engine.backends.shm import SHM_DIR as WEIGHTS_DIR
from plane_common.liveness import held, unlink_orphan
from transfer_queue.storage.shm_runs import RunFiles, own_files, remove_dead, scan

WEIGHT_SLOTS = "weights (shm slots)"
"""The verdict on the weight plane's slots of senders that are gone (not a run)."""

KEEP_S = 86400.0
"""`queue.shm_keep_s`'s default: how long a durable run's files are kept for a resume after its last write."""


@dataclass
class Verdict:
    """One run that is gone and what `collect` does with its files."""

    run_id: str
    files: int
    bytes: int
    remove: bool
    why: str
    removed: int = 0


@dataclass
class Report:
    shm_dir: str
    dead: list[Verdict] = field(default_factory=list)
    live_runs: int = 0

    def summary(self) -> dict[str, Any]:
        """`asyncrl status`' `shm_dead`: what runs that are gone hold in `shm_dir`, and what was removed."""
        return {"dir": self.shm_dir, "runs": sum(v.run_id != WEIGHT_SLOTS for v in self.dead),
                "files": sum(v.files for v in self.dead),
                "bytes": sum(v.bytes for v in self.dead),
                "removable_bytes": sum(v.bytes for v in self.dead if v.remove),
                "removed_files": sum(v.removed for v in self.dead), "live_runs": self.live_runs,
                "kept": {v.run_id: v.why for v in self.dead if not v.remove}}

    def line(self) -> str:
        """What went and what stays, for people; empty when nothing of a run that is gone is there."""
        gone = [v for v in self.dead if v.removed]
        kept = [v for v in self.dead if not v.remove]
        out = ""
        if gone:
            runs = sum(v.run_id != WEIGHT_SLOTS for v in gone)
            whose = [f"{runs} runs that are gone"] if runs else []
            whose += ["weight slots of senders that are gone"] if runs < len(gone) else []
            out = (f"removed {sum(v.removed for v in gone)} files ({_mib(sum(v.bytes for v in gone))}) from "
                   f"{self.shm_dir}: {' and '.join(whose)}")
        if kept:
            out += ("; " if out else "") + (
                f"kept {_mib(sum(v.bytes for v in kept))} of {len(kept)} runs that are gone until queue.shm_keep_s passes "
                "(a resume may read them, or whose they are is unknown: asyncrl status --gc says which)")
        return out


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def judge(run: RunFiles, keep_s: float, now: float) -> tuple[bool, str]:
    """Whether the files of `run` (gone) are removed, and why (see the module's table)."""
    note = run.note or {}
    age = now - run.newest
    if run.note is not None and not note.get("durable", True):
        return True, "its queue was in memory"
    run_dir = note.get("run_dir")
    if run.note is not None and run_dir:
        d = Path(run_dir)
        try:
            state = json.loads((d / "status.json").read_text()).get("state")
        except (OSError, ValueError, AttributeError):
            state = None
        if state == "finished":
            return True, "its run finished"
        if not any((p / "state.json").exists() for p in (d / "checkpoints").glob("step_*")):
            return True, "no checkpoint of its run refers to them"
        if age > keep_s:
            return True, f"last written {age:.0f} s ago (queue.shm_keep_s={keep_s:g})"
        return False, f"a resume of {run_dir} may read them (kept until queue.shm_keep_s={keep_s:g} s after their last write)"
    if age > keep_s:
        return True, f"last written {age:.0f} s ago (queue.shm_keep_s={keep_s:g})"
    return False, f"a run of unknown state (kept until queue.shm_keep_s={keep_s:g} s after its last write)"


def collect(shm_dir: str = "/dev/shm", keep_s: float = KEEP_S, remove: bool = True, now: float | None = None) -> Report:
    """Judge (and with `remove`, remove) what this user's runs that are gone left in `shm_dir`."""
    now = time.time() if now is None else now
    report = Report(shm_dir)
    for run in scan(shm_dir).values():
        if run.live:
            report.live_runs += 1
            continue
        ok, why = judge(run, keep_s, now)
        v = Verdict(run.run_id, len(run.paths), run.bytes, ok, why)
        if ok and remove:
            v.removed = remove_dead(run)
        report.dead.append(v)
    if os.path.realpath(shm_dir) == os.path.realpath(WEIGHTS_DIR):
        slots = _dead_weight_slots(shm_dir)
        if slots:
            v = Verdict(WEIGHT_SLOTS, len(slots), sum(n for _, n in slots), True, "their sender is gone")
            if remove:
                v.removed = sum(unlink_orphan(p) for p, _ in slots)
            report.dead.append(v)
    return report


def at_start(shm_dir: str, keep_s: float, who: str = "") -> Report:
    """`collect` where a run's process starts (the controller, a server on its host), saying what went in
    one line when anything did."""
    report = collect(shm_dir, keep_s)
    line = report.line()
    if line:
        print(f"asyncrl: {who}{line}", flush=True)
    return report


def _dead_weight_slots(shm_dir: str) -> list[tuple[str, int]]:
    """(path, bytes held) of this user's weight slot files no live sender holds."""
    return [(e.path, st.st_blocks * 512) for e, st in own_files(shm_dir, WEIGHTS_PREFIX) if not held(e.path)]
