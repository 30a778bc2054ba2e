"""`cuda_ipc`: a receiver on the sender's GPU (or a peer GPU of the same host) reads its slots in place.

The sender allocates its two slot buffers on `config.device` once and sends, in `Begin.info`,
the CUDA IPC handle of each (`UntypedStorage._share_cuda_()`: bytes and integers, plain
msgpack values, no pickle). A receiver opens them once (`_new_shared_cuda`) and copies each
tensor out of the slot straight into the engine's parameters: one device-to-device copy, no
host memory, no network. It is what lets one GPU hold a trainer rank and a rollout server
(fractional Ray GPUs) and still exercise the GPU weight path.

Ordering on the device: the sender synchronizes its stream after filling a slot, before
announcing the bucket (`seal`); a receiver synchronizes after copying out of a slot, before
acknowledging it (`release`), since the sender refills the slot once every receiver acked.
"""

from __future__ import annotations

from typing import Any

import torch

from checkpoint_engine.backends.base import ReceiverTransport, SenderTransport, resolve_device, sync_stream
from checkpoint_engine.config import WeightsConfig
from checkpoint_engine.wire import BucketMeta


def _share(slot: torch.Tensor) -> list[Any]:
    """The IPC description of `slot`'s storage as msgpack values."""
    device, handle, size, offset, ref_handle, ref_offset, event_handle, event_sync = slot.untyped_storage()._share_cuda_()
    return [int(device), bytes(handle), int(size), int(offset), bytes(ref_handle), int(ref_offset),
            bytes(event_handle) if event_handle is not None else b"", bool(event_sync)]


def _open(desc: list[Any], device: torch.device) -> torch.Tensor:
    """A uint8 view of a slot shared by another process (opened on this process's `device`)."""
    _, handle, size, offset, ref_handle, ref_offset, event_handle, event_sync = desc
    torch.cuda._lazy_init()
    storage = torch.UntypedStorage._new_shared_cuda(
        device.index or 0, handle, size, offset, ref_handle, ref_offset, event_handle or None, event_sync)
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)


class CudaIpcSenderTransport(SenderTransport):
    def __init__(self, config: WeightsConfig):
        super().__init__(config)
        self.device = resolve_device(config.device)  # a bare `cuda`: this rank's current device
        self.slots = [torch.empty(config.bucket_bytes, dtype=torch.uint8, device=self.device) for _ in range(2)]
        self._descs = [_share(s) for s in self.slots]

    def begin_info(self) -> dict[str, Any]:
        return {"slots": self._descs, "size": self.config.bucket_bytes}

    def seal(self, meta: BucketMeta) -> None:
        sync_stream(self.device)

    def send(self, meta: BucketMeta) -> None:
        pass


class CudaIpcReceiverTransport(ReceiverTransport):
    borrowed = True

    def __init__(self, config: WeightsConfig):
        super().__init__(config)
        self.device = resolve_device(config.device)  # a bare `cuda`: this rank's current device
        self._key: list[bytes] = []
        self._views: list[torch.Tensor] = []

    def attach(self, info: dict[str, Any]) -> None:
        key = [bytes(d[1]) for d in info["slots"]]
        if key == self._key:
            return
        self._views = [_open(d, self.device) for d in info["slots"]]
        self._key = key

    def recv(self, meta: BucketMeta) -> torch.Tensor:
        return self._views[meta.slot][: meta.nbytes]

    def release(self, meta: BucketMeta) -> None:
        sync_stream(self.device)

    def close(self) -> None:
        self._views = []
        self._key = []
