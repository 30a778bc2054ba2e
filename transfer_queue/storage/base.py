"""Data planes: where tensor bytes live between `put` and `fetch`.

A plane writes each tensor field once and returns a *handle*: a small typed Struct
(`storage.handles`, tagged by `plane`) that the controller stores and hands to consumers.
Every handle carries `dtype`, `shape`, `nbytes` and its plane's fields, so any process
holding a handle can read or free it with a plane of the same kind.
Tensors of at most `inline_max_bytes` travel inside the handle (`InlineHandle`) and
never touch the plane: small per-record fields (a reward, a few token ids) cost no
segment, socket round trip or registration.

A plane does not know about records, groups or acks: the controller decides when a
handle is freed (every consumer group acked) and calls `free`.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from typing import Any

import numpy as np

from transfer_queue.codec import from_buffer, to_numpy
from transfer_queue.storage.handles import Handle, InlineHandle, as_handle, check_handle


UNREACHABLE_FOR = 2.0
"""`read_by_source` takes a producer that did not answer for gone this many `queue.read_timeout_s` (at least
10 s) before it asks it again."""


class StorageUnreachable(OSError):
    """A producer's bytes could not be read within `queue.read_timeout_s`: its process (a zmq storage
    unit, a nixl agent) is gone or cut off. Names the producer (`source`)."""

    def __init__(self, source: str, why: str) -> None:
        super().__init__(f"{source}: {why}")
        self.source = source


class StoragePlane(ABC):
    """Write once, read zero-copy where the plane allows, free when told."""

    kind: str = ""
    outlives_writer: bool = False
    """The bytes a process wrote stay readable after it died (shm: they are tmpfs files; zmq, nixl,
    local: they live in the writer's process). What keeps a dead server's partial samples."""
    read_timeout_s: float = 30.0
    """`queue.read_timeout_s` where the plane reads another process's bytes (`zmq`, `nixl`)."""
    delivered_bytes: int = 0
    """Tensor bytes that `read` delivered in this process, every plane together (inline ones
    included): what a process that must never receive trajectory tensors checks."""

    def __init__(self, inline_max_bytes: int = 1024, max_tensor_bytes: int = 4 << 30, secret: str = "",
                 max_frame_bytes: int = 64 << 20, max_connections: int = 256) -> None:
        self.inline_max_bytes = inline_max_bytes
        self.max_tensor_bytes = max_tensor_bytes
        self.secret = secret
        """`queue.secret`: CURVE keys of every socket this plane opens ('' for none)."""
        self.max_frame_bytes = max_frame_bytes
        """`queue.max_frame_bytes`: limit of this plane's control sockets (free endpoints)."""
        self.max_connections = max_connections
        """`queue.max_connections`: peers each listener this plane opens keeps at once."""
        self._unreachable: dict[str, tuple[float, str]] = {}
        """Producers that did not answer a read: source -> (monotonic time, why) (`read_by_source`)."""

    def check(self, h: Any) -> Handle:
        """`h` (typed) if it is a well-formed handle of this plane (or inline) that `verify` accepts; else WireError."""
        h = check_handle(h, self.kind, self.max_tensor_bytes)
        self.verify(h)
        return h

    def verify(self, h: Handle) -> None:
        """Plane-specific check that a well-formed handle refers to memory this plane's producers
        allocated, as far as this process can see (default: nothing more to see)."""

    def write(self, uid: str, tensors: dict[str, Any], inline: bool = True) -> dict[str, Handle]:
        """Store every field of one record; returns field -> handle. `inline=False`: small tensors
        are stored in the plane too (their handles then carry no bytes to whoever holds them)."""
        arrays = {}
        for name, t in tensors.items():
            arr, tag = to_numpy(t)
            if arr.nbytes > self.max_tensor_bytes:
                raise ValueError(f"field {name!r} of {uid!r}: {arr.nbytes} bytes > queue.max_tensor_bytes")
            arrays[name] = (arr, tag)
        handles = {n: _inline(a, t) for n, (a, t) in arrays.items() if inline and a.nbytes <= self.inline_max_bytes}
        big = {n: v for n, v in arrays.items() if n not in handles}
        if big:
            handles.update(self._write(uid, big))
        return handles

    def read(self, handles: list[Handle]) -> list[np.ndarray]:
        """Arrays for `handles`, in order; views of plane memory where possible."""
        out: list[np.ndarray | None] = [None] * len(handles)
        handles = [check_handle(h, self.kind, self.max_tensor_bytes, owned=False) for h in handles]
        remote = []
        for i, h in enumerate(handles):
            if isinstance(h, InlineHandle):
                out[i] = from_buffer(h, h.data, self.max_tensor_bytes)
            else:
                remote.append(i)
        if remote:
            for i, arr in zip(remote, self._read([handles[i] for i in remote])):
                out[i] = arr
        StoragePlane.delivered_bytes += sum(a.nbytes for a in out)  # type: ignore[union-attr]
        return out  # type: ignore[return-value]

    def read_by_source(self, handles: list[Handle]) -> tuple[list[np.ndarray | None], dict[str, str]]:
        """`read`, one producer (`Handle.source`) at a time: the arrays of the producers that answered
        (None for the handles of one that could not be reached: `StorageUnreachable`) and why each such
        producer failed. A host that died or is cut off then costs its own records, not the whole read.
        A producer that failed is not asked again for `UNREACHABLE_FOR` times `queue.read_timeout_s` (its
        handles fail at once, with the same reason): a dead server's records still queued (a resume after
        the servers died) cost one `queue.read_timeout_s` now and then, not one per step."""
        handles = [as_handle(h) for h in handles]
        by_source: dict[str, list[int]] = {}
        for i, h in enumerate(handles):
            by_source.setdefault(h.source, []).append(i)
        out: list[np.ndarray | None] = [None] * len(handles)
        failed: dict[str, str] = {}
        gone = self._unreachable
        now = time.monotonic()
        quiet = max(UNREACHABLE_FOR * self.read_timeout_s, 10.0)
        for source, idx in by_source.items():
            if source in gone and now - gone[source][0] < quiet:
                failed[source] = gone[source][1]
                continue
            try:
                arrays = self.read([handles[i] for i in idx])
            except StorageUnreachable as e:
                failed[source] = str(e)
                gone[source] = (time.monotonic(), str(e))
                continue
            gone.pop(source, None)
            for i, arr in zip(idx, arrays):
                out[i] = arr
        return out, failed

    def free(self, handles: list[Handle]) -> None:
        """Release the memory behind `handles` (any process may call it)."""
        mine = [h for h in map(as_handle, handles) if h.plane == self.kind]
        if mine:
            self._free(mine)

    @abstractmethod
    def _write(self, uid: str, arrays: dict[str, tuple[np.ndarray, str]]) -> dict[str, Handle]: ...

    @abstractmethod
    def _read(self, handles: list[Handle]) -> list[np.ndarray]: ...

    @abstractmethod
    def _free(self, handles: list[Handle]) -> None: ...

    def address(self) -> str:
        """Where other processes reach this plane's storage unit ('' if they need none)."""
        return ""

    def backpressure(self) -> dict[str, Any]:
        """What holds this process's side of the plane back, for `asyncrl status`: `arena_waits` (writes
        that found this producer's arena full and waited for frees), `arena_wait_s` (the seconds they
        waited, waits in progress included), `arena_waiting` (writes waiting now), `undelivered_frees`
        (rows {endpoint, producer, frees}: frees this process sent that a producer did not get,
        `arena.FreeSender`). A plane without a producer arena has none of them."""
        return {"arena_waits": 0, "arena_wait_s": 0.0, "arena_waiting": 0, "undelivered_frees": []}

    def close(self) -> None:
        """Stop serving; memory still referenced by handles of other processes may be lost."""


def inline_bytes(handles: dict[str, Handle]) -> int:
    """Tensor bytes carried inside `handles` themselves (`InlineHandle`): bytes that travel
    with the metadata to whoever holds it."""
    return sum(h.nbytes for h in handles.values() if isinstance(h, InlineHandle))


def _inline(arr: np.ndarray, tag: str) -> Handle:
    return InlineHandle(dtype=tag, shape=list(arr.shape), nbytes=int(arr.nbytes), data=arr.tobytes())


def handle_of(cls: type, arr: np.ndarray, tag: str, **where: Any) -> Any:
    """A handle of plane class `cls` for `arr` (dtype tag `tag`) at `where` (the plane's fields)."""
    return cls(dtype=tag, shape=list(arr.shape), nbytes=int(arr.nbytes), **where)
