"""Bootstrap of one sandboxed Python run; the parent passes this file's text to `python -I -c`.

Three processes, each the parent of the next:

    outer (host pid ns)  unshare(mount | net | pid | ipc | uts [| user when not root]); relays the exit status
      init (pid 1)       private mounts (below), fresh /proc; reaps; its exit kills every process left in the run
        worker           rlimits, uid drop, no_new_privs, seccomp filter, then `main.py`

Mounts, in a mount namespace of the run's own (nothing propagates back to the host):
- /tmp, /var/tmp, /dev/shm: fresh tmpfs of `tmp_mb` each, gone with the namespace when the run ends;
- /run (and so /var/run): an empty root-owned tmpfs, hiding the host's sockets there;
- each `hide` dir the parent names (a root-only dir holding the interpreter, e.g. /root): an empty tmpfs with
  its `keep` dirs mounted back (cloned with open_tree before the cover, moved back with move_mount);
- the working directory `/tmp/<name>` inside the private /tmp, holding `main.py`.

The seccomp filter allows socket() only for AF_INET / AF_INET6 (useless in the empty network namespace)
and so refuses AF_UNIX (host sockets anywhere on the filesystem), AF_VSOCK, AF_NETLINK and the rest;
it refuses unshare, setns, namespace flags to clone, io_uring (which would create sockets around the
filter), memfd_create and memfd_secret (memory no rlimit counts: RLIMIT_AS does not see a memfd's
pages, and the run's tmpfs mounts are where files may live), and the kernel keyring (add_key,
request_key, keyctl: keys outlive the run and are not namespaced), each with EPERM; it answers clone3
with ENOSYS (libc falls back to clone, whose flags it can inspect); a syscall from another ABI (i386,
x32) kills the process. Abstract AF_UNIX names are per network namespace as well.

Any failure before the untrusted code starts is reported as `{"error": ...}` on the report fd and the
run exits 125 without running the code: nothing runs half-isolated. On success the worker reports
what it got (`{"uid": ..., "hidden": ..., ...}`) just before the code starts.

Standard library only, and no imports after the privilege drop that are not already loaded: the
interpreter's own files may be unreadable to the sandbox uid.
"""

import ctypes
import json
import os
import resource
import signal
import struct
import sys
import traceback

NEWNS, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET, NEWCGROUP, NEWTIME = (
    0x20000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000, 0x02000000, 0x80)
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REC, MS_PRIVATE = 2, 4, 8, 16384, 1 << 18
SYS_OPEN_TREE, SYS_MOVE_MOUNT, OPEN_TREE_CLONE, AT_RECURSIVE, MOVE_MOUNT_F_EMPTY_PATH = 428, 429, 1, 0x8000, 4
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 1, 38, 22, 2
# arch -> (AUDIT_ARCH, socket, clone, unshare, clone3, io_uring_setup)
ARCHES = {"x86_64": (0xC000003E, 41, 56, 272, 435, 425), "aarch64": (0xC00000B7, 198, 220, 97, 435, 425)}
# arch -> syscalls refused with EPERM outright: setns, memfd_create, memfd_secret, add_key, request_key, keyctl
REFUSED = {"x86_64": (308, 319, 447, 248, 249, 250), "aarch64": (268, 279, 447, 217, 218, 219)}

cfg = json.loads(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
report = os.fdopen(cfg["report_fd"], "w")


class SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def prctl(option: int, arg2: int = 0, arg3: int = 0) -> int:
    u = ctypes.c_ulong
    return libc.prctl(ctypes.c_int(option), u(arg2), u(arg3), u(0), u(0))


def fail(step: str) -> None:
    err = ctypes.get_errno()
    report.write(json.dumps({"error": f"{step}: {os.strerror(err) if err else 'failed'}"}) + "\n")
    report.flush()
    os._exit(125)


def boot_error(kind: type, err: BaseException, tb: object) -> None:
    """Any exception before the untrusted code starts: the run is refused, never half set up."""
    ctypes.set_errno(0)
    fail(f"bootstrap {kind.__name__}: {err}")


def check(rc: int, step: str) -> None:
    if rc != 0:
        fail(step)


def mount(src: str, dst: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    check(libc.mount(src.encode(), dst.encode(), fstype and fstype.encode(), ctypes.c_ulong(flags),
                     data and data.encode()),
          f"mount {fstype or src} on {dst}")


def seccomp_filter() -> bytes:
    """The BPF program described in the module docstring, as `struct sock_filter[]` bytes."""
    arch, sock, clone, unshare, clone3, uring = ARCHES[os.uname().machine]
    refused = REFUSED[os.uname().machine]
    allow, eperm, enosys, kill = 0x7FFF0000, 0x50000 | 1, 0x50000 | 38, 0x80000000
    ns_flags = NEWNS | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET | NEWCGROUP | NEWTIME
    ld, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06
    prog: list = [  # (code, jump-if-true label, jump-if-false label, k); labels resolve to offsets below
        (ld, 0, 0, 4), (jeq, "nr", "kill", arch),
        ("nr", ld, 0, 0, 0), (jge, "kill", 0, 0x40000000), (jeq, "socket", 0, sock), (jeq, "eperm", 0, unshare),
        (jeq, "eperm", 0, uring), *[(jeq, "eperm", 0, nr) for nr in refused],
        (jeq, "enosys", 0, clone3), (jeq, "clone", "allow", clone),
        ("socket", ld, 0, 0, 16), (jeq, "allow", 0, 2), (jeq, "allow", "eperm", 10),
        ("clone", ld, 0, 0, 16), (jset, "eperm", "allow", ns_flags),
        ("allow", ret, 0, 0, allow), ("eperm", ret, 0, 0, eperm), ("enosys", ret, 0, 0, enosys),
        ("kill", ret, 0, 0, kill),
    ]
    labels = {ins[0]: i for i, ins in enumerate(prog) if isinstance(ins[0], str)}
    out = b""
    for i, ins in enumerate(prog):
        code, jt, jf, k = ins[1:] if isinstance(ins[0], str) else ins
        jt, jf = (labels[j] - i - 1 if isinstance(j, str) else j for j in (jt, jf))
        out += struct.pack("=HBBI", code, jt, jf, k)
    return out


def set_up_mounts() -> None:
    """Run in init (pid 1 of the new pid namespace, inside the new mount namespace)."""
    # the host's umask is the run's (077, asyncrl/run_dir.py): the mount points made here for the kept
    # trees and the program file must be readable by the sandbox's uid, so this tree has its own
    os.umask(0o022)
    mount("none", "/", None, MS_REC | MS_PRIVATE)
    kept = []
    for _, keep in cfg["expose"]:  # clone each kept tree before its parent is covered
        fd = libc.syscall(ctypes.c_long(SYS_OPEN_TREE), ctypes.c_long(-100), keep.encode(),
                          ctypes.c_ulong(OPEN_TREE_CLONE | AT_RECURSIVE | os.O_CLOEXEC))
        if fd < 0:
            fail(f"open_tree {keep}")
        kept.append((fd, keep))
    tmp = f"size={cfg['tmp_mb']}m,mode=1777,nr_inodes=16k"
    for d in cfg["private"]:
        mount("tmpfs", d, "tmpfs", MS_NOSUID | MS_NODEV, tmp)
    for d in cfg["empty"]:
        mount("tmpfs", d, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=16k,mode=755")
    covered = [*cfg["private"], *cfg["empty"]]
    for hide in sorted({h for h, _ in cfg["expose"]}):
        if not any(hide == c or hide.startswith(c + "/") for c in covered):
            mount("tmpfs", hide, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755")
            covered.append(hide)
    for fd, keep in kept:
        os.makedirs(keep, exist_ok=True)
        check(libc.syscall(ctypes.c_long(SYS_MOVE_MOUNT), ctypes.c_long(fd), b"", ctypes.c_long(-100), keep.encode(),
                           ctypes.c_ulong(MOVE_MOUNT_F_EMPTY_PATH)), f"move_mount {keep}")
        os.close(fd)
    mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    os.mkdir(cfg["workdir"], 0o700)
    with open(os.path.join(cfg["workdir"], "main.py"), "w") as f:
        f.write(code_text)
    if cfg["uid"] is not None:
        os.chown(cfg["workdir"], cfg["uid"], cfg["uid"])


def map_own_ids() -> None:
    """Without root: map our uid/gid to themselves in the new user namespace (no other id exists there)."""
    uid, gid = cfg["host_ids"]
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)


def drop_capabilities() -> None:
    """In our own user namespace a non-root process still holds every capability there: clear them all."""
    header = struct.pack("=Ii", 0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this thread
    data = ctypes.create_string_buffer(24)  # two zeroed {effective, permitted, inheritable}
    check(libc.capset(ctypes.c_char_p(header), data), "capset")


def relay(child: int, status_r: int, status_w: int) -> None:
    """Wait for `child`, then leave the way it left: same exit code, or killed by the same signal.
    init (pid 1) cannot die by its own signal, so it writes the worker's status to the outer in words."""
    while True:
        pid, st = os.waitpid(-1, 0)  # init also reaps orphans of the run
        if pid == child:
            break
    code = os.waitstatus_to_exitcode(st)
    if status_w >= 0:  # init
        os.write(status_w, str(code).encode())
        os._exit(0)
    if said := os.read(status_r, 16):  # outer; nothing said: init itself was killed, its status stands
        code = int(said)
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code)


sys.excepthook = boot_error
with open(cfg["main"]) as f:
    code_text = f.read()
prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
if os.uname().machine not in ARCHES:
    fail(f"seccomp filter for {os.uname().machine} (supported: {sorted(ARCHES)})")
root = os.geteuid() == 0
check(libc.unshare(NEWNS | NEWNET | NEWPID | NEWIPC | NEWUTS | (0 if root else NEWUSER)), "unshare namespaces")
if not root:
    map_own_ids()
status_r, status_w = os.pipe()
init = os.fork()
if init:
    os.close(status_w)
    report.close()
    relay(init, status_r, -1)
os.close(status_r)
prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
set_up_mounts()
worker = os.fork()
if worker:
    report.close()
    try:
        relay(worker, -1, status_w)
    finally:  # relay never returns; only an error in it lands here
        os._exit(125)
os.close(status_w)

MB = 1 << 20
for which, soft, hard in [
    (resource.RLIMIT_CPU, cfg["cpu_s"], cfg["cpu_s"] + 1),  # soft: SIGXCPU, hard: SIGKILL
    (resource.RLIMIT_AS, cfg["memory_mb"] * MB, cfg["memory_mb"] * MB),
    (resource.RLIMIT_FSIZE, cfg["file_mb"] * MB, cfg["file_mb"] * MB),
    (resource.RLIMIT_NOFILE, 256, 256),
    (resource.RLIMIT_CORE, 0, 0),
    (resource.RLIMIT_NPROC, cfg["nproc"], cfg["nproc"]),
]:
    resource.setrlimit(which, (soft, hard))
os.chdir(cfg["workdir"])
if root:
    os.setgroups([])
    os.setgid(cfg["uid"])
    os.setuid(cfg["uid"])
else:
    drop_capabilities()
check(prctl(PR_SET_NO_NEW_PRIVS, 1), "no_new_privs")  # no setuid binary regains root
prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # set after setuid, which clears it
bpf = ctypes.create_string_buffer(seccomp_filter())
prog = SockFprog(len(bpf.raw) // 8, ctypes.cast(bpf, ctypes.c_void_p))
check(prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(prog)), "seccomp filter")
report.write(json.dumps({"net": "netns", "procs": "rlimit_nproc", "pid": "pidns", "uid": os.getuid(),
                         "hidden": sorted({h for h, _ in cfg["expose"]}), "private": cfg["private"],
                         "empty": cfg["empty"], "seccomp": "socket_inet_only,no_memfd,no_keyring,no_setns"}) + "\n")
report.close()
sys.excepthook = sys.__excepthook__
del cfg, libc, report, code_text, bpf, prog
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
