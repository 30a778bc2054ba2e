"""Typed handles: one msgspec Struct per plane, tagged by `plane`, checked before a handle is trusted.

A handle tells a data plane where the bytes of one tensor field are. It is a msgpack map on the
wire, `{"plane": <kind>, "dtype", "shape", "nbytes", ...plane fields}`, decoded by msgspec into
exactly one of `InlineHandle`, `LocalHandle`, `ShmHandle`, `ZmqHandle`, `NixlHandle` (the tagged
union `Handle`): the decoder refuses unknown planes, unknown or missing fields, wrong types and
out-of-range numbers. `check_handle` adds what a type cannot say: the plane must be `inline` or
the run's plane, an `shm` arena slot carries all of `offset`/`slot`/`free` or none, and the tensor
header must be consistent. `identity` names the memory a handle refers to, so the controller can
refuse a second live record that points at memory a first one already holds (a forged or replayed
handle).

A handle may carry the capability to *free* its memory: an arena slot's `slot` number and `free`
address (shm, nixl), a zmq key's `token`. The producer and the metadata holder keep it; the
copies the memory service hands to other consumers do not (`without_free`): a consumer reads
with them but cannot free (or make the producer reuse) memory it does not own. `check_handle`
asks for the capability where a handle is stored (`owned=True`, at `put`), not where it is read.

Whether the memory was really allocated by that plane's producer is checked where the
memory lives: a storage unit or arena releases only allocations it made itself
(`arena.Arena.release`, `zmq.ZmqStorageUnit`), and `StoragePlane.verify` checks what the
controller's process can see (an `shm` file exists, has that size, belongs to the run).

A handle reads like a read-only map too (`h["nbytes"]`, `h.get("free")`, `dict(h)`), so code
that only inspects a field need not know the plane's class.
"""

from __future__ import annotations

from typing import Annotated, Any, Iterator, Literal, Union

import msgspec

from transfer_queue.codec import DTYPES, WireError, check_header

_U63 = (1 << 63) - 1
U63 = Annotated[int, msgspec.Meta(ge=0, le=_U63)]
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=4096)]
Address = Annotated[str, msgspec.Meta(pattern="^tcp://", max_length=4096)]
Dtype = Literal[tuple(DTYPES)]  # type: ignore[valid-type]
Shape = Annotated[list[Annotated[int, msgspec.Meta(ge=0, le=_U63)]], msgspec.Meta(max_length=16)]


class _HandleBase(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, omit_defaults=True,
                  tag_field="plane"):
    """The tensor header every handle carries: dtype tag, shape, byte count (consistent: `check_handle`)."""

    dtype: Dtype
    shape: Shape
    nbytes: U63

    @property
    def plane(self) -> str:
        return self.__struct_config__.tag  # type: ignore[return-value]

    @property
    def source(self) -> str:
        """The process that must answer a read of these bytes ('' where the reader's own process holds them:
        inline bytes, a local key; a file of this host's /dev/shm is its producer's: `ShmHandle.source`).
        Reads are grouped by it, so one producer that cannot be reached, or whose files are gone, fails its
        own handles only (`StoragePlane.read_by_source`)."""
        return ""

    # read-only map view: `h["key"]`, `h.get(...)`, `dict(h)`, `{**h}`
    def keys(self) -> list[str]:
        return ["plane", *(f for f in self.__struct_fields__ if getattr(self, f) is not None)]

    def __getitem__(self, k: str) -> Any:
        if k == "plane":
            return self.plane
        v = getattr(self, k, None) if k in self.__struct_fields__ else None
        if v is None:
            raise KeyError(k)
        return v

    def get(self, k: str, default: Any = None) -> Any:
        try:
            return self[k]
        except KeyError:
            return default

    def __contains__(self, k: object) -> bool:
        return k in self.keys()

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())


class InlineHandle(_HandleBase, frozen=True, tag="inline"):
    """The tensor itself (at most `queue.inline_max_bytes`): no plane memory behind it."""

    data: bytes


class LocalHandle(_HandleBase, frozen=True, tag="local"):
    """A key of one process's `LocalStorage` (meaningless elsewhere)."""

    key: Name


class ShmHandle(_HandleBase, frozen=True, tag="shm"):
    """A tmpfs file (`path` alone), or a slot of a producer's arena file (`offset`, `slot`, `free`:
    all three or none)."""

    path: Name
    offset: U63 | None = None
    slot: U63 | None = None
    """Random number of the allocation; the arena releases only the exact (offset, nbytes, slot)."""
    free: Address | None = None
    """The producer's free endpoint."""

    @property
    def in_arena(self) -> bool:
        return self.offset is not None

    @property
    def source(self) -> str:
        """The producer whose file this is (its arena, or its `tq-<run>-<pid>-<hex>` prefix): a producer's
        files removed after it ended (`queue.shm_keep_s`) cost its own records, not the whole read."""
        return shm_source(self.path, self.in_arena)


def shm_source(path: str, in_arena: bool) -> str:
    """`ShmHandle.source` of a file at `path`: its arena, or the `tq-<run>-<pid>-<hex>` prefix of its producer."""
    return f"shm {path if in_arena else path.rpartition('-')[0]}"


class ZmqHandle(_HandleBase, frozen=True, tag="zmq"):
    """A key held by the storage unit at `address`."""

    address: Address
    key: Name
    token: Annotated[bytes, msgspec.Meta(max_length=64)] | None = None
    """The unit's free token for `key` (what its `put` was answered with); absent in a consumer's copy."""

    @property
    def source(self) -> str:
        return self.address


class NixlHandle(_HandleBase, frozen=True, tag="nixl"):
    """A slot of a producer's NIXL-registered arena: what a consumer needs to READ it."""

    agent: Name
    md: bytes
    """The producer agent's metadata (added as a remote agent once)."""
    descs: bytes
    addr: U63
    offset: U63
    free: Address | None = None
    """The producer's free endpoint (absent in a consumer's copy, with `slot`)."""
    slot: U63 | None = None

    @property
    def source(self) -> str:
        return f"nixl agent {self.agent}"


Handle = Union[InlineHandle, LocalHandle, ShmHandle, ZmqHandle, NixlHandle]


def as_handle(h: Any) -> Handle:
    """`h` as a typed handle: a Struct as is, a map (a test, a caller's dict) decoded by the same rules."""
    if isinstance(h, _HandleBase):
        return h  # type: ignore[return-value]
    try:
        return msgspec.convert(h, Handle)  # type: ignore[arg-type]
    except msgspec.ValidationError as e:
        raise WireError(f"handle: {e}") from None


def check_handle(h: Any, plane: str, max_tensor_bytes: int, owned: bool = True) -> Handle:
    """`h` (typed) if it is a well-formed handle of `plane` (or inline); WireError naming what is wrong.
    `owned` (where a handle is stored): an arena slot must carry its free capability; a handle only
    read (a consumer's copy) need not."""
    h = as_handle(h)
    if h.plane not in ("inline", plane):
        raise WireError(f"handle of plane {h.plane!r}: this queue's plane is {plane!r} (queue.storage)")
    if isinstance(h, ShmHandle) and (h.slot is None) != (h.free is None):
        raise WireError(f"shm handle: slot and free come together (fields {h.keys()})")
    if isinstance(h, ShmHandle) and (h.slot is not None or owned) and (h.offset is None) != (h.slot is None):
        raise WireError(f"shm handle: offset, slot and free come together (fields {h.keys()})")
    if isinstance(h, NixlHandle) and (h.slot is None) != (h.free is None) or owned and isinstance(h, NixlHandle) and h.slot is None:
        raise WireError(f"nixl handle: slot and free come together (fields {h.keys()})")
    _, _, n = check_header(h, max_tensor_bytes)
    if isinstance(h, InlineHandle) and len(h.data) != n:
        raise WireError(f"inline handle: {len(h.data)} data bytes, header says {n}")
    return h


def without_free(h: Handle) -> Handle:
    """`h` without its free capability (arena `slot` and `free`, zmq `token`): a consumer's copy."""
    if isinstance(h, (ShmHandle, NixlHandle)) and h.slot is not None:
        return msgspec.structs.replace(h, slot=None, free=None)
    if isinstance(h, ZmqHandle) and h.token is not None:
        return msgspec.structs.replace(h, token=None)
    return h


def identity(h: Handle) -> tuple[Any, ...] | None:
    """What memory `h` refers to (None for inline handles, which refer to none)."""
    h = as_handle(h)
    if isinstance(h, InlineHandle):
        return None
    if isinstance(h, NixlHandle):
        return ("nixl", h.free, h.offset)
    if isinstance(h, ShmHandle):
        return ("shm-arena", h.free, h.offset) if h.offset is not None else ("shm", h.path)
    if isinstance(h, ZmqHandle):
        return ("zmq", h.address, h.key)
    return ("local", h.key)  # type: ignore[union-attr]
