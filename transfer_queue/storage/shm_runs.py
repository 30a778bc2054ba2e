"""A run's files in a shm directory, by run: its mark, what a run that is gone left, and their removal.

Every process of a run that opens the `shm` plane holds a shared `flock` on the run's mark `tq-<run>.run`
(`RunMark`; JSON: whether its metadata is `durable`, and what the application notes there, e.g. asyncrl's
run directory), and each producer one on its arena (`shm.py`), so on each host a run is provably over
there once an exclusive lock on its mark is granted. `scan` lists this user's files by run with that
verdict; `remove_dead` removes a gone run's; what to remove is the caller's choice (asyncrl:
`asyncrl.shm_gc`, at a run's start and `asyncrl status --gc`). Another user's file is never listed.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import stat
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

from plane_common.liveness import held, pid_alive, unlink_orphan


class RunMark:
    """This process's hold on its run's mark: taken by `hold`, let go at `leave` or at exit."""

    def __init__(self, fd: int, path: str, shm_dir: str, run_prefix: str) -> None:
        self._fd, self._lock = fd, threading.Lock()
        self._leave = weakref.finalize(self, _leave_mark, fd, path, shm_dir, run_prefix)

    @classmethod
    def hold(cls, shm_dir: str, run_id: str, note: dict[str, Any]) -> RunMark | None:
        """Hold the mark of run `run_id` in `shm_dir`, writing `note` where it holds none yet; None where the
        mark is not this user's regular file (planted: never written through nor trusted)."""
        path = os.path.join(shm_dir, f"tq-{run_id}{MARK_SUFFIX}")
        fd = _hold_mark(path)
        if fd < 0:
            return None
        mark = cls(fd, path, shm_dir, f"tq-{run_id}-")
        if os.fstat(fd).st_size == 0:
            mark.write(note)
        return mark

    def write(self, note: dict[str, Any]) -> None:
        """Replace what the mark says by `note` (while it is held)."""
        with self._lock:
            if self._leave.alive:
                os.ftruncate(self._fd, 0)
                os.pwrite(self._fd, json.dumps(note).encode(), 0)

    def leave(self) -> None:
        """Let go of the mark (see `_leave_mark`); once."""
        with self._lock:
            self._leave()


MARK_SUFFIX = ".run"
"""`tq-<run>.run`: a run's mark in the shm directory (see the module docstring)."""

_FILE = re.compile(r"tq-(?P<run>.+)-(?P<pid>\d+)-[0-9a-f]{6}-(?P<rest>[^-]+)")
"""A plane file: `tq-<run>-<pid>-<6 hex>-arena` (`.new` while it is made) or `...-<n>` (a file per tensor)."""


def own_files(shm_dir: str, prefix: str) -> list[tuple[os.DirEntry, os.stat_result]]:
    """This user's regular files in `shm_dir` whose names start with `prefix`, with their `lstat`
    (another user's file, which root could unlink in /dev/shm, is never ours to judge or remove)."""
    out = []
    try:
        entries = list(os.scandir(shm_dir))
    except FileNotFoundError:
        return out
    for e in entries:
        if not e.name.startswith(prefix):
            continue
        try:
            st = e.stat(follow_symlinks=False)
        except FileNotFoundError:  # removed meanwhile
            continue
        if stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid():
            out.append((e, st))
    return out


def _leave_mark(fd: int, path: str, shm_dir: str, run_prefix: str) -> None:
    """Let go of the run's mark; remove it when no one else holds it and no file of the run is left."""
    os.close(fd)
    try:
        left = any(e.name.startswith(run_prefix) for e in os.scandir(shm_dir))
    except FileNotFoundError:  # the directory went first
        return
    if not left:
        unlink_orphan(path)


def _hold_mark(path: str) -> int:
    """An open descriptor of the mark at `path` (made 0600 if absent), shared-locked; -1 where it is
    not this user's regular file (never written through nor trusted). A mark removed between its
    open and its lock (its last holder left) is made again."""
    for _ in range(8):
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError:  # a link planted there, or a directory we may not write
            return -1
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            os.close(fd)
            return -1
        fcntl.flock(fd, fcntl.LOCK_SH)
        try:
            if os.path.samestat(st, os.lstat(path)):
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)
    return -1


@dataclass
class RunFiles:
    """One run's files in a shm directory, of this user (`scan`)."""

    run_id: str
    live: bool = False
    """A process of the run holds its mark or an arena of it, or the pid of a file per tensor lives."""
    note: dict[str, Any] | None = None
    """What its mark says (None: no mark, or one that does not parse)."""
    paths: list[str] = field(default_factory=list)
    """Its files, the mark last."""
    bytes: int = 0
    """Memory they hold (allocated blocks: an arena is sparse)."""
    newest: float = 0.0
    """The newest modification time among them."""


def scan(shm_dir: str = "/dev/shm") -> dict[str, RunFiles]:
    """This user's plane files in `shm_dir` by run, each run judged live or not on this host (reads only;
    another user's files are never listed)."""
    runs: dict[str, RunFiles] = {}
    marks = []
    for e, st in own_files(shm_dir, "tq-"):
        if e.name.endswith(MARK_SUFFIX):
            marks.append((e, st))
            continue
        m = _FILE.fullmatch(e.name)
        if m is None:
            continue
        run = runs.setdefault(m["run"], RunFiles(m["run"]))
        if m["rest"] == "arena":
            run.live |= held(e.path)
        elif m["rest"] == "arena.new" or m["rest"].isdigit():  # being made, or a file per tensor: its writer's pid
            run.live |= pid_alive(int(m["pid"]))
        else:
            continue
        run.paths.append(e.path)
        run.bytes += st.st_blocks * 512
        run.newest = max(run.newest, st.st_mtime)
    for e, st in marks:
        run = runs.setdefault(e.name[3:-len(MARK_SUFFIX)], RunFiles(e.name[3:-len(MARK_SUFFIX)]))
        run.live |= held(e.path)
        try:
            note = json.loads(open(e.path, "rb").read() or b"null")
            run.note = note if isinstance(note, dict) else None
        except (OSError, ValueError):
            run.note = None
        run.paths.append(e.path)
        run.bytes += st.st_blocks * 512
        run.newest = max(run.newest, st.st_mtime)
    return runs


def remove_dead(run: RunFiles) -> int:
    """Remove the files of a run `scan` found not live (each checked again as it goes: an arena only
    while no one holds it, a file per tensor only while its writer's pid is gone, the mark last and
    only unheld); returns how many went."""
    removed = 0
    for path in run.paths:
        name = os.path.basename(path)
        m = _FILE.fullmatch(name)
        if name.endswith(MARK_SUFFIX) or (m is not None and m["rest"] == "arena"):
            removed += unlink_orphan(path)
        elif m is not None and not pid_alive(int(m["pid"])):
            try:
                st = os.lstat(path)
                if stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid():
                    os.unlink(path)
                    removed += 1
            except FileNotFoundError:
                pass
    return removed
