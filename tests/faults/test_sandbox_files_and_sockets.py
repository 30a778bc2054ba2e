"""Sandboxed code leaves nothing in the host's /tmp, /var/tmp, /dev/shm and reaches none of its AF_UNIX sockets.

Each run gets private tmpfs mounts (gone when the run ends, invisible to a concurrent run); host
sockets are out of reach whether they sit in a covered directory (/tmp, /run), in a directory the
run can see (/dev here), or in the abstract namespace, and ctypes around Python changes nothing:
the kernel (mount + network namespaces, seccomp) refuses, not an audit hook.
"""

from __future__ import annotations

import asyncio
import ast
import os
import secrets
import socket

import pytest

from agents.tools import SandboxLimits, run_python

SMALL = dict(wall_s=8.0, cpu_s=2, memory_mb=256, max_processes=4, tmp_mb=8)
DIRS = ["/tmp", "/var/tmp", "/dev/shm"]


def sandbox(code: str, **kw: object):
    return asyncio.run(run_python(code, SandboxLimits(**(SMALL | kw))))


WRITER = """
import os, time
for d in {dirs!r}:
    with open(os.path.join(d, {name!r}), "wb") as f:
        f.write(b"x" * (1 << 20))
print(time.time(), flush=True)
time.sleep({hold})
"""

LOOKER = """
import os, time
print(time.time(), [n for d in {dirs!r} for n in os.listdir(d) if n.startswith({name!r})])
"""


@pytest.mark.timeout(60)
def test_tmp_files_are_private_to_the_run_and_gone_after_it():
    name = f"asyncrl-leak-{secrets.token_hex(4)}"

    async def both():
        writer = asyncio.ensure_future(run_python(WRITER.format(dirs=DIRS, name=name, hold=4),
                                                  SandboxLimits(**SMALL)))
        await asyncio.sleep(2.0)
        assert not any(os.path.exists(os.path.join(d, name)) for d in DIRS)  # not on the host while it runs
        looker = await run_python(LOOKER.format(dirs=DIRS, name="asyncrl-leak-"), SandboxLimits(**SMALL))
        return await writer, looker

    writer, looker = asyncio.run(both())
    assert writer.ok, writer.stderr
    wrote_at = float(writer.stdout.split()[0])
    looked_at, seen = looker.stdout.split(" ", 1)
    assert float(looked_at) > wrote_at  # the look really happened while the files existed in the writer's run
    assert ast.literal_eval(seen) == []
    assert not any(os.path.exists(os.path.join(d, name)) for d in DIRS)


@pytest.mark.timeout(30)
def test_private_tmp_is_size_limited():
    r = sandbox("open('/dev/shm/big', 'wb').write(b'x' * (16 << 20))")
    assert not r.ok and "No space left on device" in r.stderr
    assert not os.path.exists("/dev/shm/big")


def _unix_listener(path: str) -> socket.socket:
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    if not path.startswith("\0"):
        os.chmod(path, 0o777)  # anyone may connect, as e.g. /tmp/.X11-unix sockets allow
    srv.listen(4)
    srv.setblocking(False)
    return srv


CONNECT = """
import os, socket, ctypes
path = {path!r}
print("visible", path.startswith("\\0") or os.path.exists(path))
try:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    print("connected")
except OSError as e:
    print("refused", type(e).__name__)
libc = ctypes.CDLL(None, use_errno=True)  # around Python: straight to libc
print("raw", libc.socket(1, 1, 0), ctypes.get_errno())
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("where", ["/tmp", "/run", "/dev", "abstract"])
def test_host_unix_sockets_are_unreachable(where):
    token = secrets.token_hex(4)
    path = f"\0asyncrl-test-{token}" if where == "abstract" else f"{where}/asyncrl-test-{token}.sock"
    srv = _unix_listener(path)
    try:
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.connect(path)  # reachable from the host: the test means something
        probe.close()
        srv.accept()[0].close()
        r = sandbox(CONNECT.format(path=path))
        assert r.ok, r.stderr
        assert "connected" not in r.stdout and "refused PermissionError" in r.stdout
        assert "raw -1 1\n" in r.stdout  # EPERM from the seccomp filter, not from a Python hook
        if where == "/dev":  # the socket file is in sight; only the kernel filter stops the connect
            assert "visible True" in r.stdout
        if where in ("/tmp", "/run"):  # covered by the run's own tmpfs
            assert "visible False" in r.stdout
        with pytest.raises(BlockingIOError):
            srv.accept()  # nothing reached the listener
    finally:
        srv.close()
        if not path.startswith("\0"):
            os.unlink(path)
