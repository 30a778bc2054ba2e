"""shm slot files never outlive their owner for long: removed at a normal exit without `close()`
(weakref.finalize), and after SIGKILL by the next sender's start (`sweep_dead`). Real
subprocesses, real /dev/shm files.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from checkpoint_engine import WeightsConfig
from checkpoint_engine.backends.shm import ShmSenderTransport

_CHILD = """
import sys
from checkpoint_engine import Sender, WeightsConfig
s = Sender(WeightsConfig(backend="shm", bucket_size_mb=0.1))
print(" ".join(s.transport.paths), flush=True)
sys.stdin.readline()  # exit (without close) once told, or wait to be killed
"""


def _child() -> tuple[subprocess.Popen, list[str]]:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.Popen([sys.executable, "-c", _CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, cwd=root)
    paths = proc.stdout.readline().split()
    assert len(paths) == 2 and all(os.path.exists(p) for p in paths), paths
    return proc, paths


@pytest.mark.timeout(60)
def test_slots_removed_at_exit_without_close():
    proc, paths = _child()
    proc.stdin.write("exit\n")
    proc.stdin.flush()
    assert proc.wait(30) == 0
    assert not any(os.path.exists(p) for p in paths)


@pytest.mark.timeout(60)
def test_slots_of_a_sigkilled_sender_are_swept_by_the_next_sender():
    proc, paths = _child()
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(30) == -signal.SIGKILL
    proc.stdin.close()
    assert all(os.path.exists(p) for p in paths)  # nothing ran in the killed process
    nxt = ShmSenderTransport(WeightsConfig(backend="shm", bucket_size_mb=0.1))
    try:
        assert not any(os.path.exists(p) for p in paths)
        assert all(os.path.exists(p) for p in nxt.paths)
    finally:
        nxt.close()
    assert not any(os.path.exists(p) for p in nxt.paths)
