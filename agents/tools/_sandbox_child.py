"""Bootstrap of one sandboxed Python run; the parent passes this file's text to `python -I -c`.

Runs in the child before the untrusted code, in this order: a private network namespace
(`unshare(CLONE_NEWNET)`, root only), resource limits, a privilege drop to the dedicated
uid chosen by the parent, an audit hook for whatever the kernel could not enforce, then
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

CLONE_NEWNET = 0x40000000
PR_SET_PDEATHSIG = 1
PR_SET_NO_NEW_PRIVS = 38

cfg = json.loads(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)

net = "audit_hook"
if cfg["netns"] and os.geteuid() == 0 and libc.unshare(CLONE_NEWNET) == 0:
    net = "netns"  # a fresh namespace: only a loopback device, and it is down

MB = 1 << 20
limits = [
    (resource.RLIMIT_CPU, cfg["cpu_s"], cfg["cpu_s"] + 1),  # soft: SIGXCPU, hard: SIGKILL
    (resource.RLIMIT_AS, cfg["memory_mb"] * MB, cfg["memory_mb"] * MB),
    (resource.RLIMIT_FSIZE, cfg["file_mb"] * MB, cfg["file_mb"] * MB),
    (resource.RLIMIT_NOFILE, 256, 256),
    (resource.RLIMIT_CORE, 0, 0),
]
procs = "audit_hook"
if cfg["uid"] is not None or os.geteuid() != 0:  # root is exempt from RLIMIT_NPROC
    limits.append((resource.RLIMIT_NPROC, cfg["nproc"], cfg["nproc"]))
    procs = "rlimit_nproc"
for which, soft, hard in limits:
    resource.setrlimit(which, (soft, hard))

os.chdir(cfg["workdir"])
if cfg["uid"] is not None:
    os.setgroups([])
    os.setgid(cfg["uid"])
    os.setuid(cfg["uid"])
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


def _hook(event: str, args: tuple) -> None:
    if event in blocked:
        if event == "socket.__new__" and args and args[1] == 1:  # AF_UNIX: local only
            return
        kind = "network" if event in _NET_EVENTS else "process creation" if event in _PROC_EVENTS else "ctypes"
        raise PermissionError(f"sandbox: {kind} is not allowed ({event})")


with os.fdopen(cfg["report_fd"], "w") as report:
    report.write(json.dumps({"net": net, "procs": procs, "uid": os.getuid()}) + "\n")
sys.addaudithook(_hook)  # cannot be removed from Python code once added
del cfg, libc
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
    sys.stderr.flush()
    os._exit(1)
