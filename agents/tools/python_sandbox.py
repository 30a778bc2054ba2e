"""Sandboxed Python execution: `run_python(code)` in a separate, limited process, and the `python` tool.

Job: run untrusted, model-written code so that an infinite loop, a memory bomb, a fork
bomb, a network call, a file left in /dev/shm or a poke at the host's processes, sockets
and secrets is stopped or confined and *reported*, never felt by the host. Boundary: the
kernel. One `python -I` child per run (bootstrap and process layout in `_sandbox_child.py`);
no container runtime and no chroot: the code still reads the host's world-readable files.

Mechanisms (each run reports what it got in `SandboxResult.isolation`):
- uid: as root, the code runs as a fresh random uid (no passwd entry, no groups): it cannot
  read root-only files (/etc/shadow), write /etc, or signal root's processes. Without root,
  it keeps the caller's uid inside a user namespace of its own, with every capability cleared.
- namespaces: private mount, network, pid, ipc and uts namespaces. The pid namespace hides
  and shields every host process (and init's exit kills whatever the run left behind); the
  network namespace has no interface up and its own abstract AF_UNIX names.
- files: /tmp, /var/tmp and /dev/shm are fresh tmpfs mounts of `tmp_mb` each, private to the
  run and gone with it; /run (host sockets) is covered by an empty tmpfs; the working
  directory is `/tmp/asyncrl-sandbox-*` inside the private /tmp.
- seccomp: socket() only for AF_INET/AF_INET6 (so no AF_UNIX connect to any host socket path,
  no vsock), no unshare / setns / namespace clone flags / io_uring, no memfd_create / memfd_secret
  (memory RLIMIT_AS does not count), no kernel keyring (add_key / request_key / keyctl: keys would
  outlive the run): each refused with EPERM.
- CPU time: RLIMIT_CPU (SIGXCPU, then SIGKILL one second later); memory: RLIMIT_AS per process;
  RLIMIT_FSIZE for files; processes: RLIMIT_NPROC (the fresh uid's processes; without root, the
  caller's current count plus `max_processes`).
- wall clock: the parent kills the child's process group, and every process of the run's uid,
  after `wall_s`; the bootstrap chain dies with its parent (PR_SET_PDEATHSIG).
- environment: only PATH, HOME, LANG and the thread-count variables; nothing of the parent's.
- output: stdout and stderr each truncated to `max_output_chars`.

No audit hook: it could be disarmed from inside the process, so nothing relies on one. A host
where a namespace, a mount or the seccomp filter cannot be set up gets `SandboxUnavailable` and
the code is not run; there is no weaker fallback mode.

The interpreter starts as root and drops privileges itself, so a root-only interpreter path
still starts. The directories it imports from that the fresh uid could not enter (pyenv under
/root, mode 700; a venv inside a 0700 `mktemp -d`) are mounted back over an empty tmpfs that
covers the rest of the root-only directory: imports keep working, the rest stays invisible.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from agents.tools.base import Tool, ToolUnavailable, register_tool
from agents.tools.sandbox_host import EMPTY_DIRS, PRIVATE_DIRS, exposures, kill_tree, pick_uid, processes_of, release_uid

_CHILD = (Path(__file__).parent / "_sandbox_child.py").read_text()


@dataclass
class SandboxLimits:
    """Limits of one sandboxed run."""

    wall_s: float = 10.0
    """Wall-clock limit; the whole process tree is killed after it."""
    cpu_s: int = 5
    """CPU-seconds per process (RLIMIT_CPU)."""
    memory_mb: int = 1024
    """Address space per process (RLIMIT_AS); Python itself needs ~50 MB, numpy ~300 MB."""
    max_processes: int = 8
    """Processes (threads count too) the run may have at once: RLIMIT_NPROC."""
    file_mb: int = 64
    """Largest file the run may write (RLIMIT_FSIZE)."""
    max_output_chars: int = 8000
    """stdout and stderr are each cut to this many characters."""
    tmp_mb: int = 64
    """Size of each private tmpfs (/tmp, /var/tmp, /dev/shm); counts against host memory while the run lives."""
    network_namespace: bool = True
    """Kept for old configs: must be True (a private network namespace is part of the boundary)."""
    drop_privileges: Literal["auto"] = "auto"
    """As root, run as a fresh uid. `never` (stay root) is refused: it ran untrusted code as root."""
    python: str = sys.executable
    """Interpreter for the child (the same minor version keeps this environment's site-packages)."""

    def __post_init__(self) -> None:
        for key in ("wall_s", "cpu_s", "max_processes", "file_mb", "max_output_chars", "tmp_mb"):
            if getattr(self, key) <= 0:
                raise ValueError(f"sandbox.{key} must be > 0, got {getattr(self, key)}")
        if self.memory_mb < 64:
            raise ValueError(f"sandbox.memory_mb must be >= 64 (Python alone needs ~50 MB), got {self.memory_mb}")
        if self.drop_privileges == "never":
            raise ValueError("sandbox.drop_privileges='never' is refused: it ran model-written code as root with only "
                             "an audit hook in the way; use 'auto' (a fresh uid in private namespaces)")
        if self.drop_privileges != "auto":
            raise ValueError(f"sandbox.drop_privileges must be 'auto', got {self.drop_privileges!r}")
        if self.network_namespace is not True:
            raise ValueError("sandbox.network_namespace=False is refused: without a private network namespace the "
                             "code reaches the host's network and abstract sockets; leave it True")


@dataclass
class SandboxResult:
    stdout: str
    stderr: str
    exit_code: int | None
    """The child's exit status; negative: killed by that signal; None: never started."""
    timed_out: bool
    truncated: bool
    seconds: float
    isolation: dict[str, Any] = field(default_factory=dict)
    """What the child achieved: `net` (netns), `pid` (pidns), `procs` (rlimit_nproc), `uid`, `seccomp`,
    `private` and `empty` tmpfs dirs, and the root-only dirs `hidden` around the interpreter."""

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out

    def describe_failure(self) -> str:
        """One line saying why the run failed (empty when it did not)."""
        if self.timed_out:
            return "timed out (wall-clock limit); the process tree was killed"
        if self.exit_code is not None and self.exit_code < 0:
            sig = signal.Signals(-self.exit_code).name
            cause = {"SIGXCPU": "CPU time limit exceeded", "SIGKILL": "killed (CPU or resource limit)",
                     "SIGXFSZ": "file size limit exceeded"}.get(sig, "killed")
            return f"{cause} ({sig})"
        if "MemoryError" in self.stderr:
            return "memory limit exceeded (MemoryError)"
        return f"exit code {self.exit_code}" if self.exit_code else ""


class SandboxUnavailable(ToolUnavailable):
    """This host cannot isolate the code (a namespace, mount or seccomp step failed); the code did not run."""


async def _reap(proc: asyncio.subprocess.Process) -> None:
    """Wait for a killed child and close its pipes, so nothing outlives the event loop."""
    try:
        await asyncio.wait_for(asyncio.shield(proc.wait()), 2.0)
    except (asyncio.TimeoutError, asyncio.CancelledError):
        pass


async def _main_exited(proc: asyncio.subprocess.Process, timeout_s: float) -> bool:
    """True when the main process exits within `timeout_s`. Polled: `proc.wait()` would also
    wait for background children that still hold stdout."""
    deadline = time.monotonic() + timeout_s
    while proc.returncode is None:
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(0.02)
    return True


def _read_report(fd: int) -> dict[str, Any]:
    os.set_blocking(fd, False)
    try:
        data = os.read(fd, 4096)
    except BlockingIOError:
        return {}
    try:
        return json.loads(data.decode() or "{}")
    except ValueError:
        return {}


async def _read_capped(stream: asyncio.StreamReader, cap: int) -> tuple[bytes, bool]:
    """Read to EOF, keeping the first `cap` bytes (the rest is drained and dropped)."""
    buf, dropped = bytearray(), False
    while chunk := await stream.read(65536):
        room = cap - len(buf)
        if room > 0:
            buf += chunk[:room]
        dropped = dropped or len(chunk) > room
    return bytes(buf), dropped


async def run_python(code: str, limits: SandboxLimits = SandboxLimits(), stdin: str = "") -> SandboxResult:
    """Run `code` as `main.py` in a fresh sandbox; never raises for anything the code does.

    Raises `SandboxUnavailable` when this host cannot set up the isolation (the code did not run)."""
    t0 = time.monotonic()
    root = os.geteuid() == 0
    uid = pick_uid() if root else None
    expose = exposures(limits.python) if root else []  # without root the caller's uid reads what it reads now
    nproc = limits.max_processes + (0 if root else len(processes_of(os.getuid())))
    hostdir = tempfile.mkdtemp(prefix="asyncrl-sandbox-")  # root-only; the bootstrap reads main.py before the drop
    proc: asyncio.subprocess.Process | None = None
    readers: list[asyncio.Future] = []
    report_r, report_w = os.pipe()
    try:
        Path(hostdir, "main.py").write_text(code)
        workdir = "/tmp/" + os.path.basename(hostdir)  # inside the run's private /tmp
        cfg = {"cpu_s": limits.cpu_s, "memory_mb": limits.memory_mb, "file_mb": limits.file_mb, "nproc": nproc,
               "tmp_mb": limits.tmp_mb, "uid": uid, "host_ids": [os.getuid(), os.getgid()], "workdir": workdir,
               "main": os.path.join(hostdir, "main.py"), "report_fd": report_w, "expose": expose,
               "private": PRIVATE_DIRS, "empty": EMPTY_DIRS}
        env = {"PATH": "/usr/bin:/bin", "HOME": workdir, "LANG": "C.UTF-8", "OMP_NUM_THREADS": "1",
               "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        proc = await asyncio.create_subprocess_exec(
            limits.python, "-I", "-c", _CHILD, json.dumps(cfg),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            env=env, cwd="/", start_new_session=True, pass_fds=(report_w,),
        )
        os.close(report_w)
        report_w = -1
        cap = limits.max_output_chars * 4  # bytes; cut to characters after decoding
        readers = [asyncio.ensure_future(_read_capped(s, cap)) for s in (proc.stdout, proc.stderr)]
        proc.stdin.write(stdin.encode())
        proc.stdin.close()
        timed_out = not await _main_exited(proc, limits.wall_s)
        kill_tree(proc.pid, uid)  # also children left running in the background
        done, pending = await asyncio.wait(readers, timeout=1.0)
        for t in pending:  # a writer outside our reach still holds the pipe
            t.cancel()
        (out, cut_o), (err, cut_e) = [t.result() if t in done else (b"", True) for t in readers]
        exit_code = await proc.wait()
        isolation = _read_report(report_r)
        if "error" in isolation:
            raise SandboxUnavailable(f"the python sandbox cannot isolate code on this host ({isolation['error']}); "
                                     "model-written code is not run without it (see agents/tools/python_sandbox.py)")
        stdout, stderr = out.decode(errors="replace"), err.decode(errors="replace")
        n = limits.max_output_chars
        truncated = cut_o or cut_e or len(stdout) > n or len(stderr) > n
        return SandboxResult(stdout[:n], stderr[:n], exit_code, timed_out, truncated, time.monotonic() - t0, isolation)
    finally:
        for t in readers:
            t.cancel()
        if proc is not None:  # again: a cancel (e.g. a reward timeout) may have skipped the kill above
            kill_tree(proc.pid, uid)
            if proc.returncode is None:
                await _reap(proc)
        if report_w >= 0:
            os.close(report_w)
        os.close(report_r)
        shutil.rmtree(hostdir, ignore_errors=True)
        release_uid(uid)


@register_tool("python")
class PythonTool(Tool):
    """Runs the model's code in the sandbox; returns its output, or an `Error: ...` text saying why it failed."""

    name = "python"
    description = "Run a Python program and return what it prints (stdout and stderr)."
    parameters = {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}

    def __init__(self, **limits: Any) -> None:
        self.limits = SandboxLimits(**limits)

    async def __call__(self, code: str) -> str:
        r = await run_python(str(code), self.limits)
        text = r.stdout + (("\n" if r.stdout and not r.stdout.endswith("\n") else "") + r.stderr if r.stderr else "")
        if r.truncated:
            text += "\n[output truncated]"
        if r.ok:
            return text
        return f"Error: {r.describe_failure()}\n{text}".rstrip()
