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


@pytest.mark.timeout(120)
def test_a_sweep_running_beside_a_new_sender_never_takes_its_slots():
    """Every new sender sweeps the slots of dead ones (an exclusive flock granted: nobody holds it). A slot
    made under its own name and locked a moment later could be taken for an orphan in between by a sweep of
    another sender starting then (a suite run lost one: the receiver's open failed). Slots are now made under
    a name no sweep matches, locked, then linked into place: a sweep in a loop beside 300 new senders takes
    none of their slots."""
    import threading

    from checkpoint_engine.backends.shm import sweep_dead

    stop, swept = threading.Event(), []

    def sweep():
        while not stop.is_set():
            swept.append(sweep_dead())

    th = threading.Thread(target=sweep)
    th.start()
    lost = []
    try:
        for _ in range(300):
            t = ShmSenderTransport(WeightsConfig(backend="shm", bucket_size_mb=0.0625))
            lost += [p for p in t.paths if not os.path.exists(p)]
            t.close()
    finally:
        stop.set()
        th.join()
    assert not lost, f"{len(lost)} slots of live senders were swept"
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(".asyncrl-weights-")]  # no first name left
