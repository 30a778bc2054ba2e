"""Sandboxed Python execution: `run_python(code)` in a separate, limited process, and the `python` tool.

Job: run untrusted, model-written code so that an infinite loop, a memory bomb, a fork
bomb or a network call is stopped and *reported*, never felt by the host. Boundary: one
`python -I` child per run (bootstrap in `_sandbox_child.py`); no container runtime, no
seccomp, no chroot: the child can read world-readable files (never write outside its
working directory and /tmp when it runs as its own uid).

Mechanisms (each run reports which ones it got in `SandboxResult.isolation`):
- CPU time: RLIMIT_CPU (SIGXCPU, then SIGKILL one second later).
- memory: RLIMIT_AS per process (allocations beyond it raise MemoryError); RLIMIT_FSIZE for files.
- wall clock: the parent kills the child's process group, and every process of the run's
  uid (which catches children that left the group), after `wall_s`.
- processes: as root the child switches to a fresh random uid (no passwd entry) so that
  RLIMIT_NPROC counts this run's processes alone; as a normal user RLIMIT_NPROC counts the
  user's processes, so the limit is their current count plus `max_processes`. Root without
  a uid drop (`drop_privileges="never"`, or a failed mount below) is exempt from
  RLIMIT_NPROC: then an audit hook refuses fork/exec/spawn/system instead.
- network: as root (CAP_SYS_ADMIN), a private network namespace: kernel-enforced, no
  interface up. Otherwise an audit hook refuses inet sockets and DNS lookups, and ctypes
  (which could call libc around the hook); that hook stops an LLM's casual network use,
  not a determined adversary inside the process.
- files: a temporary working directory owned by the run's uid, removed afterwards.
- output: stdout and stderr each truncated to `max_output_chars`.

The interpreter starts as root and drops privileges itself, so a root-only interpreter
path still starts. When the interpreter's files sit under a directory other users cannot
enter (e.g. pyenv under /root, mode 700), the child first makes a private mount namespace
in which that directory is an empty tmpfs with only the interpreter's prefix mounted back:
imports keep working after the drop and the rest of /root is invisible to the code.
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

from agents.tools.base import Tool, register_tool
from agents.tools.sandbox_host import exposures, kill_tree, pick_uid, processes_of, release_uid

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
    """Processes (threads count too) the run may have at once: RLIMIT_NPROC; as root without a uid drop, no children."""
    file_mb: int = 64
    """Largest file the run may write (RLIMIT_FSIZE)."""
    max_output_chars: int = 8000
    """stdout and stderr are each cut to this many characters."""
    network_namespace: bool = True
    """Try a private network namespace (root only); False leaves only the audit hook."""
    drop_privileges: Literal["auto", "never"] = "auto"
    """As root, run as a fresh uid (`auto`) or stay root (`never`: process creation refused by the hook)."""
    python: str = sys.executable
    """Interpreter for the child (the same minor version keeps this environment's site-packages)."""

    def __post_init__(self) -> None:
        for key in ("wall_s", "cpu_s", "max_processes", "file_mb", "max_output_chars"):
            if getattr(self, key) <= 0:
                raise ValueError(f"sandbox.{key} must be > 0, got {getattr(self, key)}")
        if self.memory_mb < 64:
            raise ValueError(f"sandbox.memory_mb must be >= 64 (Python alone needs ~50 MB), got {self.memory_mb}")
        if self.drop_privileges not in ("auto", "never"):
            raise ValueError(f"sandbox.drop_privileges must be 'auto' or 'never', got {self.drop_privileges!r}")


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
    """What the child achieved: `net` (netns | audit_hook), `procs` (rlimit_nproc | audit_hook), `uid`, `hidden` dirs."""

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
    """Run `code` as `main.py` in a fresh sandbox; never raises for anything the code does."""
    t0 = time.monotonic()
    root = os.geteuid() == 0
    uid = pick_uid() if root and limits.drop_privileges == "auto" else None
    expose = exposures(limits.python) if uid is not None else []
    nproc = limits.max_processes + (0 if root else len(processes_of(os.getuid())))
    workdir = tempfile.mkdtemp(prefix="asyncrl-sandbox-")
    proc: asyncio.subprocess.Process | None = None
    readers: list[asyncio.Future] = []
    report_r, report_w = os.pipe()
    try:
        Path(workdir, "main.py").write_text(code)
        if uid is not None:
            for p in (workdir, os.path.join(workdir, "main.py")):
                os.chown(p, uid, uid)
        cfg = {"netns": limits.network_namespace, "cpu_s": limits.cpu_s, "memory_mb": limits.memory_mb,
               "file_mb": limits.file_mb, "nproc": nproc, "uid": uid, "workdir": workdir, "report_fd": report_w,
               "expose": expose}
        env = {"PATH": "/usr/bin:/bin", "HOME": workdir, "LANG": "C.UTF-8", "OMP_NUM_THREADS": "1",
               "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        proc = await asyncio.create_subprocess_exec(
            limits.python, "-I", "-c", _CHILD, json.dumps(cfg),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            env=env, cwd=workdir, start_new_session=True, pass_fds=(report_w,),
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
        shutil.rmtree(workdir, ignore_errors=True)
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
