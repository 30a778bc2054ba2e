"""Typed msgpack decoders that refuse msgpack extension types: the planes' one decoding rule.

Nothing a peer sends may make a decoder build anything but plain values and the wire Structs it
was given: no pickle (never used), and no msgpack ext types (`no_ext` raises ValueError, which each
plane's decode counts as malformed, as it does msgspec's DecodeError and ValidationError). Types,
required fields and ranges come from the Struct the decoder is made for.

Example:
    dec = decoder(Join)        # msgspec.msgpack.Decoder(Join, ext_hook=no_ext)
    dec.decode(frame)          # a Join, or ValueError / msgspec.DecodeError / msgspec.ValidationError
"""

from __future__ import annotations

from typing import Any

import msgspec


def no_ext(code: int, data: memoryview) -> Any:
    """msgspec's ext hook: every ext type is refused."""
    raise ValueError(f"msgpack ext type {code} is not accepted")


def decoder(t: Any = Any) -> msgspec.msgpack.Decoder:
    """A msgpack decoder for wire type `t` (default: any plain value) that refuses ext types."""
    return msgspec.msgpack.Decoder(t, ext_hook=no_ext)
