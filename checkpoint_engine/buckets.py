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

import zlib
from typing import Iterable, Iterator

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
    """Fills slots from an iterator of (name, tensor); one `fill` call = one bucket.

    Only tensors larger than a bucket are split; one that fits an empty bucket but not the
    room left starts the next bucket (split tensors cost the receiver an assembly copy).
    Example (bucket 64 B, tensor starts aligned to 64 B), tensors a (40 B), b (100 B), c (8 B):
      bucket 0 = [a 0..40]; bucket 1 = [b 0..64]; bucket 2 = [b 64..100, c @64].
    """

    def __init__(self, named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int):
        self._it: Iterator[tuple[str, torch.Tensor]] = iter(named_tensors)
        self._bucket_bytes = bucket_bytes
        self._pending: tuple[str, torch.Tensor, torch.Tensor, int] | None = None
        self.index = 0
        self.exhausted = False
        self.total_bytes = 0

    def _next_tensor(self) -> tuple[str, torch.Tensor, torch.Tensor, int] | None:
        if self._pending is not None:
            return self._pending
        item = next(self._it, None)
        if item is None:
            return None
        name, tensor = item
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"publish expects (name, torch.Tensor) pairs; {name!r} is {type(tensor)}")
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
                entries.append(
                    Entry(name, dtype_name(tensor.dtype), list(tensor.shape), used, done, n)
                )
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
    copy); a split tensor is assembled into its own buffer as its chunks arrive."""

    def __init__(self) -> None:
        self._partial: dict[str, tuple[torch.Tensor, int]] = {}

    def add(self, meta: BucketMeta, buf: torch.Tensor, borrowed: bool = False
            ) -> list[tuple[str, torch.Tensor]]:
        """`buf` holds the bucket's first `meta.nbytes` bytes. Owned (`borrowed=False`): it
        must not be reused, whole tensors are views of it. Borrowed: it is reused after this
        call, so every tensor is copied out (once) into its own buffer."""
        out: list[tuple[str, torch.Tensor]] = []
        for e in meta.entries:
            dtype = dtype_from_name(e.dtype)
            numel = 1
            for d in e.shape:
                numel *= d
            total = numel * torch.empty((), dtype=dtype).element_size()
            chunk = buf[e.bucket_offset : e.bucket_offset + e.nbytes]
            if e.tensor_offset == 0 and e.nbytes == total:
                t = chunk.view(dtype).reshape(e.shape)
                out.append((e.name, t.clone() if borrowed else t))
                continue
            flat, got = self._partial.get(e.name) or (
                torch.empty(total, dtype=torch.uint8, device=buf.device), 0)
            flat[e.tensor_offset : e.tensor_offset + e.nbytes].copy_(chunk)
            got += e.nbytes
            if got == total:
                self._partial.pop(e.name, None)
                out.append((e.name, flat.view(dtype).reshape(e.shape)))
            else:
                self._partial[e.name] = (flat, got)
        return out

    def incomplete(self) -> list[str]:
        return sorted(self._partial)
