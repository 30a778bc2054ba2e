"""A producer-side arena: one buffer allocated (and registered, mapped) once, reused slot by slot.

Planes whose memory is expensive to obtain per tensor (tmpfs page faults for `shm`,
NIXL registration for `nixl`) copy each tensor into a slot of an arena that lives in the
producer. A slot is freed when the controller says every consumer group acked its
record: the controller's process sends the slot offsets to the producer's `FreeEndpoint`
(a ZeroMQ PULL socket), and `Arena.release` makes them reusable. An arena releases only
what it allocated: the exact offset, its length and the allocation's random `slot` number
(carried by the handle); anything else (a forged or replayed free) is counted in
`rejected` and frees nothing.

Trace (arena of 1 MiB, 256-byte alignment):
    alloc(300 KiB) -> (0, s1)    alloc(600 KiB) -> (307200, s2)
    alloc(200 KiB) -> waits      (only 124 KiB left)
    release(0, 300 KiB, s2) -> refused, counted (not that allocation)
    release(0, 300 KiB, s1) -> the waiter gets offset 0
"""

from __future__ import annotations

import os
import threading
import time
from typing import Callable

import numpy as np
import zmq

from plane_common import curve
from plane_common.net import endpoint
from plane_common.strict_msgpack import decoder
from transfer_queue import auth
from transfer_queue.codec import WireError, decode, pack
from transfer_queue.storage.handles import U63

_frees = decoder(list[tuple[U63, U63, U63]])
"""A free message: [[offset, nbytes, slot], ...]."""

ALIGN = 256
FREES_PER_MESSAGE = 4096
"""Slots per free message (~30 bytes each: well under a listener's frame limit, `auth.LISTEN_FRAME_BYTES`)."""


def aligned(n: int) -> int:
    return max(ALIGN, (n + ALIGN - 1) // ALIGN * ALIGN)


class Arena:
    """First-fit allocator over `buf`; `alloc` waits for frees while full (back-pressure on bytes)."""

    def __init__(self, buf: np.ndarray, what: str) -> None:
        self.buf = buf
        self.what = what
        self._free: list[tuple[int, int]] = [(0, len(buf))]  # sorted (offset, length)
        self._used: dict[int, tuple[int, int]] = {}  # offset -> (aligned length, slot number)
        self._cond = threading.Condition()
        self.rejected = 0
        """Releases that matched no live allocation exactly (refused, nothing freed)."""

    def alloc(self, n: int, timeout: float) -> tuple[int, int]:
        """(offset, slot number) of `n` bytes; the slot number must come back with the release."""
        n = aligned(n)
        if n > len(self.buf):
            raise ValueError(f"tensor of {n} bytes exceeds {self.what}={len(self.buf)}")
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for i, (off, length) in enumerate(self._free):
                    if length >= n:
                        self._free[i:i + 1] = [(off + n, length - n)] if length > n else []
                        slot = int.from_bytes(os.urandom(8), "little") >> 1
                        self._used[off] = (n, slot)
                        return off, slot
                if not self._cond.wait(max(deadline - time.monotonic(), 0)):
                    raise TimeoutError(f"arena full ({self.used} of {len(self.buf)} bytes, {self.what}) for {timeout}s")

    def release(self, off: int, nbytes: int, slot: int) -> bool:
        """Free the allocation at `off` if it is exactly (`nbytes`, `slot`); else count and refuse."""
        with self._cond:
            if self._used.get(off) != (aligned(nbytes), slot):
                self.rejected += 1
                return False
            n, _ = self._used.pop(off)
            self._free.append((off, n))
            self._free.sort()
            merged = [self._free[0]]
            for o, length in self._free[1:]:
                if merged[-1][0] + merged[-1][1] == o:
                    merged[-1] = (merged[-1][0], merged[-1][1] + length)
                else:
                    merged.append((o, length))
            self._free = merged
            self._cond.notify_all()
            return True

    @property
    def used(self) -> int:
        with self._cond:
            return sum(n for n, _ in self._used.values())


class FreeEndpoint:
    """PULL socket on a thread: each message is a msgpack list of [offset, nbytes, slot] to release.
    Malformed messages are counted in `rejected` and ignored (refused releases: `Arena.rejected`)."""

    def __init__(self, release: Callable[[int, int, int], bool], bind_host: str, secret: str = "",
                 max_frame_bytes: int = 1 << 24, max_connections: int = auth.MAX_CONNECTIONS) -> None:
        self._ctx = zmq.Context()
        self.gate = auth.Gate(self._ctx, secret, max_connections)
        sock = self.gate.server(self._ctx.socket(zmq.PULL), max_frame_bytes)
        self.address = endpoint(bind_host, self.gate.bind(sock, bind_host))
        self.rejected = 0
        self._release = release
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, args=(sock,), name="tq-arena-free", daemon=True)
        self._thread.start()

    def _loop(self, sock: zmq.Socket) -> None:
        while not self._stop.is_set():
            if not sock.poll(100):
                continue
            try:
                msg = decode(_frees, sock.recv(), 1 << 24, "free: expected a list of [offset, nbytes, slot]")
            except WireError:
                self.rejected += 1
                continue
            for off, n, slot in msg:
                self._release(off, n, slot)
        sock.close(0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.gate.close()
        self._ctx.term()


class FreeSender:
    """Sends slot offsets to producers' free endpoints (one PUSH socket per endpoint).

    Never blocks: a producer that is gone (its endpoint no longer reads) cannot reuse the
    slots anyway, so once its socket's queue is full further frees to it are dropped and
    counted in `undelivered`."""

    def __init__(self, secret: str = "", max_frame_bytes: int = 1 << 24) -> None:
        self._ctx = zmq.Context()
        self._secret, self._max_frame = secret, max_frame_bytes
        self._socks: dict[str, zmq.Socket] = {}
        self._lock = threading.Lock()
        self.undelivered = 0

    def send(self, by_endpoint: dict[str, list[list[int]]]) -> None:
        """`by_endpoint`: free address -> [[offset, nbytes, slot], ...]."""
        with self._lock:
            for addr, offs in by_endpoint.items():
                if addr not in self._socks:
                    s = curve.client(self._ctx.socket(zmq.PUSH), self._secret, self._max_frame)
                    s.setsockopt(zmq.LINGER, 2000)
                    s.connect(addr)
                    self._socks[addr] = s
                for i in range(0, len(offs), FREES_PER_MESSAGE):  # each message fits the endpoint's frame limit
                    some = offs[i:i + FREES_PER_MESSAGE]
                    try:
                        self._socks[addr].send(pack(some), zmq.NOBLOCK)
                    except zmq.Again:
                        self.undelivered += len(some)

    def close(self) -> None:
        with self._lock:
            for s in self._socks.values():
                s.close()
            self._socks.clear()
