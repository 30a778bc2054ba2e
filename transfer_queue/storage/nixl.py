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

import logging
import os
import threading
import time
from typing import Any

import numpy as np

from transfer_queue.codec import check_header
from transfer_queue.storage.arena import Arena, FreeEndpoint, FreeSender, aligned
from transfer_queue.storage.base import StoragePlane, StorageUnreachable, handle_of
from transfer_queue.storage.handles import Handle, NixlHandle


def _nixl_api():
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError:  # the CUDA-12 wheel names its module nixl_cu12
        from nixl_cu12._api import nixl_agent, nixl_agent_config
    if not os.environ.get("NIXL_LOG_LEVEL"):  # NIXL logs every agent at INFO on stdout
        logging.getLogger("nixl").setLevel(logging.WARNING)
    return nixl_agent, nixl_agent_config


class NixlStorage(StoragePlane):
    kind = "nixl"

    def __init__(self, arena_bytes: int = 1 << 30, backend: str = "UCX", bind_host: str = "127.0.0.1",
                 timeout_s: float = 120.0, read_timeout_s: float = 30.0, **kw) -> None:
        super().__init__(**kw)
        self.arena_bytes, self.backend, self.bind_host, self.timeout_s = arena_bytes, backend, bind_host, timeout_s
        self.read_timeout_s = read_timeout_s
        """`queue.read_timeout_s`: how long a READ from another producer's agent may take before
        `StorageUnreachable` (the producer gone or cut off)."""
        self._abandoned: list[np.ndarray] = []
        """Destination buffers of READs given up (a transfer may still land in them): kept, never reused."""
        self.name = f"tq-{os.getpid()}-{os.urandom(4).hex()}"
        self._agent: Any = None
        self._lock = threading.Lock()  # every agent call
        self._arena: Arena | None = None
        self._meta = b""
        self._peers: set[str] = set()
        self._endpoint: FreeEndpoint | None = None
        self._sender = FreeSender(self.secret, self.max_frame_bytes)

    def _agent_(self) -> Any:
        if self._agent is None:
            nixl_agent, nixl_agent_config = _nixl_api()
            self._agent = nixl_agent(self.name, nixl_agent_config(backends=[self.backend]))
        return self._agent

    def _producer(self) -> Arena:
        """Allocate and register the arena and start the free endpoint, on first write."""
        if self._arena is None:
            arena = Arena(np.empty(self.arena_bytes, dtype=np.uint8), "queue.nixl_arena_bytes")
            agent = self._agent_()
            agent.register_memory(agent.get_reg_descs([(arena.buf.ctypes.data, len(arena.buf), 0, "")], "DRAM"))
            self._meta = agent.get_agent_metadata()
            self._endpoint = FreeEndpoint(arena.release, self.bind_host, self.secret, self.max_frame_bytes,
                                              self.max_connections)
            self._arena = arena
        return self._arena

    def _write(self, uid: str, arrays: dict[str, tuple[np.ndarray, str]]) -> dict[str, Handle]:
        with self._lock:
            arena = self._producer()
        out = {}
        for name, (arr, tag) in arrays.items():
            off, slot = arena.alloc(arr.nbytes, self.timeout_s)
            np.copyto(arena.buf[off:off + arr.nbytes], arr.reshape(-1).view(np.uint8))
            addr = arena.buf.ctypes.data + off
            with self._lock:
                descs = self._agent.get_serialized_descs(self._agent.get_xfer_descs([(addr, arr.nbytes, 0)], "DRAM"))
            out[name] = handle_of(NixlHandle, arr, tag, agent=self.name, md=self._meta, descs=descs, addr=addr,
                                  offset=off, slot=slot, free=self._endpoint.address)  # type: ignore[union-attr]
        return out

    def _read(self, handles: list[Handle]) -> list[np.ndarray]:
        sizes = [check_header(h, self.max_tensor_bytes)[2] for h in handles]
        offs = np.cumsum([0] + [aligned(n) for n in sizes])
        dst = np.empty(max(int(offs[-1]), 1), dtype=np.uint8)
        base = dst.ctypes.data
        with self._lock:
            agent = self._agent_()
            reg = agent.register_memory(agent.get_reg_descs([(base, len(dst), 0, "")], "DRAM"))
            try:
                xfers = []
                for peer in dict.fromkeys(h.agent for h in handles):
                    idx = [i for i, h in enumerate(handles) if h.agent == peer]
                    if peer not in self._peers:
                        agent.add_remote_agent(handles[idx[0]].md)
                        self._peers.add(peer)
                    local = agent.get_xfer_descs([(base + int(offs[i]), sizes[i], 0) for i in idx], "DRAM")
                    remote = agent.get_xfer_descs([(handles[i].addr, sizes[i], 0) for i in idx], "DRAM")
                    x = agent.initialize_xfer("READ", local, remote, peer, b"")
                    xfers.append((peer, x))
                    if agent.transfer(x) == "ERR":
                        raise StorageUnreachable(f"nixl agent {peer}", "its READ failed to start")
                deadline = time.monotonic() + self.read_timeout_s
                for peer, x in xfers:
                    while (state := agent.check_xfer_state(x)) != "DONE":
                        if state == "ERR" or time.monotonic() > deadline:
                            raise StorageUnreachable(f"nixl agent {peer}", f"READ {state} after {self.read_timeout_s:g} s "
                                                     "(its process gone, or its host cut off: queue.read_timeout_s)")
                    agent.release_xfer_handle(x)
                xfers.clear()
            except StorageUnreachable:
                for _, x in xfers:  # a READ may still be in flight: its buffer is kept, never reused
                    try:
                        agent.release_xfer_handle(x)
                    except Exception:  # deliberate: the transfer failed already; releasing is best effort
                        pass
                self._abandoned = (self._abandoned + [dst])[-8:]
                reg = None
                raise
            finally:
                if reg is not None:
                    agent.deregister_memory(reg)
        out = []
        for h, off, n in zip(handles, offs, sizes):
            dt, shape, _ = check_header(h, self.max_tensor_bytes)
            out.append(dst[int(off):int(off) + n].view(dt).reshape(shape))
        return out

    def _free(self, handles: list[Handle]) -> None:
        slots: dict[str, list[list[int]]] = {}
        producers: dict[str, str] = {}
        for h in handles:
            if h.slot is not None:  # a consumer's copy (no free capability) frees nothing
                slots.setdefault(h.free, []).append([h.offset, h.nbytes, h.slot])
                producers[h.free] = f"nixl agent {h.agent}"
        self._sender.send(slots, producers)

    def arena_used(self) -> int:
        return self._arena.used if self._arena is not None else 0

    def backpressure(self) -> dict[str, Any]:
        """This producer's arena waits (`queue.nixl_arena_bytes`) and the frees this process could not deliver."""
        arena = self._arena.backpressure() if self._arena is not None else {}
        return {**super().backpressure(), **arena, "undelivered_frees": self._sender.undelivered_frees()}

    def close(self) -> None:
        if self._endpoint is not None:
            self._endpoint.close()
        self._sender.close()
        self._agent = None  # a NIXL agent's progress thread spins a core until the agent is gone
