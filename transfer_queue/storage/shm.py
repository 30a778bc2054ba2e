"""`shm` plane: same host; the producer writes each tensor once into tmpfs, consumers map it.

Two layouts, chosen by `queue.shm_arena_bytes`:
- arena (default): each producer owns one tmpfs file, mapped once; `write` copies a
  tensor into a free slot of it (pages already faulted in after the first round, so this
  is one warm memcpy); `free` sends the slot back to the producer (see `arena.py`).
- one file per tensor (`shm_arena_bytes=0`): `write` creates `/dev/shm/tq-<run>-...`,
  `free` unlinks it. Slower (fresh tmpfs pages on every put) but a record outlives the
  producer process that wrote it.

`read` maps a file once per consumer, copy-on-write, and returns views: no copy. In the
arena layout a slot is reused once its record is acked by every consumer group, so a
view is valid until the batch is acked; copy what you keep longer. It does not use
`multiprocessing.shared_memory`, whose resource tracker unlinks segments when the
creating process exits.

Cleanup: a producer's arena file is removed when the producer closes its plane or exits
(`weakref.finalize`, which also runs at interpreter exit). A producer holds a shared `flock` on
its arena for as long as it lives (the kernel drops it when the process dies, whatever pid
namespace it ran in), so an arena is provably orphaned when an exclusive lock on it is granted:
a producer that creates its arena first removes this run's orphaned arenas of this user
(`tq-<run>-<pid>-<rand>-arena`), never another run's, a live one or another user's; it does not
when the queue's metadata is durable (`sweep_arenas=False`, the `redis` backend: records there may
still name an orphan's slots). One-file-per-tensor segments are meant to outlive their producer;
`sweep()` removes this run's (of this user, whose writer pid is gone) when asked.

Every process of a run that opens this plane holds the run's mark (`shm_runs.RunMark`), so that what a
run that is gone left here can be told from a live run's (`shm_runs.scan`).
"""

from __future__ import annotations

import errno
import fcntl
import itertools
import mmap
import os
import stat
import threading
import weakref
from typing import Any

import numpy as np

from plane_common.liveness import pid_alive, unlink_orphan
from transfer_queue.codec import WireError, check_header
from transfer_queue.config import new_run_id
from transfer_queue.storage.arena import Arena, FreeEndpoint, FreeSender
from transfer_queue.storage.base import StoragePlane, StorageUnreachable, handle_of
from transfer_queue.storage.handles import Handle, ShmHandle, shm_source
from transfer_queue.storage.shm_runs import RunMark, own_files


class ShmStorage(StoragePlane):
    kind = "shm"
    outlives_writer = True  # a file per tensor stays until freed; an arena until a sweep finds its producer gone

    def __init__(self, shm_dir: str = "/dev/shm", run_id: str | None = None, arena_bytes: int = 1 << 30,
                 bind_host: str = "127.0.0.1", timeout_s: float = 120.0, sweep_arenas: bool = True, **kw) -> None:
        super().__init__(**kw)
        self.run_id = run_id or new_run_id()
        """The queue's namespace (`queue.run_id`): its files are `tq-<run_id>-...`, and a handle of any other
        is refused. None draws one of this plane's own: give every plane of one queue the same."""
        run_id = self.run_id
        self.sweep_arenas = sweep_arenas
        """Remove this run's orphaned arenas when this producer's arena is created (not with durable metadata)."""
        self.dir = shm_dir
        self.run_prefix = f"tq-{run_id}-"
        self.prefix = f"{self.run_prefix}{os.getpid()}-{os.urandom(3).hex()}-"
        self.arena_bytes, self.bind_host, self.timeout_s = arena_bytes, bind_host, timeout_s
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._arena: Arena | None = None
        self._arena_path = ""
        self._endpoint: FreeEndpoint | None = None
        self._sender = FreeSender(self.secret, self.max_frame_bytes)
        self._maps: dict[str, mmap.mmap] = {}
        # held while the plane is open (made before the arena: at exit the arena goes first, then the mark);
        # a plane made for a directory that is not there fails at its first write
        self.mark = RunMark.hold(self.dir, run_id, {"durable": not sweep_arenas}) if os.path.isdir(self.dir) else None

    def note_run(self, note: dict[str, Any]) -> None:
        """Write `note` into the run's mark (the controller's, which knows the run directory)."""
        if self.mark is not None:
            self.mark.write(note)

    def _producer_arena(self) -> Arena:
        with self._lock:
            if self._arena is None:
                if self.sweep_arenas:
                    self.sweep(arenas_only=True)
                self._arena_path = os.path.join(self.dir, f"{self.prefix}arena")
                # made under a name no sweep matches, locked, then renamed: a sweep by a producer starting
                # at the same moment must never find it unlocked (it would take it for an orphan)
                mm, lock_fd = self._create(self._arena_path + ".new", self.arena_bytes, keep_fd=True)
                fcntl.flock(lock_fd, fcntl.LOCK_SH)  # held until this process ends: the arena is not an orphan
                os.rename(self._arena_path + ".new", self._arena_path)
                self._finalizer = weakref.finalize(self, _unlink, self._arena_path, lock_fd)
                arena = Arena(np.frombuffer(mm, dtype=np.uint8), "queue.shm_arena_bytes")
                self._endpoint = FreeEndpoint(arena.release, self.bind_host, self.secret, self.max_frame_bytes,
                                              self.max_connections)
                self._arena = arena
            return self._arena

    @staticmethod
    def _create(path: str, n: int, keep_fd: bool = False):
        """A new 0600 file of `n` bytes, mapped; with `keep_fd` also its open descriptor (the caller's)."""
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, n)
            mm = mmap.mmap(fd, n)
        except BaseException:
            os.close(fd)
            raise
        if keep_fd:
            return mm, fd
        os.close(fd)
        return mm

    def _write(self, uid: str, arrays: dict[str, tuple[np.ndarray, str]]) -> dict[str, Handle]:
        out = {}
        for name, (arr, tag) in arrays.items():
            src = arr.reshape(-1).view(np.uint8)
            if self.arena_bytes:
                arena = self._producer_arena()
                off, slot = arena.alloc(arr.nbytes, self.timeout_s)
                np.copyto(arena.buf[off:off + arr.nbytes], src)
                out[name] = handle_of(ShmHandle, arr, tag, path=self._arena_path, offset=off, slot=slot,
                                      free=self._endpoint.address)  # type: ignore[union-attr]
                continue
            path = os.path.join(self.dir, f"{self.prefix}{next(self._ids)}")
            mm = self._create(path, arr.nbytes)
            dst = np.frombuffer(mm, dtype=np.uint8)
            np.copyto(dst, src)
            del dst
            mm.close()
            out[name] = handle_of(ShmHandle, arr, tag, path=path)
        return out

    def _read(self, handles: list[Handle]) -> list[np.ndarray]:
        out = []
        for h in handles:
            path = self._path(h)
            dt, shape, n = check_header(h, self.max_tensor_bytes)
            off = h.offset or 0
            mm = self._map(path) if h.offset is not None else self._map_once(path)
            if off + n > len(mm):
                raise WireError(f"shm handle: {off}+{n} bytes outside {path} ({len(mm)} bytes)")
            out.append(np.frombuffer(mm, dtype=dt, count=n // dt.itemsize, offset=off).reshape(shape))
        return out

    def _map(self, path: str) -> mmap.mmap:
        with self._lock:
            if path not in self._maps:
                self._maps[path] = self._map_once(path)
            return self._maps[path]

    def _map_once(self, path: str) -> mmap.mmap:
        """Map the file at `path` (copy-on-write): a file of this run (its name), opened without following a
        link, a regular file of this user; else `WireError` (a forged or planted handle reads nothing)."""
        if not os.path.basename(path).startswith(self.run_prefix):
            raise WireError(f"shm handle path {path!r} is not a file of run prefix {self.run_prefix!r}")
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise WireError(f"shm handle path {path!r} is a symbolic link") from None
            if not isinstance(e, FileNotFoundError):
                raise
            # its producer ended and the files it left were removed since
            why = "the file is gone (its producer ended and what it left in shared memory was removed: queue.shm_keep_s)"
            raise StorageUnreachable(shm_source(path, path.endswith("-arena")), why) from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
                raise WireError(f"shm handle path {path!r} is not a regular file of this user")
            return mmap.mmap(fd, st.st_size, access=mmap.ACCESS_COPY)
        finally:
            os.close(fd)

    def verify(self, h: Handle) -> None:
        """The file exists under `shm_dir` with this run's prefix, is a regular file of ours, and
        holds the bytes the handle names (the whole file, or the slot inside the arena)."""
        if h.plane == "inline":
            return
        path = self._path(h)
        if not os.path.basename(path).startswith(self.run_prefix):
            raise WireError(f"shm handle path {path!r} is not a file of run prefix {self.run_prefix!r}")
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            raise WireError(f"shm handle path {path!r} does not exist") from None
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            raise WireError(f"shm handle path {path!r} is not a regular file of this user")
        if h.offset is not None:
            if not path.endswith("-arena") or h.offset + h.nbytes > st.st_size:
                raise WireError(f"shm handle: slot {h.offset}+{h.nbytes} is outside arena {path!r}")
        elif path.endswith("-arena") or st.st_size != h.nbytes:
            raise WireError(f"shm handle: {path!r} has {st.st_size} bytes, handle says {h.nbytes}")

    def _free(self, handles: list[Handle]) -> None:
        slots: dict[str, list[list[int]]] = {}
        producers: dict[str, str] = {}
        for h in handles:
            if h.offset is not None:
                if h.slot is not None:  # a consumer's copy (no free capability) frees nothing
                    slots.setdefault(h.free, []).append([h.offset, h.nbytes, h.slot])
                    producers[h.free] = self._producer(h.path)
                continue
            if self._path(h).endswith("-arena"):
                continue  # an arena is removed by its producer only
            try:
                os.unlink(self._path(h))
            except FileNotFoundError:  # freed twice (a late duplicate): nothing left to do
                pass
        if slots:
            self._sender.send(slots, producers)

    def _producer(self, path: str) -> str:
        """Who owns the arena at `path`, for a free that does not reach it: its pid (`tq-<run>-<pid>-...`)."""
        name = os.path.basename(path)
        pid = name[len(self.run_prefix):].split("-", 1)[0] if name.startswith(self.run_prefix) else ""
        return f"shm producer pid {pid}" if pid.isdigit() else f"shm arena {path}"

    def _path(self, h: Handle) -> str:
        path = h.path
        if os.path.dirname(path) != self.dir or not os.path.basename(path).startswith("tq-"):
            raise WireError(f"shm handle path {path!r} is outside {self.dir}/tq-*")
        return path

    def arena_used(self) -> int:
        """Bytes of this producer's arena held by records not yet freed."""
        return self._arena.used if self._arena is not None else 0

    def backpressure(self) -> dict[str, Any]:
        """This producer's arena waits (`queue.shm_arena_bytes`) and the frees this process could not deliver."""
        arena = self._arena.backpressure() if self._arena is not None else {}
        return {**super().backpressure(), **arena, "undelivered_frees": self._sender.undelivered_frees()}

    def resident_bytes(self) -> int:
        """Bytes of tmpfs held by this run's files (every producer), for the benchmark."""
        return sum(e.stat().st_blocks * 512 for e in os.scandir(self.dir) if e.name.startswith(self.run_prefix))

    def sweep(self, arenas_only: bool = False) -> int:
        """Remove this run's files, of this user, left by producers that are gone (a killed process
        cannot unlink its arena); returns how many. An arena goes only when its owner provably is
        gone (an exclusive `flock` on it is granted: its producer held a shared one while it lived);
        a one-file segment (not `arenas_only`) when the pid in its name is not alive. Call the full
        sweep when nothing of the run's queue will be read again (`arenas_only`: only arenas, whose
        slots can never be freed once their producer is gone)."""
        removed = 0
        for e, _ in own_files(self.dir, self.run_prefix):
            arena = e.name.endswith("-arena")
            if arenas_only and not arena:
                continue
            if arena:
                removed += unlink_orphan(e.path)
                continue
            pid = e.name[len(self.run_prefix):].split("-", 1)[0]
            if pid.isdigit() and not pid_alive(int(pid)):
                try:
                    os.unlink(e.path)
                    removed += 1
                except FileNotFoundError:  # another sweeper was first
                    pass
        return removed

    def close(self) -> None:
        """Stop serving frees and remove this producer's arena file (consumers keep what they mapped);
        let go of the run's mark, removed when no other process holds it and no file of the run is left."""
        if self._endpoint is not None:
            self._endpoint.close()
            self._finalizer()
        self._sender.close()
        if self.mark is not None:
            self.mark.leave()

    @property
    def rejected_frees(self) -> int:
        """Frees of this producer's arena refused: malformed, or not an allocation it made."""
        if self._endpoint is None or self._arena is None:
            return 0
        return self._endpoint.rejected + self._arena.rejected


def _unlink(path: str, fd: int = -1) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    if fd >= 0:
        os.close(fd)  # drops this producer's lock
