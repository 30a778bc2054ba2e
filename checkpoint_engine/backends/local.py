"""`local`: sender and receivers in one process; a receiver copies straight from the slot.

The reference semantics and the test double: the slots live in a process-wide registry
keyed by a random id that travels in `Begin.info`, so the control plane (ZeroMQ, acks,
eviction) is exercised exactly as for the other backends while the data plane is a
single `copy_`. Receivers must run in the sender's process (threads).
"""

from __future__ import annotations

import uuid
from typing import Any

import torch

from checkpoint_engine.backends.base import ReceiverTransport, SenderTransport
from checkpoint_engine.config import WeightsConfig
from checkpoint_engine.wire import BucketMeta

_REGISTRY: dict[str, list[torch.Tensor]] = {}


class LocalSenderTransport(SenderTransport):
    def __init__(self, config: WeightsConfig):
        super().__init__(config)
        self.key = uuid.uuid4().hex
        self.slots = [torch.empty(config.bucket_bytes, dtype=torch.uint8) for _ in range(2)]
        _REGISTRY[self.key] = self.slots

    def begin_info(self) -> dict[str, Any]:
        return {"key": self.key}

    def send(self, meta: BucketMeta) -> None:
        pass

    def close(self) -> None:
        _REGISTRY.pop(self.key, None)
        super().close()


class LocalReceiverTransport(ReceiverTransport):
    borrowed = True

    def __init__(self, config: WeightsConfig):
        super().__init__(config)
        self.slots: list[torch.Tensor] = []

    def attach(self, info: dict[str, Any]) -> None:
        if info["key"] not in _REGISTRY:
            raise RuntimeError("weights.backend=local: the sender is not in this process")
        self.slots = _REGISTRY[info["key"]]

    def recv(self, meta: BucketMeta) -> torch.Tensor:
        return self.slots[meta.slot][: meta.nbytes]
