"""Pack a stream of (name, tensor) into fixed-size flat byte buckets, and back.

`BucketPacker` is the sender half: it pulls tensors from the caller's iterator one at a
time (so an FSDP2 gather, a dtype cast or a device copy happens only when the packer
needs the next tensor), copies their bytes into a flat uint8 slot and describes them with
`Entry` records. A tensor larger than the room left is split across buckets, so a bucket
never grows. `TensorAssembler` is the receiver half: it turns landed buckets back into
tensors, yielding each one as soon as all its bytes have arrived.

Neither half knows how bytes move between processes; that is the backends' job.
"""

from __future__ import annotations

import threading
import zlib
from typing import Any, Iterable, Iterator

import torch

from checkpoint_engine.wire import BucketMeta, Entry

ALIGN = 64


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in bucket metadata")
    return dtype


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 view (a copy only when it is not contiguous)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def crc32(buf: torch.Tensor) -> int:
    """CRC32 of a uint8 tensor's bytes (device tensors are copied to the host first)."""
    if buf.device.type != "cpu":
        buf = buf.cpu()
    return zlib.crc32(memoryview(buf.numpy()))


class BucketPacker:
    """Fills slots from an iterator of (name, tensor), or (name, piece, full shape, byte offset)
    for a contiguous piece of a tensor (a trainer rank's shard); one `fill` call = one bucket.

    Only tensors larger than a bucket are split; one that fits an empty bucket but not the
    room left starts the next bucket (split tensors cost the receiver an assembly copy).
    Example (bucket 64 B, tensor starts aligned to 64 B), tensors a (40 B), b (100 B), c (8 B):
      bucket 0 = [a 0..40]; bucket 1 = [b 0..64]; bucket 2 = [b 64..100, c @64].
    """

    def __init__(self, named_tensors: Iterable[tuple[Any, ...]], bucket_bytes: int):
        self._it: Iterator[tuple[Any, ...]] = iter(named_tensors)
        self._bucket_bytes = bucket_bytes
        self._pending: tuple[str, torch.Tensor, torch.Tensor, int] | None = None
        self._shape: list[int] = []
        self._base = 0
        self.index = 0
        self.exhausted = False
        self.total_bytes = 0

    def _next_tensor(self) -> tuple[str, torch.Tensor, torch.Tensor, int] | None:
        if self._pending is not None:
            return self._pending
        item = next(self._it, None)
        if item is None:
            return None
        name, tensor = item[0], item[1]
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"publish expects (name, torch.Tensor) pairs; {name!r} is {type(tensor)}")
        # (name, shard, full shape, byte offset): a contiguous piece of a larger tensor (a trainer
        # rank's rows); receivers assemble the pieces of every sender into the whole tensor
        self._shape, self._base = (list(item[2]), int(item[3])) if len(item) == 4 else (list(tensor.shape), 0)
        return name, tensor, as_bytes(tensor), 0

    def fill(self, slot: torch.Tensor, slot_id: int, checksum: bool) -> BucketMeta | None:
        """Copy the next bucket into `slot`; None once the iterator is exhausted."""
        entries: list[Entry] = []
        used = 0
        while used < self._bucket_bytes:
            item = self._next_tensor()
            if item is None:
                self.exhausted = True
                break
            name, tensor, raw, done = item
            if done == 0 and used > 0 and used + raw.numel() > self._bucket_bytes >= raw.numel():
                self._pending = item  # fits whole in the next bucket: do not split it
                break
            n = min(raw.numel() - done, self._bucket_bytes - used)
            if n > 0 or raw.numel() == 0:
                slot[used : used + n].copy_(raw[done : done + n], non_blocking=False)
                entries.append(Entry(name, dtype_name(tensor.dtype), self._shape, used, self._base + done, n))
            done += n
            used = min(self._bucket_bytes, (used + n + ALIGN - 1) // ALIGN * ALIGN)
            self._pending = (name, tensor, raw, done) if done < raw.numel() else None
        if not entries:
            return None
        nbytes = max(e.bucket_offset + e.nbytes for e in entries)
        self.total_bytes += sum(e.nbytes for e in entries)
        crc = crc32(slot[:nbytes]) if checksum else None
        meta = BucketMeta(self.index, slot_id, nbytes, crc, entries)
        self.index += 1
        return meta


class TensorAssembler:
    """Turns landed buckets into complete tensors, in arrival order.

    A tensor that fits in one bucket is returned as a view of that bucket's buffer (no
    copy); a split tensor is assembled into its own buffer as its chunks arrive, whichever
    bucket (or sender, for shards) they come in. With `destinations` (name -> tensor, e.g. an
    engine's parameters, contiguous) the bytes of a tensor whose dtype and shape match land
    straight in its destination (one copy, no allocation), which is then what is returned.
    Thread-safe: several updates may feed one."""

    def __init__(self, destinations: dict[str, torch.Tensor] | None = None) -> None:
        self._partial: dict[str, tuple[torch.Tensor, int]] = {}
        self._lock = threading.Lock()
        self.destinations = destinations or {}

    def _target(self, name: str, dtype: torch.dtype, shape: list[int]) -> torch.Tensor | None:
        d = self.destinations.get(name)
        if d is None or d.dtype != dtype or list(d.shape) != list(shape) or not d.is_contiguous():
            return None
        return d

    def add(self, meta: BucketMeta, buf: torch.Tensor, borrowed: bool = False
            ) -> list[tuple[str, torch.Tensor]]:
        """`buf` holds the bucket's first `meta.nbytes` bytes. Owned (`borrowed=False`): it
        must not be reused, whole tensors are views of it. Borrowed: it is reused after this
        call, so every tensor is copied out (once) into its own buffer."""
        with self._lock:
            return self._add(meta, buf, borrowed)

    def _add(self, meta: BucketMeta, buf: torch.Tensor, borrowed: bool) -> list[tuple[str, torch.Tensor]]:
        out: list[tuple[str, torch.Tensor]] = []
        for e in meta.entries:
            dtype = dtype_from_name(e.dtype)
            numel = 1
            for d in e.shape:
                numel *= d
            total = numel * torch.empty((), dtype=dtype).element_size()
            chunk = buf[e.bucket_offset : e.bucket_offset + e.nbytes]
            dest = self._target(e.name, dtype, e.shape)
            if e.tensor_offset == 0 and e.nbytes == total:
                if dest is not None:
                    dest.view(-1).view(torch.uint8).copy_(chunk)
                    out.append((e.name, dest))
                    continue
                t = chunk.view(dtype).reshape(e.shape)
                out.append((e.name, t.clone() if borrowed else t))
                continue
            if e.name in self._partial:
                flat, got = self._partial[e.name]
            elif dest is not None:
                flat, got = dest.view(-1).view(torch.uint8), 0
            else:
                flat, got = torch.empty(total, dtype=torch.uint8, device=buf.device), 0
            flat[e.tensor_offset : e.tensor_offset + e.nbytes].copy_(chunk)
            got += e.nbytes
            if got == total:
                self._partial.pop(e.name, None)
                out.append((e.name, dest if dest is not None else flat.view(dtype).reshape(e.shape)))
            else:
                self._partial[e.name] = (flat, got)
        return out

    def incomplete(self) -> list[str]:
        return sorted(self._partial)
