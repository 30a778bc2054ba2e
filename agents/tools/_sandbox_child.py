"""Bootstrap of one sandboxed Python run; the parent passes this file's text to `python -I -c`.

Runs in the child before the untrusted code, in this order: a private network namespace
(`unshare(CLONE_NEWNET)`, root only), a private mount namespace when the interpreter lives
under a directory the sandbox uid could not enter (see `_expose`), resource limits, a
privilege drop to the dedicated uid chosen by the parent, an audit hook for whatever the
kernel could not enforce, then
`main.py` in the working directory. It reports what it achieved as one JSON line
(`{"net": ..., "procs": ..., "uid": ...}`) on the fd named in its config, before the untrusted code starts.

Standard library only, and no imports after the privilege drop that are not already
loaded: the interpreter's own files may be unreadable to the sandbox uid.
"""

import ctypes
import json
import os
import resource
import signal
import sys
import traceback

CLONE_NEWNET, CLONE_NEWNS = 0x40000000, 0x00020000
MS_NOSUID, MS_NODEV, MS_BIND, MS_MOVE, MS_REC, MS_PRIVATE = 2, 4, 4096, 8192, 16384, 1 << 18
PR_SET_PDEATHSIG = 1
PR_SET_NO_NEW_PRIVS = 38

cfg = json.loads(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)

net = "audit_hook"
if cfg["netns"] and os.geteuid() == 0 and libc.unshare(CLONE_NEWNET) == 0:
    net = "netns"  # a fresh namespace: only a loopback device, and it is down



def _expose(pairs: list, stage_root: str) -> bool:
    """Cover each `hide` dir (e.g. /root, mode 700) with an empty tmpfs and mount its `keep` dir
    (e.g. /root/.pyenv/versions/3.11) back at the same path, in a mount namespace of our own:
    the interpreter's files stay importable after the uid drop, the rest of `hide` is gone."""
    if libc.unshare(CLONE_NEWNS) != 0 or libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None) != 0:
        return False
    stages = []
    for i, (_, keep) in enumerate(pairs):
        stage = os.path.join(stage_root, f".keep{i}")
        os.mkdir(stage)
        if libc.mount(keep.encode(), stage.encode(), None, MS_BIND | MS_REC, None) != 0:
            return False
        stages.append((stage, keep))
    hides = {h for h, _ in pairs}
    for hide in sorted(h for h in hides if not any(h.startswith(o + "/") for o in hides)):
        if libc.mount(b"tmpfs", hide.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, b"mode=755,size=1m") != 0:
            return False
    for stage, keep in stages:
        os.makedirs(keep, exist_ok=True)
        if libc.mount(stage.encode(), keep.encode(), None, MS_MOVE, None) != 0:
            return False
        os.rmdir(stage)
    return True


uid = cfg["uid"]
if uid is not None and cfg["expose"] and not _expose(cfg["expose"], cfg["workdir"]):
    uid = None  # the interpreter would be unreadable after the drop: stay root, hooks instead

MB = 1 << 20
limits = [
    (resource.RLIMIT_CPU, cfg["cpu_s"], cfg["cpu_s"] + 1),  # soft: SIGXCPU, hard: SIGKILL
    (resource.RLIMIT_AS, cfg["memory_mb"] * MB, cfg["memory_mb"] * MB),
    (resource.RLIMIT_FSIZE, cfg["file_mb"] * MB, cfg["file_mb"] * MB),
    (resource.RLIMIT_NOFILE, 256, 256),
    (resource.RLIMIT_CORE, 0, 0),
]
procs = "audit_hook"
if uid is not None or os.geteuid() != 0:  # root is exempt from RLIMIT_NPROC
    limits.append((resource.RLIMIT_NPROC, cfg["nproc"], cfg["nproc"]))
    procs = "rlimit_nproc"
for which, soft, hard in limits:
    resource.setrlimit(which, (soft, hard))

os.chdir(cfg["workdir"])
if uid is not None:
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)  # no setuid binaries regain root
libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # set after setuid, which clears it

_NET_EVENTS = {"socket.__new__", "socket.connect", "socket.bind", "socket.getaddrinfo",
               "socket.gethostbyname", "socket.gethostbyaddr", "socket.sendto", "socket.sendmsg"}
_PROC_EVENTS = {"os.fork", "os.forkpty", "os.posix_spawn", "os.spawn", "os.exec", "os.system",
                "subprocess.Popen", "os.startfile"}
_CTYPES_EVENTS = {"ctypes.dlopen", "ctypes.dlsym", "ctypes.dlsym/handle", "ctypes.cdata"}
blocked = set(_CTYPES_EVENTS)  # ctypes could call libc directly, around any hook below
if net == "audit_hook":
    blocked |= _NET_EVENTS
if procs == "audit_hook":
    blocked |= _PROC_EVENTS
if net == "netns" and procs == "rlimit_nproc":
    blocked = set()  # the kernel enforces both; keep ctypes usable


def _hook(event: str, args: tuple, blocked: frozenset = frozenset(blocked)) -> None:
    # `blocked` is bound at definition: the code can reach this module's globals through frames
    if event in blocked:
        if event == "socket.__new__" and args and args[1] == 1:  # AF_UNIX: local only
            return
        kind = "network" if event in _NET_EVENTS else "process creation" if event in _PROC_EVENTS else "ctypes"
        raise PermissionError(f"sandbox: {kind} is not allowed ({event})")


with os.fdopen(cfg["report_fd"], "w") as report:
    report.write(json.dumps({"net": net, "procs": procs, "uid": os.getuid(),
                             "hidden": sorted({h for h, _ in cfg["expose"]}) if uid is not None else []}) + "\n")
sys.addaudithook(_hook)  # cannot be removed from Python code once added
del cfg, libc, _hook, blocked
sys.argv = ["main.py"]
sys.path[0] = os.getcwd()
try:
    with open("main.py") as f:
        code = compile(f.read(), "main.py", "exec")
    exec(code, {"__name__": "__main__", "__builtins__": __builtins__})
except SystemExit:
    raise
except BaseException as e:  # print the user's traceback without this bootstrap's frame
    traceback.print_exception(type(e), e, e.__traceback__.tb_next)
    sys.exit(1)
