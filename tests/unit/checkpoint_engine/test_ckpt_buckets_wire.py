"""Packing, reassembly, wire records and config validation (no processes)."""

import msgpack
import pytest
import torch

from checkpoint_engine import WeightsConfig
from checkpoint_engine.buckets import BucketPacker, TensorAssembler, crc32
from checkpoint_engine.wire import Ack, Begin, Bucket, BucketMeta, Entry, Join, decode, encode


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "small": torch.randn(3, 5, generator=g),
        "big": torch.randn(700, generator=g).to(torch.bfloat16),      # 1400 B: spans buckets
        "empty": torch.empty(0, 4),
        "ints": torch.arange(37, dtype=torch.int64),
        "strided": torch.randn(8, 6, generator=g).t(),                 # not contiguous
        "exact": torch.randn(64, generator=g),                        # exactly one bucket
    }


@pytest.mark.timeout(30)
def test_pack_and_assemble_roundtrip_with_split_tensors():
    state, bucket = _state(), 256
    packer = BucketPacker(state.items(), bucket)
    slot = torch.empty(bucket, dtype=torch.uint8)
    assembler, got, metas = TensorAssembler(), {}, []
    while (meta := packer.fill(slot, 0, checksum=True)) is not None:
        assert meta.nbytes <= bucket and all(e.bucket_offset % 64 == 0 for e in meta.entries)
        assert meta.checksum == crc32(slot[: meta.nbytes])
        metas.append(meta)
        got.update(assembler.add(meta, slot[: meta.nbytes].clone()))
    assert set(got) == set(state) and assembler.incomplete() == []
    for name, t in state.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape
        assert torch.equal(got[name], t), name
    assert sum(1 for m in metas for e in m.entries if e.name == "big") == 6  # 1400 B / 256 B
    assert packer.total_bytes == sum(t.numel() * t.element_size() for t in state.values())


@pytest.mark.timeout(30)
def test_wire_roundtrip_and_unknown_kind_refused():
    meta = BucketMeta(3, 1, 128, 42, [Entry("a.weight", "bfloat16", [2, 3], 0, 0, 12)])
    for msg in (Join("r0", -1), Begin(1, 7, {"paths": ["/dev/shm/x"], "md": b"\x00\x01"}),
                Bucket(1, meta), Ack(1, 3)):
        assert decode(encode(msg)) == msg
    with pytest.raises(ValueError, match="unknown weight-plane message"):
        decode(msgpack.packb(["Exec", "rm -rf /"]))


@pytest.mark.parametrize("field,value", [("backend", "mpi"), ("bucket_size_mb", 0),
                                         ("timeout_s", -1), ("port", 70000), ("device", "cuda")])
def test_config_errors_name_the_key(field, value):
    with pytest.raises(ValueError, match=f"weights.{field}"):
        WeightsConfig(**{field: value})
    assert WeightsConfig(bucket_size_mb=1).bucket_bytes == 1 << 20
