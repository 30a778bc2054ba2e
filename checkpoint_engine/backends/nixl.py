"""`nixl`: receivers READ buckets straight out of the sender's registered slots.

The sender registers its two slot buffers with a NIXL agent once and sends, in
`Begin.info`, its agent metadata and the slot addresses. Each receiver registers one
landing buffer of bucket size, READs the first `nbytes` of the announced slot into it,
and the receiver copies each tensor out of it to its final buffer. Only two large regions are
registered per side (registration is costly; the agent is used from one thread only).
Here the memory is DRAM over UCX; with `device=cuda` it is VRAM and the same calls
become GPU-direct RDMA.

RDMA does not follow CUDA stream order, so on a GPU both ends synchronize their stream: the
sender after filling a slot, before the bucket is announced and a receiver may READ it (`seal`);
a receiver after its copies out of the landing buffer, before the ack that lets the next READ
overwrite it (`release`).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import torch

from checkpoint_engine.backends.base import ReceiverTransport, SenderTransport, resolve_device, sync_stream
from checkpoint_engine.config import WeightsConfig
from checkpoint_engine.wire import BucketMeta


def _agent(name: str, backend: str):
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError:  # the wheels built per CUDA major name their module nixl_cu12 / nixl_cu13
        try:
            from nixl_cu13._api import nixl_agent, nixl_agent_config
        except ImportError:
            from nixl_cu12._api import nixl_agent, nixl_agent_config
    return nixl_agent(name, nixl_agent_config(backends=[backend]))


def _mem(device: torch.device) -> tuple[str, int]:
    return ("VRAM", device.index or 0) if device.type == "cuda" else ("DRAM", 0)


class NixlSenderTransport(SenderTransport):
    def __init__(self, config: WeightsConfig):
        super().__init__(config)
        self.name = f"weights-sender-{uuid.uuid4().hex[:8]}"
        self.agent = _agent(self.name, config.nixl_backend)
        self.device = resolve_device(config.device)
        self.slots = [torch.empty(config.bucket_bytes, dtype=torch.uint8, device=self.device)
                      for _ in range(2)]
        self._reg = self.agent.register_memory(self.agent.get_reg_descs(self.slots))

    def begin_info(self) -> dict[str, Any]:
        mem, dev = _mem(self.slots[0].device)
        return {"agent": self.name, "metadata": self.agent.get_agent_metadata(), "mem": mem,
                "slots": [[s.data_ptr(), s.numel(), dev] for s in self.slots]}

    def seal(self, meta: BucketMeta) -> None:
        sync_stream(self.device)  # the packer's copies have landed before a receiver READs the slot

    def send(self, meta: BucketMeta) -> None:
        pass

    def close(self) -> None:
        if self.slots:
            self.agent.deregister_memory(self._reg)
        self.agent = None  # an agent's progress thread spins a core until the agent itself is gone
        super().close()


class NixlReceiverTransport(ReceiverTransport):
    borrowed = True

    def __init__(self, config: WeightsConfig):
        super().__init__(config)
        self.name = f"weights-receiver-{uuid.uuid4().hex[:8]}"
        self.agent = _agent(self.name, config.nixl_backend)
        self.device = resolve_device(config.device)
        self.landing = torch.empty(config.bucket_bytes, dtype=torch.uint8, device=self.device)
        self._reg = self.agent.register_memory(self.agent.get_reg_descs([self.landing]))
        self.remote: str | None = None
        self.info: dict[str, Any] = {}

    def attach(self, info: dict[str, Any]) -> None:
        if info["agent"] != self.remote:
            if self.remote is not None:
                self.agent.remove_remote_agent(self.remote)
            self.remote = self.agent.add_remote_agent(info["metadata"])
            if isinstance(self.remote, bytes):
                self.remote = self.remote.decode()
        self.info = info

    def recv(self, meta: BucketMeta) -> torch.Tensor:
        n = meta.nbytes
        if n == 0:
            return self.landing[:0]
        addr, _, dev = self.info["slots"][meta.slot]
        mem, local_dev = _mem(self.landing.device)
        local = self.agent.get_xfer_descs([(self.landing.data_ptr(), n, local_dev)], mem)
        remote = self.agent.get_xfer_descs([(addr, n, dev)], self.info["mem"])
        handle = self.agent.initialize_xfer("READ", local, remote, self.remote)
        try:
            state = self.agent.transfer(handle)
            deadline = time.monotonic() + self.config.timeout_s
            while state != "DONE":
                if state == "ERR":
                    raise RuntimeError(f"nixl READ of bucket {meta.index} failed")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"nixl READ of bucket {meta.index} timed out")
                time.sleep(0.0001)
                state = self.agent.check_xfer_state(handle)
        finally:
            self.agent.release_xfer_handle(handle)
        return self.landing[:n]

    def release(self, meta: BucketMeta) -> None:
        sync_stream(self.device)  # copies out of the landing buffer are done before the next READ into it

    def close(self) -> None:
        if self.landing is not None:
            self.agent.deregister_memory(self._reg)
            self.landing = None
        if self.remote is not None:
            self.agent.remove_remote_agent(self.remote)
            self.remote = None
        self.agent = None  # its progress thread spins a core until the agent is gone
