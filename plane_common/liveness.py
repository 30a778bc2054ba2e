"""Whether the owner of something still lives: a pid of this host, or the process holding a file's lock.

- `pid_alive`: for pids written in file names and status files (the `shm` storage's one-file
  segments, `asyncrl status`'s run process);
- `held` / `unlink_orphan`: for files whose owner holds a shared `flock` on them while it lives (the kernel
  drops it when the process ends, in any pid namespace): the `shm` storage's arenas and the weight
  plane's `shm` slots. A file is removed only once an exclusive lock is granted, i.e. its owner is
  provably gone.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat

import psutil


def pid_alive(pid: int) -> bool:
    """Whether process `pid` of this host runs. A killed child its parent has not reaped yet is a
    zombie: not running (it holds no memory or mappings, only its pid). Another user's process we
    may not inspect counts as running."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:  # ZombieProcess included
        return False
    except psutil.AccessDenied:
        return True


def held(path: str) -> bool:
    """Whether some process holds a lock on the file at `path` (its owner lives); False for a file that
    is gone or that this user cannot open."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return True
        raise
    finally:
        os.close(fd)  # drops the probe's lock


def unlink_orphan(path: str) -> int:
    """Remove the file at `path` if it is a regular file of this user and no process holds a lock
    on it (its owner is gone): 1, else 0. Whoever mapped it keeps the mapping."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:  # gone, a link, or not ours to read
        return 0
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            return 0  # another user's file (root could unlink it in /dev/shm): never ours to remove
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                return 0  # its owner lives (maybe in another pid namespace)
            raise
        if os.path.samestat(st, os.lstat(path)):  # still the file we locked
            os.unlink(path)
            return 1
    except FileNotFoundError:  # another sweeper was first
        pass
    finally:
        os.close(fd)
    return 0
