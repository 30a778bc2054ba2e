"""`nixl` plane: the producer keeps tensors in memory registered with NIXL; consumers READ them.

The producer process owns one arena (`queue.nixl_arena_bytes`), registered once with its
NIXL agent (registration is expensive, so never per tensor). `write` copies a tensor into
a slot of the arena and returns a handle that carries everything a consumer needs: the
producer's agent name and metadata, the serialized NIXL descriptor of the slot (and its
address and length), and the ZeroMQ address where the slot is freed. `read` adds the
producer as a remote agent (once), registers one destination buffer per call and pulls
every slot of that producer with a single READ transfer (RDMA on real NICs; UCX over
shared memory or TCP between processes of one host here).

The bytes live in the producer: it must outlive the consumers' reads. `free` sends the
slot offsets to the producer's free endpoint. A NIXL agent is not thread-safe: each
plane serializes its agent calls with a lock.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import numpy as np
import zmq

from transfer_queue.codec import WireError, check_header, pack, unpack
from transfer_queue.storage.base import Handle, StoragePlane, handle_of

_ALIGN = 256


def _nixl_api():
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError:  # the CUDA-12 wheel names its module nixl_cu12
        from nixl_cu12._api import nixl_agent, nixl_agent_config
    return nixl_agent, nixl_agent_config


class Arena:
    """First-fit allocator over one registered buffer; `alloc` waits for frees when full."""

    def __init__(self, nbytes: int) -> None:
        self.buf = np.empty(nbytes, dtype=np.uint8)
        self._free: list[tuple[int, int]] = [(0, nbytes)]  # sorted (offset, length)
        self._used: dict[int, int] = {}
        self._cond = threading.Condition()

    def alloc(self, n: int, timeout: float) -> int:
        n = max(_ALIGN, (n + _ALIGN - 1) // _ALIGN * _ALIGN)
        if n > len(self.buf):
            raise ValueError(f"tensor of {n} bytes exceeds queue.nixl_arena_bytes={len(self.buf)}")
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for i, (off, length) in enumerate(self._free):
                    if length >= n:
                        self._free[i:i + 1] = [(off + n, length - n)] if length > n else []
                        self._used[off] = n
                        return off
                if not self._cond.wait(max(deadline - time.monotonic(), 0)):
                    raise TimeoutError(f"nixl arena full ({self.used} of {len(self.buf)} bytes) for {timeout}s")

    def release(self, off: int) -> None:
        with self._cond:
            n = self._used.pop(off, None)
            if n is None:
                return  # freed twice: nothing left to do
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

    @property
    def used(self) -> int:
        return sum(self._used.values())


class NixlStorage(StoragePlane):
    kind = "nixl"

    def __init__(self, arena_bytes: int = 1 << 30, backend: str = "UCX", bind_host: str = "127.0.0.1",
                 timeout_s: float = 120.0, **kw) -> None:
        super().__init__(**kw)
        self.arena_bytes, self.backend, self.bind_host, self.timeout_s = arena_bytes, backend, bind_host, timeout_s
        self.name = f"tq-{os.getpid()}-{os.urandom(4).hex()}"
        self._agent: Any = None
        self._lock = threading.Lock()  # every agent call
        self._arena: Arena | None = None
        self._meta = b""
        self._peers: set[str] = set()
        self._ctx = zmq.Context()
        self._free_addr = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._push: dict[str, zmq.Socket] = {}
        self.rejected = 0

    def _agent_(self) -> Any:
        if self._agent is None:
            nixl_agent, nixl_agent_config = _nixl_api()
            self._agent = nixl_agent(self.name, nixl_agent_config(backends=[self.backend]))
        return self._agent

    def _producer(self) -> Arena:
        """Allocate and register the arena and start the free endpoint, on first write."""
        if self._arena is None:
            arena = Arena(self.arena_bytes)
            agent = self._agent_()
            agent.register_memory(agent.get_reg_descs([(arena.buf.ctypes.data, len(arena.buf), 0, "")], "DRAM"))
            self._meta = agent.get_agent_metadata()
            sock = self._ctx.socket(zmq.PULL)
            port = sock.bind_to_random_port(f"tcp://{self.bind_host}")
            self._free_addr = f"tcp://{self.bind_host}:{port}"
            self._thread = threading.Thread(target=self._serve_frees, args=(sock,), name="tq-nixl-free", daemon=True)
            self._thread.start()
            self._arena = arena
        return self._arena

    def _serve_frees(self, sock: zmq.Socket) -> None:
        while not self._stop.is_set():
            if not sock.poll(100):
                continue
            try:
                msg = unpack(sock.recv(), 1 << 24)
                if not isinstance(msg, list) or not all(isinstance(o, int) for o in msg):
                    raise WireError("free: expected a list of offsets")
            except WireError:
                self.rejected += 1
                continue
            for off in msg:
                self._arena.release(off)  # type: ignore[union-attr]
        sock.close(0)

    def _write(self, uid: str, arrays: dict[str, tuple[np.ndarray, str]]) -> dict[str, Handle]:
        with self._lock:
            arena = self._producer()
        out = {}
        for name, (arr, tag) in arrays.items():
            off = arena.alloc(arr.nbytes, self.timeout_s)
            np.copyto(arena.buf[off:off + arr.nbytes], arr.reshape(-1).view(np.uint8))
            addr = arena.buf.ctypes.data + off
            with self._lock:
                descs = self._agent.get_serialized_descs(self._agent.get_xfer_descs([(addr, arr.nbytes, 0)], "DRAM"))
            out[name] = handle_of(self.kind, arr, tag, agent=self.name, md=self._meta, descs=descs, addr=addr,
                                  offset=off, free=self._free_addr)
        return out

    def _read(self, handles: list[Handle]) -> list[np.ndarray]:
        sizes = [check_header(h, self.max_tensor_bytes)[2] for h in handles]
        offs = np.cumsum([0] + [(n + _ALIGN - 1) // _ALIGN * _ALIGN for n in sizes])
        dst = np.empty(max(int(offs[-1]), 1), dtype=np.uint8)
        base = dst.ctypes.data
        with self._lock:
            agent = self._agent_()
            reg = agent.register_memory(agent.get_reg_descs([(base, len(dst), 0, "")], "DRAM"))
            try:
                xfers = []
                for peer in dict.fromkeys(str(h.get("agent")) for h in handles):
                    idx = [i for i, h in enumerate(handles) if h.get("agent") == peer]
                    if peer not in self._peers:
                        agent.add_remote_agent(handles[idx[0]]["md"])
                        self._peers.add(peer)
                    local = agent.get_xfer_descs([(base + int(offs[i]), sizes[i], 0) for i in idx], "DRAM")
                    remote = agent.get_xfer_descs([(int(handles[i]["addr"]), sizes[i], 0) for i in idx], "DRAM")
                    x = agent.initialize_xfer("READ", local, remote, peer, b"")
                    if agent.transfer(x) == "ERR":
                        raise RuntimeError(f"nixl READ from {peer} failed to start")
                    xfers.append((peer, x))
                deadline = time.monotonic() + self.timeout_s
                for peer, x in xfers:
                    while (state := agent.check_xfer_state(x)) != "DONE":
                        if state == "ERR" or time.monotonic() > deadline:
                            raise RuntimeError(f"nixl READ from {peer}: {state}")
                    agent.release_xfer_handle(x)
            finally:
                agent.deregister_memory(reg)
        out = []
        for h, off, n in zip(handles, offs, sizes):
            dt, shape, _ = check_header(h, self.max_tensor_bytes)
            out.append(dst[int(off):int(off) + n].view(dt).reshape(shape))
        return out

    def _free(self, handles: list[Handle]) -> None:
        by_addr: dict[str, list[int]] = {}
        for h in handles:
            by_addr.setdefault(str(h.get("free")), []).append(int(h["offset"]))
        with self._lock:
            for addr, offs in by_addr.items():
                if addr not in self._push:
                    s = self._ctx.socket(zmq.PUSH)
                    s.setsockopt(zmq.LINGER, 2000)
                    s.connect(addr)
                    self._push[addr] = s
                self._push[addr].send(pack(offs))

    def arena_used(self) -> int:
        return self._arena.used if self._arena is not None else 0

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        for s in self._push.values():
            s.close()
