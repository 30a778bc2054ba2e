"""A trainer checkpoint is written and read without pickle (issue 44, items 1 and 2; `trainer.ckpt_format`).

Real FSDP2 on one gloo rank, a real train step, save, load into a fresh engine and export's reader, with
every unpickler of the process (pickle.load/loads, pickle.Unpickler, torch.load) replaced by one that fails
the test. Then checkpoints as an attacker would leave them, all owned by this user (the ownership check is
`tests/faults/test_checkpoint_owner.py`): DCP's own `.metadata` pickle whose load would run code, a byte
value replaced by a pickle, an index naming a file outside the folder, a tensor of the wrong shape. Each is
one `CheckpointFormatError` line and nothing runs.
"""

from __future__ import annotations

import json
import pickle

import pytest
import torch

from asyncrl.config import AlgorithmConfig, TrainerConfig
from asyncrl.trainer import ckpt_format
from asyncrl.trainer.ckpt_format import CheckpointFormatError
from asyncrl.trainer.engine import TrainerEngine
from asyncrl.trainer.synthetic import synthetic_batch


def _engine(path):
    return TrainerEngine(path, trainer=TrainerConfig(micro_batch_size=3, lr=1e-3, total_steps=10, minibatches=1),
                         algorithm=AlgorithmConfig())


class _Marker:
    """Unpickling this runs code: it writes the file `path`."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.fixture
def no_unpickling(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a checkpoint was unpickled")

    class Refused(pickle.Unpickler):
        def __init__(self, *args, **kwargs):
            refuse()

    for mod, name, fn in ((pickle, "load", refuse), (pickle, "loads", refuse), (pickle, "Unpickler", Refused),
                          (torch, "load", refuse)):
        monkeypatch.setattr(mod, name, fn)


def test_save_load_and_export_read_no_pickle(tiny_model_path, tmp_path, no_unpickling):
    from asyncrl.export import load_policy_weights

    batch = synthetic_batch(6, vocab_size=100, seed=4)
    a = _engine(tiny_model_path)
    try:
        a.train_step(batch)
        a.save(str(tmp_path / "ckpt"))
        saved = {k: v.clone() for k, v in a.iter_full_params()}
        betas = a.optimizer.param_groups[0]["betas"]
    finally:
        a.close()
    files = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert files == [ckpt_format.METADATA, "rank_0.safetensors"], files
    b = _engine(tiny_model_path)
    try:
        b.load(str(tmp_path / "ckpt"))
        assert b.step == 1 and b.optimizer.param_groups[0]["betas"] == betas
        assert isinstance(b.optimizer.param_groups[0]["betas"], tuple)  # msgpack keeps a tuple a tuple
        for name, t in b.iter_full_params():
            assert torch.equal(t, saved[name]), name
    finally:
        b.close()
    exported = load_policy_weights(tmp_path / "ckpt")
    assert set(exported) == set(saved)
    assert all(torch.equal(exported[k], saved[k]) for k in saved)


@pytest.fixture(scope="module")
def saved(tiny_model_path, tmp_path_factory):
    path = tmp_path_factory.mktemp("ck") / "ckpt"
    e = _engine(tiny_model_path)
    try:
        e.save(str(path))
    finally:
        e.close()
    return path


def _load(model_path, path):
    e = _engine(model_path)
    try:
        e.load(str(path))
    finally:
        e.close()


def _copy(saved, tmp_path):
    import shutil

    dst = tmp_path / "ckpt"
    shutil.copytree(saved, dst)
    return dst


def _raised(fn):
    with pytest.raises(CheckpointFormatError) as info:
        fn()
    return str(info.value)


def test_dcp_pickle_metadata_is_refused_unread(tiny_model_path, saved, tmp_path):
    from asyncrl.export import ExportError, load_policy_weights

    ck = _copy(saved, tmp_path)
    (ck / ckpt_format.METADATA).unlink()
    marker = tmp_path / "ran"
    (ck / ".metadata").write_bytes(pickle.dumps(_Marker(marker)))  # what DCP's own loader would run
    msg = _raised(lambda: _load(tiny_model_path, ck))
    assert ".metadata is a pickle" in msg and "\n" not in msg
    with pytest.raises(ExportError, match="is a pickle"):
        load_policy_weights(ck)
    assert not marker.exists()


def test_a_pickle_in_place_of_a_value_is_refused(tiny_model_path, saved, tmp_path):
    from safetensors.torch import load_file, save_file

    ck = _copy(saved, tmp_path)
    index = json.loads((ck / ckpt_format.METADATA).read_text())
    step_key = next(it["key"] for it in index["items"] if it["fqn"] == "trainer.step")
    marker = tmp_path / "ran"
    tensors = load_file(str(ck / "rank_0.safetensors"))
    tensors[step_key] = torch.frombuffer(bytearray(pickle.dumps(_Marker(marker))), dtype=torch.uint8)
    save_file(tensors, str(ck / "rank_0.safetensors"))
    msg = _raised(lambda: _load(tiny_model_path, ck))
    assert "trainer.step" in msg and "not a msgpack value" in msg
    assert not marker.exists()


@pytest.mark.parametrize("forge", ["outside", "shape", "junk"])
def test_a_forged_index_is_one_line(tiny_model_path, saved, tmp_path, forge):
    ck = _copy(saved, tmp_path)
    path = ck / ckpt_format.METADATA
    index = json.loads(path.read_text())
    if forge == "outside":  # an item read from a file outside the checkpoint
        index["items"][0]["file"] = "../../etc/passwd"
    elif forge == "shape":  # a chunk larger than the tensor in the file
        fqn, entry = next((k, v) for k, v in index["entries"].items() if "chunks" in v and len(v["size"]) == 2)
        entry["size"][0] += 5
        entry["chunks"][0]["sizes"][0] += 5
    path.write_text(json.dumps(index) if forge != "junk" else "{" * 100_000)
    msg = _raised(lambda: _load(tiny_model_path, ck))
    assert str(ck) in msg and "\n" not in msg
