"""Wire codec: msgpack (msgspec) for structure, raw buffers with dtype and shape for tensors.

Nothing here can execute what a peer sends: no pickle, no msgpack ext types, a closed
list of dtypes, and explicit size limits. Wire records are msgspec Structs decoded by typed
decoders (`plane_common.strict_msgpack.decoder(T)`, `decode`), so types, required fields and ranges come from the Struct;
every failure to decode raises `WireError`, which services count and answer with an error
instead of crashing.

Tensors are carried as numpy arrays internally; torch tensors are viewed as numpy
without a copy (bfloat16, which numpy lacks, travels as int16 bits with the tag
`bfloat16`). torch is imported only when a torch tensor is seen or asked for.
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np

from plane_common.strict_msgpack import decoder

# numpy dtype strings accepted on the wire (little-endian, no objects)
DTYPES = {
    "bool": "|b1", "int8": "|i1", "uint8": "|u1", "int16": "<i2", "uint16": "<u2",
    "int32": "<i4", "uint32": "<u4", "int64": "<i8", "uint64": "<u8",
    "float16": "<f2", "float32": "<f4", "float64": "<f8", "bfloat16": "<i2",
}
_MAX_DIMS = 16


class WireError(ValueError):
    """A message or tensor header that does not decode into a valid value."""


_encoder = msgspec.msgpack.Encoder()


def pack(obj: Any) -> bytes:
    """msgpack bytes of builtins and msgspec Structs (handles, records, requests)."""
    return _encoder.encode(obj)


_any = decoder(Any)


def decode(dec: msgspec.msgpack.Decoder, data: bytes | memoryview, max_bytes: int, what: str = "message") -> Any:
    """Decode one message with typed decoder `dec`; malformed, truncated, mistyped or too big is a WireError."""
    if len(data) > max_bytes:
        raise WireError(f"{what} of {len(data)} bytes exceeds the limit of {max_bytes}")
    try:
        return dec.decode(data)
    except msgspec.ValidationError as e:
        raise WireError(f"{what}: {e}") from None
    except (msgspec.DecodeError, ValueError, TypeError, RecursionError) as e:  # ext refused, bad bytes
        raise WireError(f"not a msgpack message ({type(e).__name__}: {e})") from None


def unpack(data: bytes | memoryview, max_bytes: int) -> Any:
    """Decode one untyped msgpack message; anything malformed, truncated or too big is a WireError."""
    return decode(_any, data, max_bytes)


def convert(obj: Any, t: Any, what: str) -> Any:
    """`obj` (builtins) as wire type `t`, by the same rules as `decode`; else WireError."""
    try:
        return msgspec.convert(obj, t)
    except msgspec.ValidationError as e:
        raise WireError(f"{what}: {e}") from None


def expect_map(obj: Any, keys: dict[str, type | tuple[type, ...]], what: str) -> dict:
    """Check that `obj` is a map holding `keys` with the given types."""
    if not isinstance(obj, dict):
        raise WireError(f"{what}: expected a map, got {type(obj).__name__}")
    for k, t in keys.items():
        if k not in obj:
            raise WireError(f"{what}: missing {k!r}")
        if not isinstance(obj[k], t) or (isinstance(obj[k], bool) and bool not in _as_tuple(t)):
            raise WireError(f"{what}: {k!r} has type {type(obj[k]).__name__}")
    return obj


MAX_INT = 1 << 62
"""Bound of every integer a peer may send (versions, sizes, offsets): far beyond any real value."""
MAX_COUNT = 1 << 20
"""Bound of every count a peer may send (records per call, batch sizes, group sizes)."""
MAX_SECONDS = 7 * 24 * 3600.0
"""Bound of every timeout a peer may send (None means forever where a call allows it)."""


def check_int(v: Any, what: str, lo: int = 0, hi: int = MAX_INT, none_ok: bool = False) -> int | None:
    """`v` if it is an int (not a bool) in [lo, hi] (or None when `none_ok`); else WireError."""
    if v is None and none_ok:
        return None
    if type(v) is not int or not lo <= v <= hi:
        raise WireError(f"{what} must be an integer in [{lo}, {hi}]{' or nil' if none_ok else ''}, got {v!r}")
    return v


def check_seconds(v: Any, what: str, none_ok: bool = True) -> float | None:
    """`v` if it is a finite number of seconds in [0, MAX_SECONDS] (or None when `none_ok`): NaN,
    inf, negatives and absurd values are a WireError."""
    if v is None and none_ok:
        return None
    if type(v) not in (int, float) or not 0 <= v <= MAX_SECONDS:  # NaN fails both comparisons
        raise WireError(f"{what} must be a number of seconds in [0, {MAX_SECONDS:g}]{' or nil' if none_ok else ''}, got {v!r}")
    return float(v)


def _as_tuple(t: type | tuple[type, ...]) -> tuple[type, ...]:
    return t if isinstance(t, tuple) else (t,)


# ---- tensors -------------------------------------------------------------
def to_numpy(t: Any) -> tuple[np.ndarray, str]:
    """A C-contiguous little-endian numpy view of `t` (copy only if needed) and its dtype tag."""
    tag = None
    if type(t).__module__.startswith("torch"):
        import torch

        t = t.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        if t.dtype == torch.bfloat16:
            t, tag = t.view(torch.int16), "bfloat16"
        t = t.contiguous().numpy()
    arr = np.ascontiguousarray(t)
    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    name = tag or arr.dtype.name
    if name not in DTYPES:
        raise WireError(f"dtype {arr.dtype} cannot travel on the wire")
    return arr, name


def tensor_header(arr: np.ndarray, tag: str) -> dict[str, Any]:
    return {"dtype": tag, "shape": list(arr.shape), "nbytes": int(arr.nbytes)}


def check_header(h: Any, max_bytes: int) -> tuple[np.dtype, tuple[int, ...], int]:
    """Validate a tensor header (a typed handle, or a map with dtype, shape, nbytes);
    returns (numpy dtype, shape, nbytes)."""
    if isinstance(h, dict):
        expect_map(h, {"dtype": str, "shape": list, "nbytes": int}, "tensor header")
        dtype, shape, nbytes = h["dtype"], h["shape"], h["nbytes"]
    else:
        dtype, shape, nbytes = h.dtype, h.shape, h.nbytes
    if dtype not in DTYPES:
        raise WireError(f"tensor header: unknown dtype {dtype!r}")
    if len(shape) > _MAX_DIMS or any(type(d) is not int or d < 0 for d in shape):
        raise WireError(f"tensor header: bad shape {shape!r}")
    dt = np.dtype(DTYPES[dtype])
    n = dt.itemsize
    for d in shape:
        n *= d
    if n != nbytes or n > max_bytes:
        raise WireError(f"tensor header: nbytes {nbytes} does not match shape {shape} (limit {max_bytes})")
    return dt, tuple(shape), n


def from_buffer(h: Any, buf: Any, max_bytes: int) -> np.ndarray:
    """A zero-copy numpy view of `buf` described by header `h`."""
    dt, shape, n = check_header(h, max_bytes)
    mv = memoryview(buf).cast("B")
    if len(mv) != n:
        raise WireError(f"tensor buffer has {len(mv)} bytes, header says {n}")
    return np.frombuffer(mv, dtype=dt).reshape(shape)


def as_output(arr: np.ndarray, tag: str, as_torch: bool) -> Any:
    """Turn a decoded numpy view into what the caller asked for, without a copy."""
    if not as_torch:
        return arr
    import warnings

    import torch

    with warnings.catch_warnings():  # read-only views (received frames): treat as read-only
        warnings.simplefilter("ignore", UserWarning)
        t = torch.from_numpy(arr)
    return t.view(torch.bfloat16) if tag == "bfloat16" else t
