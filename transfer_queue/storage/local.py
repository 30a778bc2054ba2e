"""`local` plane: tensors kept in a dict of this process; the reference and test double.

A handle names a key of this object, so it is meaningless in any other process (the
config refuses `local` with a remote controller). `write` copies once (the producer may
reuse its buffers); `read` returns views of the stored arrays.
"""

from __future__ import annotations

import itertools
import threading

import numpy as np

from transfer_queue.storage.base import StoragePlane, handle_of
from transfer_queue.storage.handles import Handle, LocalHandle


class LocalStorage(StoragePlane):
    kind = "local"

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self._data: dict[str, np.ndarray] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()

    def _write(self, uid: str, arrays: dict[str, tuple[np.ndarray, str]]) -> dict[str, Handle]:
        out = {}
        with self._lock:
            for name, (arr, tag) in arrays.items():
                key = f"{next(self._ids)}"
                self._data[key] = arr.copy()
                out[name] = handle_of(LocalHandle, arr, tag, key=key)
        return out

    def _read(self, handles: list[Handle]) -> list[np.ndarray]:
        with self._lock:
            return [self._data[h.key] for h in handles]

    def _free(self, handles: list[Handle]) -> None:
        with self._lock:
            for h in handles:
                self._data.pop(h.key, None)

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(a.nbytes for a in self._data.values())
