"""`zmq` plane: a storage unit that holds tensors and serves them over ZeroMQ (cross host).

`ZmqStorageUnit` is the server: a ROUTER socket on one thread. PUT keeps the received
frames as they are (no copy after the kernel's), GET sends the same frames back with
`copy=False`, FREE forgets them. `ZmqStorage` is the plane that producers and consumers
use: it sends tensors as separate frames without copying them (ZeroMQ copies frames
below its `COPY_THRESHOLD`, 64 KiB, anyway) and returns arrays that are views of the
received frames.

Wire (after the ROUTER identity): [msgpack header, data frame, ...]; header `UnitRequest`
`{"op": "put"|"get"|"free"|"stats", "keys": [...]}`, reply `UnitReply`. Anything else (garbage, truncated,
too many or too big frames) is rejected, counted in `rejected`, and answered with an error.
The unit holds each key once: a `put` under a key it already holds is refused (nobody
overwrites a record's bytes), and a `free` of a key it does not hold frees nothing and is
counted. Frames over `queue.data_max_frame_bytes` close the sender's connection before they
are buffered; with `queue.secret` the unit is a CURVE server (see `transfer_queue/auth.py`).
"""

from __future__ import annotations

import itertools
import os
import threading
from typing import Annotated, Any, Literal

import msgspec
import numpy as np
import zmq

from transfer_queue import auth
from transfer_queue.codec import WireError, decode, decoder, from_buffer, pack
from transfer_queue.storage.base import StoragePlane, handle_of
from transfer_queue.storage.handles import Handle, ZmqHandle



class UnitRequest(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """The header of a storage-unit request; data frames (one per key, `put` only) follow it."""

    op: Literal["put", "get", "free", "stats"]
    keys: list[Annotated[str, msgspec.Meta(min_length=1, max_length=256)]] = []
    """Keys of this request: unique, at most the unit's `max_keys`."""


class UnitReply(msgspec.Struct, omit_defaults=True):
    """A storage unit's answer (`get`: the data frames follow it; `stats`: the counters)."""

    ok: bool
    error: str = ""
    count: int = 0
    nbytes: int = 0
    rejected: int = 0
    auth_refused: int = 0
    handshake_failed: int = 0


_requests = decoder(UnitRequest)
_replies = decoder(UnitReply)
_OK = pack(UnitReply(True))


class ZmqStorageUnit:
    """Example: `unit = ZmqStorageUnit(); plane = ZmqStorage(address=unit.address)`."""

    def __init__(self, bind_host: str = "127.0.0.1", port: int = 0, max_message_bytes: int = 16 << 20,
                 max_tensor_bytes: int = 4 << 30, secret: str = "", max_frame_bytes: int = (4 << 30) + (1 << 20),
                 max_keys: int = 1 << 16) -> None:
        self._ctx = zmq.Context()
        self.gate = auth.Gate(self._ctx, secret)
        self._sock = self.gate.server(self._ctx.socket(zmq.ROUTER), max_frame_bytes)
        self.max_keys = max_keys
        """Keys (frames) of one request at most."""
        if port:
            self._sock.bind(f"tcp://{bind_host}:{port}")
        else:
            port = self._sock.bind_to_random_port(f"tcp://{bind_host}")
        self.address = f"tcp://{bind_host}:{port}"
        self.max_message_bytes = max_message_bytes
        self._frames: dict[str, zmq.Frame] = {}
        self.rejected = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="tq-zmq-unit", daemon=True)
        self._thread.start()

    @property
    def nbytes(self) -> int:
        return sum(len(f.buffer) for f in list(self._frames.values()))

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            msg = self._sock.recv_multipart(copy=False)
            ident, rest = msg[0], msg[1:]
            try:
                reply = self._handle(rest)
            except WireError as e:
                self.rejected += 1
                reply = [pack(UnitReply(False, str(e)))]
            if reply is not None:
                self._sock.send_multipart([ident, *reply], copy=False)
        self._sock.close(0)
        self.gate.close()
        self._ctx.term()

    def _handle(self, frames: list[zmq.Frame]) -> list[Any] | None:
        if not frames:
            raise WireError("empty message")
        req = decode(_requests, frames[0].buffer, self.max_message_bytes, "storage unit header")
        keys = req.keys
        if len(keys) > self.max_keys:
            raise WireError(f"keys must be a list of at most {self.max_keys} non-empty strings of <= 256 chars")
        if len(set(keys)) != len(keys):
            raise WireError("keys: duplicates in one request")
        op, data = req.op, frames[1:]
        if op != "put" and data:
            raise WireError(f"{op}: {len(data)} unexpected data frames")
        if op == "put":
            if len(data) != len(keys):
                raise WireError(f"put: {len(keys)} keys but {len(data)} data frames")
            taken = [k for k in keys if k in self._frames]
            if taken:
                raise WireError(f"put: keys {taken[:3]} are already held (a key is written once)")
            self._frames.update(zip(keys, data))
            return [_OK]
        if op == "get":
            missing = [k for k in keys if k not in self._frames]
            if missing:
                raise WireError(f"get: unknown keys {missing[:3]}")
            return [_OK, *[self._frames[k] for k in keys]]
        if op == "free":
            unknown = [k for k in keys if k not in self._frames]
            for k in keys:
                self._frames.pop(k, None)
            if unknown:  # counted, never answered: frees are one-way
                self.rejected += 1
            return None
        return [pack(UnitReply(True, count=len(self._frames), nbytes=self.nbytes, rejected=self.rejected,
                               auth_refused=self.gate.refused, handshake_failed=self.gate.handshake_failed))]

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


class ZmqStorage(StoragePlane):
    kind = "zmq"

    def __init__(self, address: str = "", bind_host: str = "127.0.0.1", timeout_s: float = 120.0,
                 data_max_frame_bytes: int = (4 << 30) + (1 << 20), **kw) -> None:
        super().__init__(**kw)
        self.data_max_frame_bytes = data_max_frame_bytes
        self._unit: ZmqStorageUnit | None = None
        self._address = address
        """The unit this plane writes to: `address`, or (empty) its own, started on first write or `address()`,
        so a process that only reads or frees (a trainer rank, the controller) hosts none."""
        self._bind_host = bind_host
        self._unit_lock = threading.Lock()
        self._ctx = zmq.Context()
        self._local = threading.local()
        self._socks: list[zmq.Socket] = []
        self._prefix = f"{os.getpid()}-{os.urandom(4).hex()}-"
        self._ids = itertools.count()
        self._timeout_ms = int(timeout_s * 1000)

    def address(self) -> str:
        with self._unit_lock:
            if not self._address:
                self._unit = ZmqStorageUnit(self._bind_host, max_tensor_bytes=self.max_tensor_bytes, secret=self.secret,
                                            max_frame_bytes=self.data_max_frame_bytes)
                self._address = self._unit.address
        return self._address

    def _sock(self, address: str) -> zmq.Socket:
        socks = self._local.__dict__.setdefault("socks", {})
        if address not in socks:
            s = auth.client(self._ctx.socket(zmq.DEALER), self.secret, self.data_max_frame_bytes)
            s.setsockopt(zmq.LINGER, 1000)
            s.connect(address)
            socks[address] = s
            self._socks.append(s)
        return socks[address]

    def _call(self, address: str, header: UnitRequest, data: list[Any]) -> tuple[UnitReply, list[zmq.Frame]]:
        s = self._sock(address)
        s.send_multipart([pack(header), *data], copy=False)
        if not s.poll(self._timeout_ms):
            raise TimeoutError(f"zmq storage unit {address} did not answer {header.op}")
        frames = s.recv_multipart(copy=False)
        rep = decode(_replies, frames[0].buffer, 1 << 20, "storage unit reply")
        if not rep.ok:
            raise WireError(f"zmq storage unit {address}: {rep.error}")
        return rep, frames[1:]

    def _write(self, uid: str, arrays: dict[str, tuple[np.ndarray, str]]) -> dict[str, Handle]:
        keys = {name: f"{self._prefix}{next(self._ids)}" for name in arrays}
        address = self.address()
        self._call(address, UnitRequest("put", list(keys.values())), [a for a, _ in arrays.values()])
        return {n: handle_of(ZmqHandle, a, t, address=address, key=keys[n]) for n, (a, t) in arrays.items()}

    def _read(self, handles: list[Handle]) -> list[np.ndarray]:
        out: list[np.ndarray | None] = [None] * len(handles)
        by_addr: dict[str, list[int]] = {}
        for i, h in enumerate(handles):
            by_addr.setdefault(h.address, []).append(i)
        for addr, idx in by_addr.items():
            _, frames = self._call(addr, UnitRequest("get", [handles[i].key for i in idx]), [])
            for i, f in zip(idx, frames):
                out[i] = from_buffer(handles[i], f.buffer, self.max_tensor_bytes)
        return out  # type: ignore[return-value]

    def _free(self, handles: list[Handle]) -> None:
        by_addr: dict[str, list[str]] = {}
        for h in handles:
            by_addr.setdefault(h.address, []).append(h.key)
        for addr, keys in by_addr.items():
            self._sock(addr).send_multipart([pack(UnitRequest("free", keys))])

    def unit_stats(self, address: str | None = None) -> dict[str, Any]:
        """`count`, `nbytes` and `rejected` of a storage unit."""
        return msgspec.structs.asdict(self._call(address or self.address(), UnitRequest("stats"), [])[0])

    def close(self) -> None:
        for s in self._socks:
            s.close()
        self._socks.clear()
        if self._unit is not None:
            self._unit.close()
