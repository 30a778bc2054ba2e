"""`shm`: same-host transfer through two files in /dev/shm that the sender fills once.

The sender creates and maps the two slots when it starts (removing the slot files of senders
that were killed before closing theirs: `sweep_dead`); a receiver maps them on `Begin` and copies
each bucket out (one memcpy per receiver, all receivers in parallel). The files are removed by
`close`, or when the transport is collected, or at interpreter exit (`weakref.finalize`), so only
a process killed outright (SIGKILL) leaves them, for the next sender's sweep. A receiver maps only
files of this naming scheme (`Begin.info` cannot point it elsewhere).
Plain `mmap` of a /dev/shm file is used instead of `multiprocessing.shared_memory`
because the latter's resource tracker unlinks segments when an *attaching* process
exits (Python < 3.13), which would break the sender whenever a receiver dies.
"""

from __future__ import annotations

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

SHM_DIR = "/dev/shm"
PREFIX = "asyncrl-weights-"
_NAME = re.compile(PREFIX + r"\d+-[0-9a-f]{8}-[01]")


def _map(path: str, size: int, create: bool) -> mmap.mmap:
    flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
    fd = os.open(path, flags, 0o600)
    try:
        if create:
            os.ftruncate(fd, size)
        return mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)


def _unlink(paths: list[str]) -> None:
    for p in paths:
        try:
            os.unlink(p)
        except FileNotFoundError:
            pass


def sweep_dead(prefix: str = PREFIX) -> int:
    """Remove slot files left by senders whose process is gone (killed before `close`); returns how
    many. Receivers that mapped one keep their mapping; nobody can open it again."""
    removed = 0
    for name in os.listdir(SHM_DIR):
        pid = name[len(prefix):].split("-", 1)[0] if name.startswith(prefix) else ""
        if pid.isdigit() and not _alive(int(pid)):
            try:
                os.unlink(os.path.join(SHM_DIR, name))
                removed += 1
            except FileNotFoundError:  # another sender swept it first
                pass
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


class ShmSenderTransport(SenderTransport):
    def __init__(self, config: WeightsConfig):
        super().__init__(config)
        sweep_dead()  # what killed senders left behind
        size = config.bucket_bytes
        tag = f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.paths = [os.path.join(SHM_DIR, f"{tag}-{i}") for i in range(2)]
        self._cleanup = weakref.finalize(self, _unlink, list(self.paths))  # also runs at exit
        self._maps = [_map(p, size, create=True) for p in self.paths]
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
