"""`zmq` plane: a storage unit that holds tensors and serves them over ZeroMQ (cross host).

`ZmqStorageUnit` is the server: a ROUTER socket on one thread. PUT keeps the received
frames as they are (no copy after the kernel's), GET sends the same frames back with
`copy=False`, FREE forgets them. `ZmqStorage` is the plane that producers and consumers
use: it sends tensors as separate frames without copying them (ZeroMQ copies frames
below its `COPY_THRESHOLD`, 64 KiB, anyway) and returns arrays that are views of the
received frames.

Wire (after the ROUTER identity): [msgpack header, data frame, ...]; header `UnitRequest`
`{"op": "put"|"get"|"free"|"stats", "keys": [...], "parts": [...], "tokens": [...]}`, reply
`UnitReply`. A tensor travels as `parts[i]` consecutive data frames (one when `parts` is absent) of
at most `auth.PART_BYTES` each: the unit is a listener, whose frames are cut small before any
handshake (`auth.LISTEN_FRAME_BYTES`); a single-part tensor is read back as a view of its frame,
a larger one is joined into one buffer (one copy). Anything else (garbage, truncated, too many or
too big frames) is rejected, counted in `rejected`, and answered with an error.
The unit holds each key once: a `put` under a key it already holds is refused (nobody
overwrites a record's bytes). A `put` is answered with one `token` per key (an HMAC of the key
under the unit's own random key): the free capability, kept in the producer's handle (and the
metadata holder's copy) but not in the copies consumers get (`handles.without_free`). A `free`
frees only keys it names with their token; a key it does not hold, or a wrong token, frees
nothing and is counted. With `queue.secret` the unit is a CURVE server (see `transfer_queue/auth.py`).
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import os
import threading
import time
from typing import Annotated, Any, Literal

import msgspec
import numpy as np
import zmq

from plane_common import curve
from plane_common.net import endpoint
from plane_common.strict_msgpack import decoder
from transfer_queue import auth
from transfer_queue.codec import WireError, decode, from_buffer, pack
from transfer_queue.storage.base import StoragePlane, StorageUnreachable, handle_of
from transfer_queue.storage.handles import Handle, ZmqHandle



class UnitRequest(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """The header of a storage-unit request; data frames (one per key, `put` only) follow it."""

    op: Literal["put", "get", "free", "stats"]
    keys: list[Annotated[str, msgspec.Meta(min_length=1, max_length=256)]] = []
    """Keys of this request: unique, at most the unit's `max_keys`."""
    parts: list[Annotated[int, msgspec.Meta(ge=1, le=1 << 24)]] = []
    """`put`: data frames of each key, in order (empty: one each)."""
    tokens: list[Annotated[bytes, msgspec.Meta(max_length=64)]] = []
    """`free`: the token the unit answered each key's `put` with."""
    rid: Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)] = 0
    """The client's number of this request, echoed in the reply: a `get` sent again (its first copy
    or its reply lost with a connection that broke) is told apart from the answer to the one before."""


class UnitReply(msgspec.Struct, omit_defaults=True):
    """A storage unit's answer (`get`: the data frames follow it; `stats`: the counters)."""

    ok: bool
    error: str = ""
    tokens: list[bytes] = []
    """`put`: the free token of each key."""
    parts: list[int] = []
    """`get`: data frames of each key, in order."""
    count: int = 0
    nbytes: int = 0
    rejected: int = 0
    auth_refused: int = 0
    handshake_failed: int = 0
    rid: int = 0
    """The request's `rid` (0: a malformed request's, or a unit that does not number replies)."""


_requests = decoder(UnitRequest)
_replies = decoder(UnitReply)
_OK = pack(UnitReply(True))


class ZmqStorageUnit:
    """Example: `unit = ZmqStorageUnit(); plane = ZmqStorage(address=unit.address)`."""

    def __init__(self, bind_host: str = "127.0.0.1", port: int = 0, max_message_bytes: int = 16 << 20,
                 max_tensor_bytes: int = 4 << 30, secret: str = "", max_frame_bytes: int = (4 << 30) + (1 << 20),
                 max_keys: int = 1 << 16, max_connections: int = auth.MAX_CONNECTIONS) -> None:
        self._ctx = zmq.Context()
        self.gate = auth.Gate(self._ctx, secret, max_connections)
        self._sock = self.gate.server(self._ctx.socket(zmq.ROUTER), max_frame_bytes)
        self.max_keys = max_keys
        """Keys of one request at most."""
        self.max_tensor_bytes = min(max_tensor_bytes, max_frame_bytes)
        """Bytes of one key (all its parts) at most."""
        port = self.gate.bind(self._sock, bind_host, port)
        self.address = endpoint(bind_host, port)
        self.max_message_bytes = max_message_bytes
        self._frames: dict[str, list[zmq.Frame]] = {}
        self._key = os.urandom(32)
        self._rid = 0
        """The `rid` of the request being handled (the loop's thread only)."""
        self.rejected = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="tq-zmq-unit", daemon=True)
        self._thread.start()

    @property
    def nbytes(self) -> int:
        return sum(len(f.buffer) for fs in list(self._frames.values()) for f in fs)

    def token(self, key: str) -> bytes:
        """The free capability of `key` (what its `put` was answered with)."""
        return hmac.new(self._key, key.encode(), hashlib.sha256).digest()[:16]

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            msg = self._sock.recv_multipart(copy=False)
            ident, rest = msg[0], msg[1:]
            self._rid = 0
            try:
                reply = self._handle(rest)
            except WireError as e:
                self.rejected += 1
                reply = [pack(UnitReply(False, str(e), rid=self._rid))]
            if reply is not None:
                self._sock.send_multipart([ident, *reply], copy=False)
        self._sock.close(0)
        self.gate.close()
        self._ctx.term()

    def _handle(self, frames: list[zmq.Frame]) -> list[Any] | None:
        if not frames:
            raise WireError("empty message")
        req = decode(_requests, frames[0].buffer, self.max_message_bytes, "storage unit header")
        self._rid = rid = req.rid
        keys = req.keys
        if len(keys) > self.max_keys:
            raise WireError(f"keys must be a list of at most {self.max_keys} non-empty strings of <= 256 chars")
        if len(set(keys)) != len(keys):
            raise WireError("keys: duplicates in one request")
        op, data = req.op, frames[1:]
        if op != "put" and data:
            raise WireError(f"{op}: {len(data)} unexpected data frames")
        if op == "put":
            counts = req.parts or [1] * len(keys)
            if len(counts) != len(keys) or len(data) != sum(counts):
                raise WireError(f"put: {len(keys)} keys in {sum(counts)} parts but {len(data)} data frames")
            taken = [k for k in keys if k in self._frames]
            if taken:
                raise WireError(f"put: keys {taken[:3]} are already held (a key is written once)")
            held, i = {}, 0
            for k, n in zip(keys, counts):
                held[k] = data[i:i + n]
                i += n
                if sum(len(f.buffer) for f in held[k]) > self.max_tensor_bytes:
                    raise WireError(f"put: key {k!r} holds more than {self.max_tensor_bytes} bytes")
            self._frames.update(held)
            return [pack(UnitReply(True, tokens=[self.token(k) for k in keys], rid=rid))]
        if op == "get":
            missing = [k for k in keys if k not in self._frames]
            if missing:
                raise WireError(f"get: unknown keys {missing[:3]}")
            return [pack(UnitReply(True, parts=[len(self._frames[k]) for k in keys], rid=rid)),
                    *[f for k in keys for f in self._frames[k]]]
        if op == "free":
            tokens = req.tokens + [b""] * (len(keys) - len(req.tokens))
            refused = False
            for k, t in zip(keys, tokens):
                if k in self._frames and hmac.compare_digest(t, self.token(k)):
                    del self._frames[k]
                else:
                    refused = True
            if refused or len(req.tokens) > len(keys):  # counted, never answered: frees are one-way
                self.rejected += 1
            return None
        return [pack(UnitReply(True, count=len(self._frames), nbytes=self.nbytes, rejected=self.rejected,
                               auth_refused=self.gate.refused, handshake_failed=self.gate.handshake_failed, rid=rid))]

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def _batches(items: list[int], sizes: list[int], limit: int = auth.LISTEN_FRAME_BYTES // 2) -> list[list[int]]:
    """`items` in consecutive runs whose `sizes` (plus msgpack's few bytes each) stay under `limit`:
    a request header must fit a listener's frame limit."""
    out: list[list[int]] = [[]]
    total = 0
    for item, n in zip(items, sizes):
        if out[-1] and total + n + 8 > limit:
            out.append([])
            total = 0
        out[-1].append(item)
        total += n + 8
    return out if out[0] else []


class ZmqStorage(StoragePlane):
    kind = "zmq"

    def __init__(self, address: str = "", bind_host: str = "127.0.0.1", timeout_s: float = 120.0,
                 data_max_frame_bytes: int = (4 << 30) + (1 << 20), read_timeout_s: float = 30.0, **kw) -> None:
        super().__init__(**kw)
        self.data_max_frame_bytes = data_max_frame_bytes
        self._unit: ZmqStorageUnit | None = None
        self._address = address
        """The unit this plane writes to: `address`, or (empty) its own, started on first write or `address()`,
        so a process that only reads or frees (a trainer rank, the controller) hosts none."""
        self.outlives_writer = bool(address)  # a unit of its own dies with this process; a separate one does not
        self._bind_host = bind_host
        self._unit_lock = threading.Lock()
        self._ctx = zmq.Context()
        self._local = threading.local()
        self._socks: list[zmq.Socket] = []
        self._prefix = f"{os.getpid()}-{os.urandom(4).hex()}-"
        self._ids = itertools.count()
        self._rids = itertools.count(1)
        self.undelivered_frees = 0
        """Keys whose free was not sent: the unit's queue here was full (the unit gone or cut off for long;
        a unit that is gone holds nothing any more)."""
        self._timeout_s = timeout_s
        self.read_timeout_s = read_timeout_s
        """`queue.read_timeout_s`: how long a `get` of another process's unit is waited for (sent again
        meanwhile) before `StorageUnreachable`."""

    def address(self) -> str:
        with self._unit_lock:
            if not self._address:
                self._unit = ZmqStorageUnit(self._bind_host, max_tensor_bytes=self.max_tensor_bytes, secret=self.secret,
                                            max_frame_bytes=self.data_max_frame_bytes,
                                            max_connections=self.max_connections)
                self._address = self._unit.address
        return self._address

    def _forget(self, address: str) -> None:
        """Drop this thread's socket to `address` with whatever it still queues (requests a dead or cut-off
        unit never took): the next call opens a fresh one, so no queue fills up to ZeroMQ's limit and
        blocks a send, and closing the plane waits for nothing."""
        s = self._local.__dict__.setdefault("socks", {}).pop(address, None)
        if s is not None:
            s.close(0)
            self._socks.remove(s)

    def _sock(self, address: str) -> zmq.Socket:
        socks = self._local.__dict__.setdefault("socks", {})
        if address in socks and socks[address].closed:  # `close` closed it (every thread's): a fresh one
            del socks[address]
        if address not in socks:
            s = curve.client(self._ctx.socket(zmq.DEALER), self.secret, self.data_max_frame_bytes)
            s.setsockopt(zmq.LINGER, 1000)
            s.connect(address)
            socks[address] = s
            self._socks.append(s)
        return socks[address]

    def _call(self, address: str, header: UnitRequest, data: list[Any], timeout_s: float | None = None,
              resend: bool = False) -> tuple[UnitReply, list[zmq.Frame]]:
        """Send `header` (and `data`) to the unit at `address` and wait for its reply, at most `timeout_s`
        (default: the plane's); `resend` (an idempotent `get`) sends the request again after 2, 4, 8 ...
        s without an answer: a request or reply lost with a connection that broke (a link down, then up)
        is asked again. Replies to earlier requests (their `rid`) are dropped. No answer in time:
        `StorageUnreachable` naming the unit."""
        s = self._sock(address)
        header.rid = next(self._rids)
        msg = [pack(header), *data]
        s.send_multipart(msg, copy=False)
        limit = self._timeout_s if timeout_s is None else timeout_s
        now = time.monotonic()
        deadline, gap = now + limit, 2.0
        again = now + gap if resend else deadline
        while True:
            wait = max(min(deadline, again) - now, 0.0)
            if s.poll(int(wait * 1000) + 1):
                frames = s.recv_multipart(copy=False)
                rep = decode(_replies, frames[0].buffer, 1 << 20, "storage unit reply")
                if rep.rid and rep.rid != header.rid:  # the answer to a request given up before, or sent twice
                    now = time.monotonic()
                    continue
                if not rep.ok:
                    raise WireError(f"zmq storage unit {address}: {rep.error}")
                return rep, frames[1:]
            now = time.monotonic()
            if now >= deadline:
                self._forget(address)
                raise StorageUnreachable(f"zmq storage unit {address}", f"no answer to {header.op} in {limit:g} s "
                                         "(its process gone, or its host cut off: queue.read_timeout_s)")
            if now >= again:
                s.send_multipart(msg, copy=False)
                gap *= 2
                again = now + gap

    def _write(self, uid: str, arrays: dict[str, tuple[np.ndarray, str]]) -> dict[str, Handle]:
        keys = {name: f"{self._prefix}{next(self._ids)}" for name in arrays}
        address = self.address()
        pieces = [auth.parts(np.ascontiguousarray(a).reshape(-1).view(np.uint8)) for a, _ in arrays.values()]
        rep, _ = self._call(address, UnitRequest("put", list(keys.values()), parts=[len(p) for p in pieces]),
                            [f for p in pieces for f in p])
        if len(rep.tokens) != len(keys):
            raise WireError(f"zmq storage unit {address}: {len(rep.tokens)} tokens for {len(keys)} keys")
        token = dict(zip(keys.values(), rep.tokens))
        return {n: handle_of(ZmqHandle, a, t, address=address, key=keys[n], token=token[keys[n]])
                for n, (a, t) in arrays.items()}

    def _read(self, handles: list[Handle]) -> list[np.ndarray]:
        out: list[np.ndarray | None] = [None] * len(handles)
        by_addr: dict[str, list[int]] = {}
        for i, h in enumerate(handles):
            by_addr.setdefault(h.address, []).append(i)
        for addr, every in by_addr.items():
            for idx in _batches(every, [len(handles[i].key) for i in every]):
                self._read_some(addr, [handles[i] for i in idx], idx, out)
        return out  # type: ignore[return-value]

    def _read_some(self, addr: str, handles: list[Handle], idx: list[int], out: list[Any]) -> None:
        """Read `handles` (all at `addr`, one request) into `out[idx]`."""
        rep, frames = self._call(addr, UnitRequest("get", [h.key for h in handles]), [], self.read_timeout_s, resend=True)
        counts = rep.parts or [1] * len(idx)
        if len(counts) != len(idx) or sum(counts) != len(frames):
            raise WireError(f"zmq storage unit {addr}: {len(frames)} data frames for parts {counts[:8]}")
        at = 0
        for h, i, n in zip(handles, idx, counts):
            mine = frames[at:at + n]
            at += n
            if n == 1:
                out[i] = from_buffer(h, mine[0].buffer, self.max_tensor_bytes)
                continue
            buf = auth.joined(mine, self.max_tensor_bytes)
            if buf is None:
                raise WireError(f"zmq storage unit {addr}: a tensor over queue.max_tensor_bytes")
            out[i] = from_buffer(h, buf, self.max_tensor_bytes)

    def _free(self, handles: list[Handle]) -> None:
        by_addr: dict[str, tuple[list[str], list[bytes]]] = {}
        for h in handles:
            keys, tokens = by_addr.setdefault(h.address, ([], []))
            keys.append(h.key)
            tokens.append(h.token or b"")  # a consumer's copy has no token: the unit refuses (and counts) it
        for addr, (keys, tokens) in by_addr.items():
            for idx in _batches(list(range(len(keys))), [len(k) + 18 for k in keys]):
                try:  # one-way, never blocking: a unit gone or cut off for long would fill the queue and hold the caller
                    self._sock(addr).send_multipart([pack(UnitRequest("free", [keys[i] for i in idx],
                                                                      tokens=[tokens[i] for i in idx]))], zmq.NOBLOCK)
                except zmq.Again:
                    self.undelivered_frees += len(idx)

    def unit_stats(self, address: str | None = None) -> dict[str, Any]:
        """`count`, `nbytes` and `rejected` of a storage unit."""
        return msgspec.structs.asdict(self._call(address or self.address(), UnitRequest("stats"), [])[0])

    def close(self) -> None:
        for s in self._socks:
            s.close()
        self._socks.clear()
        if self._unit is not None:
            self._unit.close()
