"""The python sandbox contains an infinite loop, a memory bomb, a fork bomb and network access, and reports each.

(Host isolation — private /tmp, host sockets, secrets, signals, refused configs — is in tests/faults/test_sandbox_*.py.)

Limits are small so that a failure of containment shows up as a slow or failing test, not
as a loaded host; every test checks that no process of the run is left behind.
"""

from __future__ import annotations

import ast
import asyncio
import os
import socket
import subprocess
import sys
import time

import pytest

from agents.tools import PythonTool, SandboxLimits, run_python
from agents.tools.sandbox_host import exposures, first_unreachable, processes_of

SMALL = dict(wall_s=3.0, cpu_s=1, memory_mb=256, max_processes=4)


def sandbox(code: str, **kw: object):
    t = time.monotonic()
    r = asyncio.run(run_python(code, SandboxLimits(**(SMALL | kw))))
    return r, time.monotonic() - t


def assert_nothing_left(r) -> None:
    uid = r.isolation.get("uid")
    if uid not in (None, 0, os.getuid()):
        deadline = time.monotonic() + 2.0  # SIGKILLed processes may still be on their way out
        while processes_of(uid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert processes_of(uid) == []
    assert subprocess.run(["true"]).returncode == 0  # the host can still start processes


def test_ordinary_run_output_workdir_and_truncation():
    r, _ = sandbox("import os, sys\nprint(os.getcwd())\nprint('e', file=sys.stderr)")
    assert r.ok and r.stderr == "e\n" and r.isolation["net"] == "netns" and r.isolation["pid"] == "pidns"
    workdir = r.stdout.strip()
    assert workdir.startswith("/tmp/asyncrl-sandbox-") and not os.path.exists(workdir)
    if os.geteuid() == 0:  # a fresh uid; root-only directories around the interpreter are hidden, not opened
        assert r.isolation["uid"] != 0 and r.isolation["procs"] == "rlimit_nproc"
        pairs = exposures(sys.executable)  # what this interpreter imports from, wherever the checkout lives
        assert r.isolation["hidden"] == sorted({h for h, _ in pairs})
        if first_unreachable(sys.base_prefix):
            assert first_unreachable(sys.base_prefix) in r.isolation["hidden"]
        for hide in r.isolation["hidden"]:
            r, _ = sandbox(f"import os, json, statistics, numpy\nprint(os.listdir({hide!r}))")
            assert r.ok, r.stderr
            kept = {os.path.relpath(k, hide).split("/")[0] for h, k in pairs if k.startswith(hide + "/")}
            seen = {e for e in ast.literal_eval(r.stdout) if not e.startswith("asyncrl-sandbox-")}  # the run's own workdir
            assert seen <= kept
    r, _ = sandbox("print('x' * 100000)", max_output_chars=1000)
    assert r.ok and r.truncated and len(r.stdout) == 1000


def test_infinite_loop_is_stopped_and_reported():
    r, dt = sandbox("while True:\n    pass")
    assert not r.ok and dt < SMALL["wall_s"] + 2.0
    assert r.timed_out or r.exit_code in (-9, -24)  # wall clock, or RLIMIT_CPU (SIGKILL / SIGXCPU)
    assert "timed out" in r.describe_failure() or "CPU" in r.describe_failure()
    assert_nothing_left(r)


def test_memory_bomb_is_refused():
    r, dt = sandbox("chunks = []\nwhile True:\n    chunks.append(bytearray(50 * 2**20))")
    assert not r.ok and dt < SMALL["wall_s"] + 2.0
    assert r.describe_failure() == "memory limit exceeded (MemoryError)"
    r, _ = sandbox("x = bytearray(4 * 2**30)")
    assert "MemoryError" in r.stderr
    assert_nothing_left(r)


COUNT_CHILDREN = """
import os, time
pids = []
for i in range(20):
    try:
        pid = os.fork()
    except Exception as e:
        print("refused", type(e).__name__)
        break
    if pid == 0:
        time.sleep(30)
        os._exit(0)
    pids.append(pid)
print("children", len(pids), flush=True)
"""


def test_fork_bomb_is_contained():
    r, _ = sandbox(COUNT_CHILDREN)
    assert "refused" in r.stdout and r.ok  # done when the main process exits, though children still sleep
    children = int(r.stdout.split("children")[1])
    assert r.isolation["procs"] == "rlimit_nproc"
    assert 1 <= children < SMALL["max_processes"]  # RLIMIT_NPROC counts the parent too
    assert_nothing_left(r)  # the sleeping children were killed with the run
    r, dt = sandbox("import os\nwhile True:\n    try:\n        os.fork()\n    except Exception:\n        pass")
    assert (r.timed_out or r.exit_code in (-9, -24)) and dt < SMALL["wall_s"] + 3.0  # wall clock or CPU limit
    assert_nothing_left(r)


@pytest.fixture
def listener():
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    srv.setblocking(False)
    yield srv
    srv.close()


def test_network_is_refused(listener):
    port = listener.getsockname()[1]
    code = f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('connected')"
    r, dt = sandbox(code)
    assert not r.ok and "connected" not in r.stdout and dt < 5
    assert r.isolation["net"] == "netns"
    assert "Network is unreachable" in r.stderr or "Connection refused" in r.stderr
    with pytest.raises(BlockingIOError):
        listener.accept()  # nothing reached the host's loopback
    r, _ = sandbox("import socket\nsocket.getaddrinfo('example.com', 80)")
    assert not r.ok


def test_python_tool_reports_errors_as_text():
    tool = PythonTool(**SMALL)
    assert asyncio.run(tool(code="print(6 * 7)")) == "42\n"
    out = asyncio.run(tool(code="while True: pass"))
    assert out.startswith("Error: ") and ("timed out" in out or "CPU" in out)
    out = asyncio.run(tool(code="print('before')\n1/0"))
    assert out.startswith("Error: exit code 1") and "before\n" in out and "ZeroDivisionError" in out


def test_code_runs_under_a_private_run_umask():
    """A run makes its umask 077 (asyncrl/run_dir.py): the sandbox's uid must still read the program
    file and the interpreter's library through the mount points the sandbox makes as root (the modules
    imported below are not frozen into the interpreter: they are read from its lib directory)."""
    old = os.umask(0o077)
    try:
        r, _ = sandbox("import glob, json, socket\nprint(6 * 7)")
    finally:
        os.umask(old)
    assert r.ok, r.stderr
    assert r.stdout == "42\n"
    assert_nothing_left(r)
