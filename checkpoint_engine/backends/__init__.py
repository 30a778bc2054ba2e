"""Data planes for bucket bytes, one module per backend, chosen by `make_transports`."""

from checkpoint_engine.backends.base import (
    ReceiverTransport,
    SenderTransport,
    make_receiver_transport,
    make_sender_transport,
)

__all__ = ["ReceiverTransport", "SenderTransport", "make_receiver_transport", "make_sender_transport"]
