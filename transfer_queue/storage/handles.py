"""Typed handles: the exact fields of each plane's handle, checked before a handle is trusted.

A handle arrives from a peer (a producer's `put`, a consumer's `ack`), so the controller
checks it with `check_handle` before storing it: the plane must be `inline` or the run's
plane, the field set must be exactly that plane's, every field must have its type and
range, and the tensor header must be consistent. `identity` names the memory a handle
refers to, so the controller can refuse a second live record that points at memory a
first one already holds (a forged or replayed handle).

Whether the memory was really allocated by that plane's producer is checked where the
memory lives: a storage unit or arena releases only allocations it made itself
(`arena.Arena.release`, `zmq.ZmqStorageUnit`), and `StoragePlane.verify` checks what the
controller's process can see (an `shm` file exists, has that size, belongs to the run).
"""

from __future__ import annotations

from typing import Any

from transfer_queue.codec import WireError, check_header

_HEADER = {"plane": str, "dtype": str, "shape": list, "nbytes": int}
_U63 = (1 << 63) - 1
# plane -> field -> type (beyond the header); `None` marks optional groups below
FIELDS: dict[str, dict[str, type]] = {
    "inline": {"data": bytes},
    "local": {"key": str},
    "shm": {"path": str},
    "shm-arena": {"path": str, "offset": int, "free": str, "slot": int},
    "zmq": {"address": str, "key": str},
    "nixl": {"agent": str, "md": bytes, "descs": bytes, "addr": int, "offset": int, "free": str, "slot": int},
}


def _variant(h: dict[str, Any]) -> str:
    plane = h.get("plane")
    if plane == "shm" and "offset" in h:
        return "shm-arena"
    return str(plane)


def check_handle(h: Any, plane: str, max_tensor_bytes: int) -> dict[str, Any]:
    """`h` if it is a well-formed handle of `plane` (or inline); WireError naming what is wrong."""
    if not isinstance(h, dict):
        raise WireError(f"handle: expected a map, got {type(h).__name__}")
    if h.get("plane") not in ("inline", plane):
        raise WireError(f"handle of plane {h.get('plane')!r}: this queue's plane is {plane!r} (queue.storage)")
    spec = {**_HEADER, **FIELDS[_variant(h)]}
    if set(h) != set(spec):
        raise WireError(f"{h['plane']} handle: fields {sorted(h)} are not {sorted(spec)}")
    for k, t in spec.items():
        v = h[k]
        if not isinstance(v, t) or (isinstance(v, bool) and t is not bool):
            raise WireError(f"{h['plane']} handle: {k!r} has type {type(v).__name__}")
        if t is int and not 0 <= v <= _U63:
            raise WireError(f"{h['plane']} handle: {k!r}={v} out of range")
        if t is str and not 0 < len(v) <= 4096:
            raise WireError(f"{h['plane']} handle: {k!r} is empty or too long")
    for k in ("address", "free"):
        if k in h and not h[k].startswith("tcp://"):
            raise WireError(f"{h['plane']} handle: {k!r}={h[k]!r} is not a tcp:// address")
    _, _, n = check_header(h, max_tensor_bytes)
    if h["plane"] == "inline" and len(h["data"]) != n:
        raise WireError(f"inline handle: {len(h['data'])} data bytes, header says {n}")
    return h


def identity(h: dict[str, Any]) -> tuple[Any, ...] | None:
    """What memory `h` refers to (None for inline handles, which refer to none)."""
    v = _variant(h)
    if v == "inline":
        return None
    if v in ("shm-arena", "nixl"):
        return (v, h["free"], h["offset"])
    if v == "zmq":
        return (v, h["address"], h["key"])
    return (v, h.get("path") or h.get("key"))
