"""A checkpoint another user could have written is never loaded, and no checkpoint is unpickled (issue 44,
items 1 and 2): torch DCP's own `.metadata` is a pickle, so `asyncrl export` of another user's run, or a
resume of a checkpoint with a file another user made or may write, would have run their code as you.

A real run with checkpoints; then, as another user would have left them (files given to uid 54321, a
directory opened to everyone), `asyncrl export` and `asyncrl train ... resume=true` each stop with one line
naming the file and its owner, before anything of the checkpoint is read. Then the checkpoint, this user's
own, in DCP's pickle format with a `.metadata` whose unpickling would write a file: export and resume refuse
it in one line, and the file is not written. The format itself: `tests/unit/trainer/test_ckpt_format.py`.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys

import pytest


class _Marker:
    """Unpickling this runs code: it creates the file `path`."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def _cli(tmp_path, *args):
    return subprocess.run([sys.executable, "-m", "asyncrl.cli", *args], capture_output=True, text=True, timeout=240, cwd=tmp_path)


@pytest.mark.timeout(400)
def test_a_checkpoint_of_another_user_or_open_to_others_is_neither_exported_nor_resumed(tmp_path):
    run = ["train", "trainer.eval_every=100", "trainer.save_every=1", f"logging.run_root={tmp_path}/runs",
           "logging.run_name=r", "logging.mlflow=false", "logging.progress=false"]
    first = _cli(tmp_path, *run, "trainer.total_steps=2")
    assert first.returncode == 0, first.stderr[-2000:]
    run_dir = tmp_path / "runs" / "r"
    ckpt = run_dir / "checkpoints" / "step_000002"
    ok = _cli(tmp_path, "export", str(run_dir), str(tmp_path / "out-ok"))
    assert ok.returncode == 0, ok.stderr[-2000:]
    metadata = ckpt / "trainer" / "asyncrl_dcp.json"
    os.chown(metadata, 54321, 54321)  # an index another user made
    out = _cli(tmp_path, "export", str(run_dir), str(tmp_path / "out-theirs"))
    assert out.returncode != 0 and "owned by uid 54321" in out.stderr and "asyncrl_dcp.json" in out.stderr, out.stderr[-2000:]
    assert not (tmp_path / "out-theirs").exists()
    resumed = _cli(tmp_path, *run, "trainer.total_steps=3", "resume=true")
    assert resumed.returncode != 0 and "owned by uid 54321" in resumed.stderr, resumed.stderr[-2000:]
    assert "Traceback" not in resumed.stderr
    os.chown(metadata, os.getuid(), os.getgid())
    (ckpt / "trainer").chmod(0o777)  # a directory anyone could have put a file in
    out = _cli(tmp_path, "export", str(run_dir), str(tmp_path / "out-open"))
    assert out.returncode != 0 and "writable by others" in out.stderr, out.stderr[-2000:]
    (ckpt / "trainer").chmod(0o700)
    index = metadata.read_bytes()
    metadata.unlink()  # DCP's own format: a .metadata pickle that runs code when loaded
    marker = tmp_path / "unpickled"
    (ckpt / "trainer" / ".metadata").write_bytes(pickle.dumps(_Marker(marker)))
    out = _cli(tmp_path, "export", str(run_dir), str(tmp_path / "out-pickle"))
    assert out.returncode != 0 and ".metadata is a pickle" in out.stderr and "Traceback" not in out.stderr, out.stderr[-2000:]
    resumed = _cli(tmp_path, *run, "trainer.total_steps=3", "resume=true")
    assert resumed.returncode != 0 and ".metadata is a pickle" in resumed.stderr, resumed.stderr[-2000:]
    assert "Traceback" not in resumed.stderr and not marker.exists()
    (ckpt / "trainer" / ".metadata").unlink()
    metadata.write_bytes(index)
    metadata.chmod(0o600)
    again = _cli(tmp_path, *run, "trainer.total_steps=3", "resume=true")
    assert again.returncode == 0 and '"resumed": true' in (run_dir / "summary.json").read_text(), again.stderr[-2000:]
