"""The data-plane contract: how one bucket's bytes get from the sender's slot to a receiver.

A backend is a pair. The `SenderTransport` owns the two slot buffers the packer fills
(double buffering) and either *pushes* a bucket (collectives: gloo, nccl) or does
nothing and lets receivers *pull* it (local, shm, nixl, cuda_ipc). The `ReceiverTransport`
returns a fresh uint8 buffer with the bucket's bytes that the caller owns. Everything
else (metadata, acks, versions, eviction) is the sender's and receiver's job and is the
same for every backend; `local` defines the semantics and is the test double.

Collective backends additionally build a process group per membership *epoch*: when a
member is evicted, survivors form a new group and the failed bucket is pushed again.
"""

from __future__ import annotations

import abc
from typing import Any

import torch

from checkpoint_engine.config import WeightsConfig
from checkpoint_engine.wire import BucketMeta


def resolve_device(spec: str) -> torch.device:
    """`config.device` as a device with an index: a bare `cuda` is this thread's current CUDA device
    (where `torch.empty(device="cuda")` allocates; `torch.cuda.set_device` and IPC opens need the
    index, and under torchrun each rank has set its own). `cpu` stays `cpu`."""
    device = torch.device(spec)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def pack_device(config: WeightsConfig) -> int | None:
    """The CUDA device a sender's packing thread must set (a new thread starts on device 0, and it
    gathers, casts and copies the caller's tensors): `weights.device` when it is a GPU (a bare
    `cuda`: the caller's current device), else the caller's current device when the caller uses
    CUDA (e.g. `shm` from GPU parameters); None without CUDA. Call it on the caller's thread."""
    if config.device.startswith("cuda"):
        return resolve_device(config.device).index
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.current_device()
    return None


def sync_stream(device: torch.device) -> None:
    """Wait for the work queued on this thread's current stream of `device` (a no-op off CUDA): what
    device backends call in `seal` / `release`, since readers outside the stream (a peer's READ,
    another process's copy, a refilled buffer) do not follow CUDA stream order."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


class SenderTransport(abc.ABC):
    collective: bool = False
    """True when `send` is a collective every group member must join (gloo, nccl)."""

    def __init__(self, config: WeightsConfig):
        self.config = config
        self.slots: list[torch.Tensor] = []

    @abc.abstractmethod
    def begin_info(self) -> dict[str, Any]:
        """What a receiver needs to attach (msgpack-able values only)."""

    def form_group(self, epoch: int, world_size: int) -> None:
        """Collectives: build group `epoch` with the sender as rank 0. Blocks for all ranks."""

    def seal(self, meta: BucketMeta) -> None:
        """The slot of `meta` is filled: make its bytes visible to readers (device backends
        synchronize their stream) before the bucket is announced."""

    @abc.abstractmethod
    def send(self, meta: BucketMeta) -> None:
        """Push bucket `meta` from `self.slots[meta.slot]` (no-op for pull backends)."""

    def close(self) -> None:
        self.slots = []


class ReceiverTransport(abc.ABC):
    borrowed: bool = False
    """True when `recv` returns the transport's own memory (a mapped slot, a landing
    buffer), valid only until the bucket is acknowledged; the receiver then copies each
    tensor straight to its final buffer (one copy). False: the caller owns the buffer."""
    consumes: bool = False
    """True when the bytes go to their destination without passing through the receiver:
    `consume(meta)` receives, checks and loads a bucket (e.g. in an engine's worker processes)
    and the update yields no tensors."""
    width: int = 1
    """Ranks this receiver takes in a gloo/nccl group (one per process that joins the broadcast)."""

    def __init__(self, config: WeightsConfig):
        self.config = config

    def begin_update(self, version: int) -> None:
        """Called once per update before its first bucket."""

    def end_update(self) -> None:
        """Called once per update after its last bucket landed."""

    def consume(self, meta: BucketMeta) -> bool:
        """`consumes` transports: deliver bucket `meta` to its destination; False when its
        checksum did not match (raises RuntimeError when the group must be rebuilt)."""
        raise NotImplementedError

    @abc.abstractmethod
    def attach(self, info: dict[str, Any]) -> None:
        """Connect to the sender's data plane described by `Begin.info` (idempotent)."""

    def form_group(self, epoch: int, rank: int, world_size: int) -> None:
        """Collectives: join group `epoch` as `rank`. Raises on timeout."""

    @abc.abstractmethod
    def recv(self, meta: BucketMeta) -> torch.Tensor:
        """The bucket's first `meta.nbytes` bytes as a uint8 tensor (see `borrowed`)."""

    def release(self, meta: BucketMeta) -> None:
        """Every read of bucket `meta` is done (called before it is acknowledged: the sender may
        refill the slot then); device backends synchronize their stream."""

    def close(self) -> None:
        pass

