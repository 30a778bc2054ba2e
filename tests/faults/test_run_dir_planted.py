"""A run directory another user planted is refused, never written through (issue 44, items 3 and 4, and
the run-directory half of item 2).

The attacks, with the other user's files made here as root and given to uid 54321 (what that user would
have left): the run directory's path pre-created 0777 by them with links planted inside to the running
user's own 0600 files; the path a link to their folder; a newer run directory of theirs with checkpoints
under a shared runs root, for `resume=true` to pick. A real `asyncrl train` each time: one line naming the
path, the owner and the key, and the running user's files untouched.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

OTHER = 54321


def _train(root: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "asyncrl.cli", "train", "trainer.total_steps=1", "trainer.eval_every=100",
                           f"logging.run_root={root}", "logging.mlflow=false", "logging.progress=false", *extra],
                          capture_output=True, text=True, timeout=240, cwd=root.parent)


def _theirs(p: Path, mode: int) -> Path:
    if not os.path.lexists(p):
        p.mkdir()
    os.chown(p, OTHER, OTHER, follow_symlinks=False)
    if not p.is_symlink():
        p.chmod(mode)
    return p


@pytest.fixture
def root(tmp_path):
    tmp_path.chmod(0o755)
    r = tmp_path / "runs"
    r.mkdir()
    r.chmod(0o1777)  # a shared runs root, as /tmp is
    return r


@pytest.mark.timeout(300)
def test_planted_run_directories_are_refused_and_nothing_is_written_through(root, tmp_path):
    mine = tmp_path / "my_notes"
    mine.mkdir()
    victim = mine / "precious.txt"
    victim.write_text("mine")
    victim.chmod(0o600)
    # 3. the path pre-created by the other user, 0777, with links to the running user's own file
    planted = _theirs(root / "planted", 0o777)
    for name in ("config.yaml", "status.json", "status.json.tmp"):
        (planted / name).symlink_to(victim)
        _theirs(planted / name, 0)
    out = _train(root, "logging.run_name=planted")
    assert out.returncode != 0 and "logging.run_name" in out.stderr and f"uid {OTHER}" in out.stderr, out.stderr[-2000:]
    assert victim.read_text() == "mine"
    # 4. the path a link to the other user's folder
    theirs = _theirs(tmp_path / "their_folder", 0o777)
    (root / "linked").symlink_to(theirs)
    out = _train(root, "logging.run_name=linked")
    assert out.returncode != 0 and "symbolic link" in out.stderr, out.stderr[-2000:]
    assert list(theirs.iterdir()) == []
    # 2. resume=true under the shared root: the newest run with checkpoints is the other user's
    own = _train(root, "logging.run_name=own", "trainer.save_every=1")
    assert own.returncode == 0, own.stderr[-2000:]
    time.sleep(0.05)
    newer = _theirs(root / "newer", 0o755)
    (newer / "checkpoints" / "step_000001").mkdir(parents=True)
    os.utime(newer, None)
    resumed = _train(root, "resume=true", "trainer.total_steps=2")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"run directory {root / 'own'}" in resumed.stdout and "newer" not in resumed.stdout
    out = _train(root, "resume=true", "logging.run_name=newer")
    assert out.returncode != 0 and f"uid {OTHER}" in out.stderr, out.stderr[-2000:]
