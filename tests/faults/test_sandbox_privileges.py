"""Sandboxed code cannot read root's secrets or the parent's environment, signal host processes, or run as root.

Also: the sandbox works wherever the interpreter's venv (or a checkout) lives, including under a
directory only root may enter, and a host that cannot isolate refuses instead of running the code.
"""

from __future__ import annotations

import ast
import asyncio
import os
import subprocess
import sys
import tempfile

import pytest

from agents.rewards.code import code_tests
from agents.tools import PythonTool, SandboxLimits, SandboxUnavailable, call_tool, run_python

SMALL = dict(wall_s=8.0, cpu_s=2, memory_mb=256, max_processes=4)
CANARY = "ASYNCRL_SANDBOX_CANARY"

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="the uid drop and root-only files need root")


def sandbox(code: str, **kw: object):
    return asyncio.run(run_python(code, SandboxLimits(**(SMALL | kw))))


SNOOP = """
import glob, os
out = {"env": os.environ.get(%(canary)r), "uid": os.getuid()}
for path in ("/etc/shadow", "/proc/%(ppid)d/environ"):
    try:
        out[path] = open(path, "rb").read()[:20]
    except OSError as e:
        out[path] = type(e).__name__
seen = []
for p in glob.glob("/proc/[0-9]*/environ"):
    try:
        seen.append(%(value)r.encode() in open(p, "rb").read())
    except OSError:
        pass
out["canary_in_proc"] = any(seen)
try:
    open("/etc/asyncrl-sandbox-probe", "w")
    out["etc"] = "written"
except OSError as e:
    out["etc"] = type(e).__name__
print(repr(out))
"""


@needs_root
@pytest.mark.timeout(30)
def test_no_secrets_no_parent_environment_no_writes_to_etc(monkeypatch):
    value = "canary-7f3a91"
    monkeypatch.setenv(CANARY, value)
    r = sandbox(SNOOP % {"canary": CANARY, "ppid": os.getpid(), "value": value})
    assert r.ok, r.stderr
    out = ast.literal_eval(r.stdout)
    assert out["uid"] not in (0, os.getuid()) and r.isolation["uid"] == out["uid"]
    assert out["env"] is None and out["canary_in_proc"] is False
    assert out["/etc/shadow"] == "PermissionError"
    assert out[f"/proc/{os.getpid()}/environ"] in ("FileNotFoundError", "PermissionError")  # not our pid namespace
    assert out["etc"] == "PermissionError" and not os.path.exists("/etc/asyncrl-sandbox-probe")


KILLER = """
import os, signal
for target in (%(pid)d, -1):
    try:
        os.kill(target, signal.SIGKILL)
        print(target, "sent")
    except OSError as e:
        print(target, type(e).__name__)
print("host pid visible", os.path.exists("/proc/%(pid)d/cmdline") and b"sleep" in open("/proc/%(pid)d/cmdline", "rb").read())
"""


@pytest.mark.timeout(30)
def test_host_processes_cannot_be_signalled():
    victim = subprocess.Popen(["sleep", "30"])
    try:
        r = sandbox(KILLER % {"pid": victim.pid})
        assert r.ok, r.stderr
        assert f"{victim.pid} sent" not in r.stdout  # the host pid does not exist in the run's pid namespace
        assert "host pid visible False" in r.stdout
        assert victim.poll() is None  # kill(-1) reached only the run's own processes
    finally:
        victim.kill()
        victim.wait()


def test_running_as_root_or_without_network_namespace_is_refused():
    with pytest.raises(ValueError, match=r"sandbox\.drop_privileges='never' is refused"):
        SandboxLimits(drop_privileges="never")
    with pytest.raises(ValueError, match=r"sandbox\.network_namespace=False is refused"):
        SandboxLimits(network_namespace=False)


@needs_root
@pytest.mark.timeout(60)
def test_interpreter_in_a_root_only_directory(tmp_path):
    """A venv inside a fresh `mktemp -d` (mode 0700), as a new user's checkout may hold: the sandbox uid
    imports from it all the same, and sees nothing else of that directory."""
    top = tempfile.mkdtemp()  # 0700, like `mktemp -d`
    try:
        venv = os.path.join(top, "c", ".venv")
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True, timeout=60)
        os.makedirs(os.path.join(top, "c", "secret"))
        site = subprocess.run([f"{venv}/bin/python", "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                              capture_output=True, text=True, check=True).stdout.strip()
        with open(os.path.join(site, "sbx_probe.py"), "w") as f:
            f.write("ANSWER = 42\n")
        code = f"import os, sbx_probe\nprint(sbx_probe.ANSWER, os.getuid(), sorted(os.listdir({top + '/c'!r})))"
        r = sandbox(code, python=f"{venv}/bin/python")
        assert r.ok, r.stderr
        answer, uid, listing = r.stdout.split(" ", 2)
        assert answer == "42" and int(uid) != 0
        assert ast.literal_eval(listing) == [".venv"]  # `secret` is hidden under the empty tmpfs
        assert any(top == h or top.startswith(h + "/") for h in r.isolation["hidden"])  # itself, or the private /tmp
    finally:
        subprocess.run(["rm", "-rf", top], check=True)


@pytest.mark.timeout(30)
def test_a_host_that_cannot_isolate_refuses(monkeypatch):
    """A failed isolation step (here: a private tmpfs over a path that does not exist) refuses the run,
    loudly: out of the tool call and out of the code reward."""
    from agents.tools import python_sandbox

    monkeypatch.setattr(python_sandbox, "PRIVATE_DIRS", ["/tmp", "/nonexistent-asyncrl-dir"])
    with pytest.raises(SandboxUnavailable, match="mount tmpfs on /nonexistent-asyncrl-dir"):
        sandbox("open('/tmp/ran', 'w').write('x')\nprint('ran')")
    tool = PythonTool(**SMALL)  # not an error text for the model: no model could fix the host
    with pytest.raises(SandboxUnavailable):
        asyncio.run(call_tool(tool, "python", {"code": "print(1)"}, timeout_s=10))
    with pytest.raises(SandboxUnavailable, match="cannot isolate"):  # raised, not a test failure of the response
        asyncio.run(code_tests("def f(): return 1", '["assert f() == 1"]', **SMALL))
