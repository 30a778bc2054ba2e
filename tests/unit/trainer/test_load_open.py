"""`load._open`: pread where safetensors has its `backend` option, its memory map where it has not (an older
safetensors, e.g. on a GPU image that pins one): the same tensors either way."""

import safetensors
import torch
from safetensors.torch import save_file

from asyncrl.trainer.load import _open


def test_open_reads_the_same_tensors_with_and_without_the_backend_option(tmp_path, monkeypatch):
    path = tmp_path / "model.safetensors"
    want = {"a": torch.arange(6.0).view(2, 3), "b": torch.ones(4, dtype=torch.bfloat16)}
    save_file(want, str(path))
    with _open(str(path)) as f:
        assert all(torch.equal(f.get_tensor(k), v) for k, v in want.items())

    real, seen = safetensors.safe_open, []

    def old_safe_open(filename, framework, device="cpu", **kw):  # noqa: ANN001, ANN202 - the older signature
        seen.append(kw)
        if kw:
            raise TypeError("safe_open() got an unexpected keyword argument 'backend'")
        return real(filename, framework=framework, device=device)

    monkeypatch.setattr(safetensors, "safe_open", old_safe_open)
    with _open(str(path)) as f:
        assert all(torch.equal(f.get_tensor(k), v) for k, v in want.items())
    assert seen == [{"backend": "pread"}, {}]
