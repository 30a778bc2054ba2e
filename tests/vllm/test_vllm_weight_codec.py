"""The byte codec that carries weights into vLLM workers (no engine needed)."""

from __future__ import annotations

import pytest
import torch

from asyncrl.engines.vllm_worker_ext import pack_chunks, unpack_chunk

pytestmark = pytest.mark.vllm


def test_roundtrip_dtypes_shapes_and_chunking() -> None:
    g = torch.Generator().manual_seed(0)
    named = [
        ("a.weight", torch.randn(8, 4, generator=g)),
        ("b.weight", torch.randn(3, 5, generator=g).to(torch.bfloat16)),
        ("c.bias", torch.arange(6, dtype=torch.int64)),
        ("d.scalar", torch.tensor(1.5, dtype=torch.float16)),
        ("e.big", torch.randn(64, 64, generator=g)),  # larger than a chunk: travels alone
        ("f.view", torch.randn(4, 6, generator=g).t()),  # non-contiguous
    ]
    chunks = list(pack_chunks(named, chunk_bytes=256))
    assert all(isinstance(m, bytes) and isinstance(p, bytes) for m, p in chunks)
    assert len(chunks) >= 3
    back = [pair for meta, payload in chunks for pair in unpack_chunk(meta, payload)]
    assert [n for n, _ in back] == [n for n, _ in named]
    for (_, want), (_, got) in zip(named, back):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got, want)


def test_import_is_cheap() -> None:
    import subprocess
    import sys

    code = "import sys, asyncrl.engines.vllm_engine; print('vllm' in sys.modules, 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]
