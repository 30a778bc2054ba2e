"""`shm` plane: one tmpfs file per tensor; the producer writes once, consumers map it.

`write` creates `/dev/shm/tq-<run>-<pid>-<n>`, copies the tensor in (the only copy on
the whole path), and unmaps it. `read` maps the file copy-on-write: the consumer's array
is a view of the same physical pages; writing to it stays private to that consumer.
`free` unlinks the file: the pages go back to the system when the last consumer drops
its views. Same host only; no service, no lock between processes.

It does not use `multiprocessing.shared_memory`, whose resource tracker unlinks
segments when the creating process exits, i.e. before consumers read them.
"""

from __future__ import annotations

import itertools
import mmap
import os

import numpy as np

from transfer_queue.codec import WireError, check_header
from transfer_queue.storage.base import Handle, StoragePlane, handle_of


class ShmStorage(StoragePlane):
    kind = "shm"

    def __init__(self, shm_dir: str = "/dev/shm", run_id: str = "default", **kw) -> None:
        super().__init__(**kw)
        self.dir = shm_dir
        self.run_prefix = f"tq-{run_id}-"
        self.prefix = f"{self.run_prefix}{os.getpid()}-{os.urandom(3).hex()}-"
        self._ids = itertools.count()

    def _write(self, uid: str, arrays: dict[str, tuple[np.ndarray, str]]) -> dict[str, Handle]:
        out = {}
        for name, (arr, tag) in arrays.items():
            path = os.path.join(self.dir, f"{self.prefix}{next(self._ids)}")
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.ftruncate(fd, arr.nbytes)
                mm = mmap.mmap(fd, arr.nbytes)
            finally:
                os.close(fd)
            dst = np.frombuffer(mm, dtype=arr.dtype, count=arr.size).reshape(arr.shape)
            np.copyto(dst, arr, casting="no")
            del dst
            mm.close()
            out[name] = handle_of(self.kind, arr, tag, path=path)
        return out

    def _read(self, handles: list[Handle]) -> list[np.ndarray]:
        out = []
        for h in handles:
            path = self._path(h)
            dt, shape, n = check_header(h, self.max_tensor_bytes)
            fd = os.open(path, os.O_RDONLY)
            try:
                if os.fstat(fd).st_size != n:
                    raise WireError(f"shm segment {path} has {os.fstat(fd).st_size} bytes, handle says {n}")
                mm = mmap.mmap(fd, n, access=mmap.ACCESS_COPY)
            finally:
                os.close(fd)
            out.append(np.frombuffer(mm, dtype=dt).reshape(shape))
        return out

    def _free(self, handles: list[Handle]) -> None:
        for h in handles:
            try:
                os.unlink(self._path(h))
            except FileNotFoundError:  # freed twice (a late duplicate): nothing left to do
                pass

    def _path(self, h: Handle) -> str:
        path = h.get("path")
        if not isinstance(path, str) or os.path.dirname(path) != self.dir or not os.path.basename(path).startswith("tq-"):
            raise WireError(f"shm handle path {path!r} is outside {self.dir}/tq-*")
        return path

    def resident_bytes(self) -> int:
        """Bytes of tmpfs held by this run's segments (every producer), for the benchmark."""
        total = 0
        for e in os.scandir(self.dir):
            if e.name.startswith(self.run_prefix):
                total += e.stat().st_blocks * 512
        return total
