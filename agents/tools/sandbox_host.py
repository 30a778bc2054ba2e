"""Host side of the sandbox: uids for runs, killing a run's processes, and what a fresh uid cannot read.

Job: the parent's bookkeeping around one sandboxed child (`python_sandbox.run_python`):
pick a fresh uid per run, find and SIGKILL every live process of that uid (a fork bomb's
children may have left the process group), and find the directories an interpreter
imports from that a fresh uid could not enter (the child mounts them back over an empty
tmpfs; see `_sandbox_child`), wherever the interpreter, its venv or the checkout live.
Linux only (a uid's processes are found through psutil, which reads /proc).
"""

from __future__ import annotations

import functools
import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import psutil

_UID_RANGE = (200_000, 1 << 30)  # far above real accounts; a clash between two runs is ~1e-9
_uids_in_use: set[int] = set()


def first_unreachable(path: str) -> str | None:
    """The first directory on the way to `path` that other users cannot enter, if any."""
    p = Path(path).resolve()
    for d in [*reversed(p.parents), p if p.is_dir() else p.parent]:
        if not os.stat(d).st_mode & 0o001:
            return str(d)
    return None


@functools.lru_cache(maxsize=8)
def import_roots(python: str) -> tuple[str, ...]:
    """The directories `python -I` imports from (its sys.path, .pth entries included), asked of it once.
    Not the parent's own sys.path: that holds the caller's checkout, which the sandboxed code never imports."""
    out = subprocess.run([python, "-I", "-c", "import json, sys; print(json.dumps(sys.path))"],
                         capture_output=True, text=True, timeout=30, env={"PATH": "/usr/bin:/bin"})
    if out.returncode != 0:
        raise RuntimeError(f"sandbox.python={python!r} does not start: {out.stderr.strip()[-300:]}")
    return tuple(p for p in json.loads(out.stdout) if p and os.path.isdir(p))


PRIVATE_DIRS = ["/tmp", "/var/tmp", "/dev/shm"]
"""Fresh tmpfs mounts of every run (what the code writes there is its own and gone after it)."""
EMPTY_DIRS = ["/run"]
"""Covered by an empty tmpfs (host sockets live there)."""


def exposures(python: str) -> list[tuple[str, str]]:
    """(hide, keep) pairs: directories the interpreter imports from that the run would not see, and
    what to mount back (`keep`): under a dir the run covers (a venv in a checkout under /tmp), or
    that a fresh uid could not reach (`hide`, e.g. /root or a 0700 `mktemp -d` above the venv)."""
    keeps = {*import_roots(python), str(Path(os.path.realpath(python)).parent.parent)}
    covered = [os.path.realpath(d) for d in (*PRIVATE_DIRS, *EMPTY_DIRS)]
    pairs: list[tuple[str, str]] = []
    for keep in sorted(os.path.realpath(k) for k in keeps):
        if any(keep == k or keep.startswith(k + "/") for _, k in pairs):
            continue  # inside a directory already kept
        hide = next((c for c in covered if keep.startswith(c + "/")), None) or first_unreachable(keep)
        if hide is not None and hide != keep:
            pairs.append((hide, keep))
    return pairs


def processes_of(uid: int) -> list[int]:
    """Pids of `uid`'s processes that have not exited yet (zombies hold no resources but a pid)."""
    gone = (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    return [p.pid for p in psutil.process_iter(["uids", "status"])
            if p.info["uids"] is not None and p.info["uids"].effective == uid and p.info["status"] not in gone]


def kill_uid(uid: int) -> None:
    """SIGKILL every process of `uid` until none is alive (a fork bomb races the first passes)."""
    for _ in range(200):
        pids = processes_of(uid)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.005)


def release_uid(uid: int | None) -> None:
    _uids_in_use.discard(uid)


def pick_uid() -> int:
    while True:
        uid = random.randrange(*_UID_RANGE)
        if uid not in _uids_in_use:
            _uids_in_use.add(uid)
            return uid


def kill_tree(pid: int, uid: int | None) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)  # the child leads its own session and process group
    except ProcessLookupError:
        pass
    if uid is not None:
        kill_uid(uid)
