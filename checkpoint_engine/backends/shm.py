"""`shm`: same-host transfer through two files in /dev/shm that the sender fills once.

The sender creates and maps the two slots when it starts (removing the slot files of senders
that were killed before closing theirs: `sweep_dead`; a sender holds a shared `flock` on its slots
while it lives, so a slot file is removed only once an exclusive lock on it is granted, i.e. its
owner is provably gone, whatever pid namespace it ran in, and only a file of this user); a
receiver maps them on `Begin` and copies
each bucket out (one memcpy per receiver, all receivers in parallel). The files are removed by
`close`, or when the transport is collected, or at interpreter exit (`weakref.finalize`), so only
a process killed outright (SIGKILL) leaves them, for the next sender's sweep. A receiver maps only
files of this naming scheme (`Begin.info` cannot point it elsewhere).
Plain `mmap` of a /dev/shm file is used instead of `multiprocessing.shared_memory`
because the latter's resource tracker unlinks segments when an *attaching* process
exits (Python < 3.13), which would break the sender whenever a receiver dies.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import re
import uuid
import weakref
from typing import Any

import numpy as np
import torch

from checkpoint_engine.backends.base import ReceiverTransport, SenderTransport
from checkpoint_engine.config import WeightsConfig
from checkpoint_engine.wire import BucketMeta
from plane_common.liveness import unlink_orphan

SHM_DIR = "/dev/shm"
PREFIX = "asyncrl-weights-"
_NAME = re.compile(PREFIX + r"\d+-[0-9a-f]{8}-[01]")


def _map(path: str, size: int, create: bool, lock: list[int] | None = None) -> mmap.mmap:
    """Map `path` (`create`: a new 0600 file of `size` bytes); `lock`: keep the descriptor open there,
    holding a shared flock (the owner's mark, dropped by the kernel when the process ends). A new file is
    made under a name no sweep matches (a leading dot), locked, then linked to `path` (which must not exist)
    and its first name removed: a sweep by a sender starting at that moment finds it locked or not at all.
    Made under `path` itself, a sweep between its creation and its lock took it for an orphan and removed it
    (seen once in the suite: a receiver's open of the slot failed with FileNotFoundError)."""
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
    tmp = os.path.join(os.path.dirname(path), "." + os.path.basename(path) + ".new")
    fd = os.open(tmp if create else path, flags | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
    try:
        if lock is not None:
            fcntl.flock(fd, fcntl.LOCK_SH)
        if create:
            os.ftruncate(fd, size)
            os.link(tmp, path)
            os.unlink(tmp)
        mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        if lock is not None:
            lock.append(fd)
            fd = -1
        return mm
    except BaseException:
        if create and os.path.lexists(tmp):
            os.unlink(tmp)
        raise
    finally:
        if fd >= 0:
            os.close(fd)


def _unlink(paths: list[str], fds: list[int] | None = None) -> None:
    for p in paths:
        try:
            os.unlink(p)
        except FileNotFoundError:
            pass
    for fd in fds or []:
        os.close(fd)
    if fds:
        fds.clear()


def sweep_dead(prefix: str = PREFIX) -> int:
    """Remove slot files of this user left by senders that are gone (killed before `close`): those
    on which an exclusive flock is granted (a live sender holds a shared one); returns how many.
    Receivers that mapped one keep their mapping; nobody can open it again."""
    return sum(unlink_orphan(os.path.join(SHM_DIR, name)) for name in os.listdir(SHM_DIR) if name.startswith(prefix))


class ShmSenderTransport(SenderTransport):
    def __init__(self, config: WeightsConfig):
        super().__init__(config)
        sweep_dead()  # what killed senders left behind
        size = config.bucket_bytes
        tag = f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.paths = [os.path.join(SHM_DIR, f"{tag}-{i}") for i in range(2)]
        self._locks: list[int] = []
        self._cleanup = weakref.finalize(self, _unlink, list(self.paths), self._locks)  # also runs at exit
        self._maps = [_map(p, size, create=True, lock=self._locks) for p in self.paths]
        self.slots = [torch.from_numpy(np.frombuffer(m, dtype=np.uint8)) for m in self._maps]

    def begin_info(self) -> dict[str, Any]:
        return {"paths": self.paths, "size": self.config.bucket_bytes}

    def send(self, meta: BucketMeta) -> None:
        pass

    def close(self) -> None:
        super().close()
        for m in self._maps:
            m.close()
        self._maps = []
        self._cleanup()


class ShmReceiverTransport(ReceiverTransport):
    borrowed = True

    def __init__(self, config: WeightsConfig):
        super().__init__(config)
        self.paths: list[str] = []
        self._maps: list[mmap.mmap] = []
        self._views: list[torch.Tensor] = []

    def attach(self, info: dict[str, Any]) -> None:
        if info["paths"] == self.paths:
            return
        for p in info["paths"]:
            if os.path.dirname(p) != SHM_DIR or not _NAME.fullmatch(os.path.basename(p)):
                raise RuntimeError(f"weights.backend=shm: refusing to map {p!r} (not a sender slot)")
        self.close()
        self.paths = list(info["paths"])
        self._maps = [_map(p, info["size"], create=False) for p in self.paths]
        self._views = [torch.from_numpy(np.frombuffer(m, dtype=np.uint8)) for m in self._maps]

    def recv(self, meta: BucketMeta) -> torch.Tensor:
        return self._views[meta.slot][: meta.nbytes]

    def close(self) -> None:
        # Unmapped when the last view dies: borrowed tensors may still be alive.
        self._views = []
        self._maps = []
        self.paths = []
