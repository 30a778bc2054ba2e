"""Data planes for bucket bytes, one module per backend (`base.py` holds the contract), chosen by
`make_sender_transport` / `make_receiver_transport` here: the factory sits above the backends, which
import only `base`, so no backend module imports another."""

from __future__ import annotations

import importlib
from typing import Any

from checkpoint_engine.backends.base import ReceiverTransport, SenderTransport
from checkpoint_engine.config import WeightsConfig

_TRANSPORTS: dict[str, tuple[str, str, str]] = {
    # weights.backend -> (its module here, its sender class, its receiver class): names, so that
    # only the chosen backend's module (and its heavy imports) is ever imported
    "local": ("local", "LocalSenderTransport", "LocalReceiverTransport"),
    "shm": ("shm", "ShmSenderTransport", "ShmReceiverTransport"),
    "gloo": ("gloo_nccl", "CollectiveSenderTransport", "CollectiveReceiverTransport"),
    "nccl": ("gloo_nccl", "CollectiveSenderTransport", "CollectiveReceiverTransport"),
    "nixl": ("nixl", "NixlSenderTransport", "NixlReceiverTransport"),
    "cuda_ipc": ("cuda_ipc", "CudaIpcSenderTransport", "CudaIpcReceiverTransport"),
}


def _transport(config: WeightsConfig, end: int) -> Any:
    """The transport class `_TRANSPORTS[config.backend][end]` (1: sender, 2: receiver), built with `config`."""
    if config.backend not in _TRANSPORTS:
        raise ValueError(f"weights.backend: no transport for {config.backend!r}")
    names = _TRANSPORTS[config.backend]
    module = importlib.import_module(f"checkpoint_engine.backends.{names[0]}")
    return getattr(module, names[end])(config)


def make_sender_transport(config: WeightsConfig) -> SenderTransport:
    """The factory, keyed by `config.backend` (heavy imports stay in the chosen module)."""
    return _transport(config, 1)  # type: ignore[no-any-return]


def make_receiver_transport(config: WeightsConfig) -> ReceiverTransport:
    return _transport(config, 2)  # type: ignore[no-any-return]


__all__ = ["ReceiverTransport", "SenderTransport", "make_receiver_transport", "make_sender_transport"]
