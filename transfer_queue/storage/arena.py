"""A producer-side arena: one buffer allocated (and registered, mapped) once, reused slot by slot.

Planes whose memory is expensive to obtain per tensor (tmpfs page faults for `shm`,
NIXL registration for `nixl`) copy each tensor into a slot of an arena that lives in the
producer. A slot is freed when the controller says every consumer group acked its
record: the controller's process sends the slot offsets to the producer's `FreeEndpoint`
(a ZeroMQ PULL socket), and `Arena.release` makes them reusable. An arena releases only
what it allocated: the exact offset, its length and the allocation's random `slot` number
(carried by the handle); anything else (a forged or replayed free) is counted in
`rejected` and frees nothing.

A full arena is back-pressure, and counted: `alloc` waits for frees (`waits`, `wait_s`, `waiting`:
what `StoragePlane.backpressure` and `asyncrl status` show), then fails naming the plane's key. The
frees themselves must arrive: `FreeSender` says, by name, which producer does not get them.

Trace (arena of 1 MiB, 256-byte alignment):
    alloc(300 KiB) -> (0, s1)    alloc(600 KiB) -> (307200, s2)
    alloc(200 KiB) -> waits      (only 124 KiB left; waits 1, waiting 1)
    release(0, 300 KiB, s2) -> refused, counted (not that allocation)
    release(0, 300 KiB, s1) -> the waiter gets offset 0 (waiting 0, wait_s grew by the wait)
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from typing import Any, Callable

import numpy as np
import zmq
from zmq.utils.monitor import recv_monitor_message

from plane_common import curve
from plane_common.net import endpoint
from plane_common.strict_msgpack import decoder
from transfer_queue import auth
from transfer_queue.codec import WireError, decode, pack
from transfer_queue.storage.handles import U63

log = logging.getLogger(__name__)
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
        """The config key that sizes the arena (`queue.shm_arena_bytes`, `queue.nixl_arena_bytes`)."""
        self._free: list[tuple[int, int]] = [(0, len(buf))]  # sorted (offset, length)
        self._used: dict[int, tuple[int, int]] = {}  # offset -> (aligned length, slot number)
        self._cond = threading.Condition()
        self.rejected = 0
        """Releases that matched no live allocation exactly (refused, nothing freed)."""
        self.waits = 0
        """Allocations that found the arena full and waited for frees."""
        self._waited_s = 0.0  # seconds of the waits that ended
        self._waiting: dict[int, float] = {}  # waits in progress: id -> monotonic start
        self._ids = itertools.count()

    def alloc(self, n: int, timeout: float) -> tuple[int, int]:
        """(offset, slot number) of `n` bytes; the slot number must come back with the release.
        Waits (counted) while the arena is full; TimeoutError after `timeout` seconds."""
        n = aligned(n)
        if n > len(self.buf):
            raise ValueError(f"tensor of {n} bytes exceeds {self.what}={len(self.buf)}")
        deadline = time.monotonic() + timeout
        wait = -1
        with self._cond:
            try:
                while True:
                    for i, (off, length) in enumerate(self._free):
                        if length >= n:
                            self._free[i:i + 1] = [(off + n, length - n)] if length > n else []
                            slot = int.from_bytes(os.urandom(8), "little") >> 1
                            self._used[off] = (n, slot)
                            return off, slot
                    if wait < 0:
                        wait = next(self._ids)
                        self._waiting[wait] = time.monotonic()
                        self.waits += 1
                    if not self._cond.wait(max(deadline - time.monotonic(), 0)):
                        raise TimeoutError(
                            f"arena full for {timeout} s: {self._held()} of {self.what}={len(self.buf)} bytes are held "
                            f"by records whose frees did not come back (not yet acked by every consumer group, or their "
                            f"frees not delivered: the freeing process logs such an endpoint); raise {self.what} if the "
                            f"records in flight need more")
            finally:
                if wait >= 0:
                    self._waited_s += time.monotonic() - self._waiting.pop(wait)

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
            return self._held()

    def _held(self) -> int:
        return sum(n for n, _ in self._used.values())

    @property
    def wait_s(self) -> float:
        """Seconds allocations waited for frees, the waits in progress included."""
        with self._cond:
            return self._wait_s()

    def _wait_s(self) -> float:
        now = time.monotonic()
        return self._waited_s + sum(now - t for t in self._waiting.values())

    @property
    def waiting(self) -> int:
        """Allocations waiting for frees now."""
        with self._cond:
            return len(self._waiting)

    def backpressure(self) -> dict[str, Any]:
        """The arena's part of `StoragePlane.backpressure` (one instant): `arena_waits`, `arena_wait_s`, `arena_waiting`."""
        with self._cond:
            return {"arena_waits": self.waits, "arena_wait_s": round(self._wait_s(), 3), "arena_waiting": len(self._waiting)}


class FreeEndpoint:
    """PULL socket on a thread: each message is a msgpack list of [offset, nbytes, slot] to release.
    Malformed messages are counted in `rejected` and ignored (refused releases: `Arena.rejected`)."""

    def __init__(self, release: Callable[[int, int, int], bool], bind_host: str, secret: str = "",
                 max_frame_bytes: int = 1 << 24, max_connections: int = auth.MAX_CONNECTIONS, port: int = 0) -> None:
        self._ctx = zmq.Context()
        self.gate = auth.Gate(self._ctx, secret, max_connections)
        sock = self.gate.server(self._ctx.socket(zmq.PULL), max_frame_bytes)
        self.address = endpoint(bind_host, self.gate.bind(sock, bind_host, port))  # port 0: any free one
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


_UP = zmq.EVENT_HANDSHAKE_SUCCEEDED
_DOWN = zmq.EVENT_DISCONNECTED
_REFUSED = zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH


class _Peer:
    """One producer's free endpoint as a `FreeSender` sees it."""

    def __init__(self, addr: str, sock: zmq.Socket, monitor: zmq.Socket, now: float) -> None:
        self.addr, self.sock, self.monitor = addr, sock, monitor
        self.producer = ""
        """Who listens there, where a caller said (a NIXL agent, an shm producer's pid)."""
        self.up = False
        """A connection to it has completed its handshake and not dropped since (the socket's monitor says)."""
        self.down_since = now
        """When it was last seen without a connection (its first free, until it connects)."""
        self.why = "no connection"
        self.pending = 0
        """Frees sent while it had no connection: queued by ZeroMQ, delivered if it connects."""
        self.dropped = 0
        """Frees dropped because its queue was full: lost, their slots never come back."""
        self.reported = False


class FreeSender:
    """Sends slot offsets to producers' free endpoints (one PUSH socket each) and says which do not get them.

    Never blocks the caller. A free that does not arrive is an error, never a silent drop: a producer
    whose frees do not come back fills its arena and its writes wait, then fail (`Arena.alloc`). A
    monitor on each socket says whether a connection is up (handshake done). Frees sent while none is
    are queued by ZeroMQ and delivered if the endpoint connects; they count as undelivered once it has
    been without a connection for `connect_grace_s` (never connected, refused, another `queue.secret`,
    gone). Frees that find its queue full (`zmq.SNDHWM` messages) are dropped and count at once. Each
    endpoint that starts failing is logged once as an error naming its address and producer (again
    after it recovered); `undelivered_by_peer` and `undelivered_frees` give the counts. Connections are
    judged on every `send` and every read of the counts: no thread of its own.

    Trace (connect_grace_s=3):
        t=0     send({A: 2 frees})       socket to A, not up yet: 2 pending
        t=0.002 A's handshake completes  up: ZeroMQ delivers the 2; nothing to report
        t=0     send({B: 1 free})        B never answers (closed port, unreachable host)
        t=3.1   send(...) or a read      B overdue: error "frees to B (shm producer pid 42) ...", {B: 1}
    """

    def __init__(self, secret: str = "", max_frame_bytes: int = 1 << 24, connect_grace_s: float = 3.0) -> None:
        self._ctx = zmq.Context()
        self._secret, self._max_frame = secret, max_frame_bytes
        self.connect_grace_s = connect_grace_s
        """Seconds an endpoint may be without a connection, frees waiting for it, before they count as undelivered."""
        self._peers: dict[str, _Peer] = {}
        self._monitors: dict[zmq.Socket, _Peer] = {}
        self._poller = zmq.Poller()
        self._lock = threading.Lock()

    def send(self, by_endpoint: dict[str, list[list[int]]], producers: dict[str, str] | None = None) -> None:
        """`by_endpoint`: free address -> [[offset, nbytes, slot], ...]; `producers`: address -> its
        producer's name, where the caller knows it (for the error line)."""
        with self._lock:
            now = time.monotonic()
            self._watch(now)
            for addr, offs in by_endpoint.items():
                peer = self._peers.get(addr) or self._connect(addr, now)
                peer.producer = (producers or {}).get(addr) or peer.producer
                for i in range(0, len(offs), FREES_PER_MESSAGE):  # each message fits the endpoint's frame limit
                    some = offs[i:i + FREES_PER_MESSAGE]
                    try:
                        peer.sock.send(pack(some), zmq.NOBLOCK)
                    except zmq.Again:
                        peer.dropped += len(some)
                        self._report(peer, "its queue is full", now)
                        continue
                    if not peer.up:
                        peer.pending += len(some)

    def _connect(self, addr: str, now: float) -> _Peer:
        sock = curve.client(self._ctx.socket(zmq.PUSH), self._secret, self._max_frame)
        sock.setsockopt(zmq.LINGER, 2000)
        monitor = sock.get_monitor_socket(_UP | _DOWN | _REFUSED)  # before connect: no event is missed
        sock.connect(addr)
        peer = self._peers[addr] = self._monitors[monitor] = _Peer(addr, sock, monitor, now)
        self._poller.register(monitor, zmq.POLLIN)
        return peer

    def _watch(self, now: float) -> None:
        """Apply the connection events that arrived, then report endpoints overdue (lock held)."""
        for monitor, _ in self._poller.poll(0):
            peer = self._monitors[monitor]
            while monitor.poll(0):
                event = recv_monitor_message(monitor, zmq.NOBLOCK)["event"]
                if event == _UP:
                    peer.up, peer.pending = True, 0
                    if peer.reported:
                        peer.reported = False
                        log.warning("frees to %s (%s) are delivered again", peer.addr, peer.producer or "its producer")
                elif event == _DOWN and peer.up:
                    peer.up, peer.down_since, peer.why = False, now, "disconnected"
                elif event & _REFUSED:
                    peer.why = "its handshake failed (another queue.secret?)"
        for peer in self._peers.values():
            if peer.pending and self._overdue(peer, now):
                self._report(peer, f"{peer.why} for {now - peer.down_since:.1f} s", now)

    def _overdue(self, peer: _Peer, now: float) -> bool:
        return not peer.up and now - peer.down_since >= self.connect_grace_s

    def _report(self, peer: _Peer, why: str, now: float) -> None:
        if peer.reported:
            return
        peer.reported = True
        log.error("frees to %s (%s) are not delivered: %s; %d frees so far. That producer's arena fills and its "
                  "writes wait: check that this host reaches that address (queue.bind_host) and shares queue.secret",
                  peer.addr, peer.producer or "its producer", why, self._undelivered(peer, now))

    def _undelivered(self, peer: _Peer, now: float) -> int:
        return peer.dropped + (peer.pending if self._overdue(peer, now) else 0)

    def undelivered_frees(self) -> list[dict[str, Any]]:
        """Rows {endpoint, producer, frees} of the endpoints with frees not delivered: dropped, or queued
        while it has been without a connection for `connect_grace_s` or longer."""
        with self._lock:
            now = time.monotonic()
            self._watch(now)
            rows = [{"endpoint": p.addr, "producer": p.producer, "frees": self._undelivered(p, now)} for p in self._peers.values()]
        return [r for r in rows if r["frees"]]

    @property
    def undelivered_by_peer(self) -> dict[str, int]:
        """Free address -> frees not delivered there (`undelivered_frees`)."""
        return {r["endpoint"]: r["frees"] for r in self.undelivered_frees()}

    @property
    def undelivered(self) -> int:
        """Frees not delivered, every endpoint together."""
        return sum(self.undelivered_by_peer.values())

    def close(self) -> None:
        """Close every socket: frees queued for a connected endpoint get `LINGER` (2 s) to leave, others none."""
        with self._lock:
            for peer in self._peers.values():
                self._poller.unregister(peer.monitor)
                peer.sock.disable_monitor()
                peer.monitor.close(0)
                peer.sock.close(2000 if peer.up else 0)
            self._peers.clear()
            self._monitors.clear()
