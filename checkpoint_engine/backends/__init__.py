"""Data planes for bucket bytes, one module per backend (`base.py` holds the contract), chosen by
`make_sender_transport` / `make_receiver_transport` here: the factory sits above the backends, which
import only `base`, so no backend module imports another."""

from __future__ import annotations

from checkpoint_engine.backends.base import ReceiverTransport, SenderTransport
from checkpoint_engine.config import WeightsConfig


def make_sender_transport(config: WeightsConfig) -> SenderTransport:
    """The factory, keyed by `config.backend` (heavy imports stay in the chosen module)."""
    if config.backend == "local":
        from checkpoint_engine.backends.local import LocalSenderTransport
        return LocalSenderTransport(config)
    if config.backend == "shm":
        from checkpoint_engine.backends.shm import ShmSenderTransport
        return ShmSenderTransport(config)
    if config.backend in ("gloo", "nccl"):
        from checkpoint_engine.backends.gloo_nccl import CollectiveSenderTransport
        return CollectiveSenderTransport(config)
    if config.backend == "nixl":
        from checkpoint_engine.backends.nixl import NixlSenderTransport
        return NixlSenderTransport(config)
    if config.backend == "cuda_ipc":
        from checkpoint_engine.backends.cuda_ipc import CudaIpcSenderTransport
        return CudaIpcSenderTransport(config)
    raise ValueError(f"weights.backend: no transport for {config.backend!r}")


def make_receiver_transport(config: WeightsConfig) -> ReceiverTransport:
    if config.backend == "local":
        from checkpoint_engine.backends.local import LocalReceiverTransport
        return LocalReceiverTransport(config)
    if config.backend == "shm":
        from checkpoint_engine.backends.shm import ShmReceiverTransport
        return ShmReceiverTransport(config)
    if config.backend in ("gloo", "nccl"):
        from checkpoint_engine.backends.gloo_nccl import CollectiveReceiverTransport
        return CollectiveReceiverTransport(config)
    if config.backend == "nixl":
        from checkpoint_engine.backends.nixl import NixlReceiverTransport
        return NixlReceiverTransport(config)
    if config.backend == "cuda_ipc":
        from checkpoint_engine.backends.cuda_ipc import CudaIpcReceiverTransport
        return CudaIpcReceiverTransport(config)
    raise ValueError(f"weights.backend: no transport for {config.backend!r}")


__all__ = ["ReceiverTransport", "SenderTransport", "make_receiver_transport", "make_sender_transport"]
