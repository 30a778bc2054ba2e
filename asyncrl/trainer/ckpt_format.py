"""A trainer checkpoint's files, written and read without pickle.

Job: the storage writer and reader, and the two planners, that `trainer.checkpoint` hands to
torch.distributed.checkpoint (DCP). DCP still plans the save and the load, so every rank writes and reads
only its own shards and a run saved with N ranks resumes on M; what changes is the files. DCP's own
`FileSystemWriter` writes its metadata with `pickle` and every non-tensor value (step, LR schedule,
optimizer settings) with `torch.save`, and its loader reads them back with `pickle.load` and
`torch.load(weights_only=False)`: whoever could write a file of a checkpoint could run code as the user who
resumes or exports it. Here nothing read from a checkpoint is code:

    <ckpt>/trainer/rank_<r>.safetensors   what rank r wrote: each tensor chunk as a tensor, each other value
                                          as a uint8 tensor of its msgpack encoding (`encode_value`)
    <ckpt>/trainer/asyncrl_dcp.json       DCP's metadata as JSON (`METADATA`), written last by the coordinator

Reading parses that JSON, safetensors headers (JSON) and raw tensor bytes, and msgpack of plain values
(None, bool, int, float, str, bytes, list, tuple, dict): a value of any other type is refused at save time,
naming its key. Whatever a file holds is checked against the metadata (names, dtypes, shapes); anything else
is `CheckpointFormatError`, one line naming the file. A folder in DCP's own format (a `.metadata` pickle, as
asyncrl wrote before) is refused the same way, unread.

Boundary: no knowledge of the engine (`trainer.checkpoint`) or of run directories and their ownership
(`run_dir.check_own_tree`, called before anything here reads).
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import re
from pathlib import Path
from typing import Any

import msgpack
import torch
from torch.futures import Future
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                   MetadataIndex, TensorProperties, TensorStorageMetadata)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem, SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult

METADATA = "asyncrl_dcp.json"
"""The checkpoint's index; its presence marks a trainer checkpoint of this format."""
FORMAT = "asyncrl-dcp/1"
_FILE = re.compile(r"rank_[0-9]{1,6}\.safetensors")
_TUPLE = 1  # msgpack ext code of a tuple (AdamW's betas), so that a value comes back as it went
_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64,
                                                      torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8,
                                                      torch.bool)}


class CheckpointFormatError(ValueError):
    """A checkpoint this module does not read, as one line naming the file."""


def _plain(v: Any, key: str) -> Any:
    if v is None or isinstance(v, (bool, int, float, str, bytes)):
        return v
    if isinstance(v, tuple):
        return msgpack.ExtType(_TUPLE, msgpack.packb([_plain(x, key) for x in v], use_bin_type=True))
    if isinstance(v, list):
        return [_plain(x, key) for x in v]
    if isinstance(v, dict) and all(isinstance(k, (str, int)) for k in v):
        return {k: _plain(x, key) for k, x in v.items()}
    raise TypeError(f"checkpoint: {key}: a {type(v).__name__} is not written (plain values only: None, bool, int, "
                    "float, str, bytes, and lists, tuples and dicts of them; tensors as tensors)")


def encode_value(v: Any, key: str) -> bytes:
    """msgpack of a plain value `v` (the state-dict entry `key`, named in the error for anything else)."""
    return msgpack.packb(_plain(v, key), use_bin_type=True)


def _ext(code: int, data: bytes) -> Any:
    if code != _TUPLE:
        raise ValueError(f"unknown msgpack ext type {code}")
    return tuple(msgpack.unpackb(data, raw=False, strict_map_key=False, ext_hook=_ext))


def decode_value(data: bytes, where: str) -> Any:
    """The plain value `encode_value` wrote; a malformed one is `CheckpointFormatError` naming `where`."""
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=False, ext_hook=_ext)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as e:
        raise CheckpointFormatError(f"{where}: not a msgpack value ({e})") from None


class SavePlannerNoPickle(DefaultSavePlanner):
    """DCP's default planner, with non-tensor values as msgpack instead of `torch.save`."""

    def transform_object(self, write_item: WriteItem, object: Any) -> Any:
        if write_item.type == WriteItemType.BYTE_IO:
            return io.BytesIO(encode_value(object, write_item.index.fqn))
        return object


class LoadPlannerNoPickle(DefaultLoadPlanner):
    """DCP's default planner, with non-tensor values read from msgpack instead of `torch.load`."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        from torch.distributed.checkpoint._traverse import set_element

        fqn = read_item.dest_index.fqn
        obj = decode_value(value.getvalue(), f"checkpoint entry {fqn}")
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


class Writer(StorageWriter):
    """Each rank's items into `rank_<r>.safetensors`; the coordinator's `finish` writes `asyncrl_dcp.json`."""

    def __init__(self, path: str | os.PathLike) -> None:
        super().__init__()
        self.path = Path(path)

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id:
            self.path = Path(checkpoint_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        pass

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        self.path.mkdir(parents=True, exist_ok=True)
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return [dataclasses.replace(p, storage_data=f"rank_{i}.safetensors") for i, p in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        from safetensors.torch import save_file

        name = str(plan.storage_data)
        tensors: dict[str, torch.Tensor] = {}
        storages: set[int] = set()
        results = []
        for i, item in enumerate(plan.items):
            data = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                t = torch.frombuffer(bytearray(data.getbuffer()), dtype=torch.uint8)  # type: ignore[union-attr]
            else:
                t = data.detach().to("cpu").contiguous()  # type: ignore[union-attr]
                storage = t.untyped_storage()
                if storage.data_ptr() in storages or storage.nbytes() != t.numel() * t.element_size():
                    t = t.clone()  # tied weights, or a chunk of a larger tensor: safetensors takes one tensor per storage
                storages.add(t.untyped_storage().data_ptr())
            key = str(i)
            tensors[key] = t
            results.append(WriteResult(index=item.index, size_in_bytes=t.numel() * t.element_size(),
                                       storage_data={"file": name, "key": key}))
        tmp = self.path / (name + ".tmp")
        save_file(tensors, str(tmp))
        os.replace(tmp, self.path / name)
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        tmp = self.path / (METADATA + ".tmp")
        tmp.write_text(json.dumps(metadata_to_json(metadata, [r for rs in results for r in rs])))
        os.replace(tmp, self.path / METADATA)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return True


def metadata_to_json(metadata: Metadata, results: list[WriteResult]) -> dict[str, Any]:
    """DCP's metadata and where each item lies, as a JSON object."""
    entries: dict[str, Any] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, BytesStorageMetadata):
            entries[fqn] = {"bytes": True}
            continue
        p = md.properties
        if p.layout != torch.strided or p.memory_format != torch.contiguous_format:
            raise TypeError(f"checkpoint: {fqn}: only strided, contiguous tensors are written")
        entries[fqn] = {"dtype": str(p.dtype).removeprefix("torch."), "size": list(md.size),
                        "chunks": [{"offsets": list(c.offsets), "sizes": list(c.sizes)} for c in md.chunks]}
    mappings = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
    return {"format": FORMAT, "entries": entries,
            "paths": {k: list(v) for k, v in mappings.items()},
            "items": [{"fqn": r.index.fqn, "offset": None if r.index.offset is None else list(r.index.offset),
                       "file": r.storage_data["file"], "key": r.storage_data["key"]} for r in results]}


def _ints(v: Any, what: str) -> list[int]:
    if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v):
        raise ValueError(f"{what}: not a list of integers >= 0")
    return v


def metadata_from_json(doc: Any) -> Metadata:
    """`metadata_to_json`'s object back as DCP's `Metadata`; anything malformed is ValueError saying what."""
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ValueError(f"not {FORMAT}")
    entries, items, paths = doc.get("entries"), doc.get("items"), doc.get("paths", {})
    if not isinstance(entries, dict) or not isinstance(items, list) or not isinstance(paths, dict):
        raise ValueError("entries, items and paths must be an object, a list and an object")
    sd_md: dict[str, Any] = {}
    for fqn, e in entries.items():
        if not isinstance(e, dict):
            raise ValueError(f"entries.{fqn}: not an object")
        if e.get("bytes") is True:
            sd_md[fqn] = BytesStorageMetadata()
            continue
        if e.get("dtype") not in _DTYPES or not isinstance(e.get("chunks"), list):
            raise ValueError(f"entries.{fqn}: dtype one of {sorted(_DTYPES)} and a list of chunks needed")
        size = _ints(e.get("size"), f"entries.{fqn}.size")
        chunks = []
        for c in e["chunks"]:
            if not isinstance(c, dict):
                raise ValueError(f"entries.{fqn}.chunks: not an object")
            off, sz = _ints(c.get("offsets"), f"entries.{fqn} offsets"), _ints(c.get("sizes"), f"entries.{fqn} sizes")
            if len(off) != len(size) or len(sz) != len(size) or any(o + s > n for o, s, n in zip(off, sz, size)):
                raise ValueError(f"entries.{fqn}: a chunk outside the tensor's size {size}")
            chunks.append(ChunkStorageMetadata(offsets=torch.Size(off), sizes=torch.Size(sz)))
        sd_md[fqn] = TensorStorageMetadata(properties=TensorProperties(dtype=_DTYPES[e["dtype"]]), size=torch.Size(size),
                                           chunks=chunks)
    storage: dict[MetadataIndex, dict[str, str]] = {}
    for it in items:
        if not isinstance(it, dict) or it.get("fqn") not in sd_md or not isinstance(it.get("key"), str) \
                or not isinstance(it.get("file"), str) or not _FILE.fullmatch(it["file"]):
            raise ValueError(f"items: {str(it)[:120]!r} is not an item of a listed entry in a rank_<r>.safetensors")
        off = it.get("offset")
        index = MetadataIndex(it["fqn"], None if off is None else _ints(off, f"items.{it['fqn']}.offset"))
        storage[index] = {"file": it["file"], "key": it["key"]}
    mappings = {}
    for k, v in paths.items():
        if not isinstance(v, list) or not all(isinstance(x, (str, int)) for x in v):
            raise ValueError(f"paths.{k}: not a list of keys")
        mappings[k] = tuple(v)
    return Metadata(state_dict_metadata=sd_md, planner_data=mappings, storage_data=storage)


_ST_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "float64": "F64", "int64": "I64",
              "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL"}


def verify(path: str | os.PathLike) -> Metadata:
    """The checkpoint folder `path` checked whole before DCP reads it (DCP would wrap an error of a rank into
    its own): the index parses; every item lies in a `rank_<r>.safetensors` of the folder, under its key, with
    its entry's dtype and its chunk's shape; every non-tensor value is a msgpack value. Returns DCP's metadata;
    anything else is `CheckpointFormatError`, one line naming the file."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    refuse_other_format(path)
    where = path / METADATA
    try:
        md = metadata_from_json(json.loads(where.read_bytes()))
    except (ValueError, RecursionError) as e:  # json.JSONDecodeError is a ValueError
        raise CheckpointFormatError(f"{where}: not a trainer checkpoint's index ({e})") from None
    per_file: dict[str, list[tuple[MetadataIndex, str]]] = {}
    for index, info in md.storage_data.items():
        per_file.setdefault(info["file"], []).append((index, info["key"]))
    for name, items in per_file.items():
        f_path = path / name
        try:
            with safe_open(str(f_path), framework="pt") as f:
                keys = set(f.keys())
                for index, key in items:
                    if key not in keys:
                        raise CheckpointFormatError(f"{f_path}: no tensor {key!r} ({index.fqn})")
                    _check_item(f, key, index, md.state_dict_metadata[index.fqn], f_path)
        except (SafetensorError, OSError) as e:
            raise CheckpointFormatError(f"{f_path}: not readable as safetensors ({e})") from None
    return md


def _check_item(f: Any, key: str, index: MetadataIndex, entry: Any, f_path: Path) -> None:
    sl = f.get_slice(key)
    dtype, shape = sl.get_dtype(), list(sl.get_shape())
    if isinstance(entry, BytesStorageMetadata):
        if dtype != "U8" or len(shape) != 1:
            raise CheckpointFormatError(f"{f_path}: {index.fqn} is not a byte string")
        decode_value(f.get_tensor(key).numpy().tobytes(), f"{f_path}: {index.fqn}")
        return
    chunk = next((c for c in entry.chunks if index.offset is not None and list(c.offsets) == list(index.offset)), None)
    want = _ST_DTYPES.get(str(entry.properties.dtype).removeprefix("torch."))
    if chunk is None or dtype != want or shape != list(chunk.sizes):
        raise CheckpointFormatError(f"{f_path}: {index.fqn} at {None if index.offset is None else list(index.offset)} "
                                    f"is {dtype} {shape}, its index says "
                                    f"{want} {None if chunk is None else list(chunk.sizes)}")


def refuse_other_format(path: Path) -> None:
    """One line when `path` is not a checkpoint of this format (DCP's own pickle among them, never read)."""
    if (path / METADATA).is_file():
        return
    if (path / ".metadata").exists():
        raise CheckpointFormatError(
            f"{path}: a checkpoint in torch.distributed.checkpoint's own format (.metadata is a pickle, as asyncrl "
            f"wrote before {FORMAT}); it is not read, since unpickling a file can run any code")
    raise CheckpointFormatError(f"{path}: not a trainer checkpoint (no {METADATA})")


class Reader(StorageReader):
    """Reads what `Writer` wrote: JSON, safetensors and msgpack only. `verified`: what `verify(path)` returned
    (the caller checked the folder already: it is not read twice); else `read_metadata` verifies it."""

    def __init__(self, path: str | os.PathLike, verified: Metadata | None = None) -> None:
        super().__init__()
        self.path = Path(path)
        self.verified = verified
        self.storage: dict[MetadataIndex, dict[str, str]] = {}

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        self.storage = {}
        if checkpoint_id and Path(checkpoint_id) != self.path:
            self.path, self.verified = Path(checkpoint_id), None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self.verified if self.verified is not None else verify(self.path)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.storage = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        from safetensors import SafetensorError, safe_open

        per_file: dict[str, list[ReadItem]] = {}
        for req in plan.items:
            per_file.setdefault(self.storage[req.storage_index]["file"], []).append(req)
        for name, reqs in per_file.items():
            where = self.path / name
            try:
                with safe_open(str(where), framework="pt") as f:
                    for req in reqs:
                        self._read_one(f, req, planner, where)
            except (SafetensorError, OSError) as e:
                raise CheckpointFormatError(f"{where}: not readable as safetensors ({e})") from None
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _read_one(self, f: Any, req: ReadItem, planner: LoadPlanner, where: Path) -> None:
        """One item; its key, dtype and shape were checked against the index by `verify`."""
        t = f.get_tensor(self.storage[req.storage_index]["key"])
        if req.type == LoadItemType.BYTE_IO:
            planner.load_bytes(req, io.BytesIO(t.numpy().tobytes()))
            return
        part = t
        for d, (o, n) in enumerate(zip(req.storage_offsets, req.lengths)):
            part = part.narrow(d, o, n)
        target = planner.resolve_tensor(req).detach()
        if target.size() != part.size():
            raise CheckpointFormatError(f"{where}: {req.storage_index.fqn} is {part.dtype} {list(part.shape)}, the "
                                        f"model's {target.dtype} {list(target.shape)}")
        target.copy_(part)
        planner.commit_tensor(req, target)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return True
