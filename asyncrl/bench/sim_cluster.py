"""Several hosts on one Linux machine: what a cluster is to the planes, for the suite, `asyncrl bench
planes --hosts N` and people (`deploy/local/sim_cluster.sh up|down|exec|status`).

Each simulated host is
- a network namespace whose only link is `eth0`, with one address (`10.213.0.<i+1>/24` by default) on a
  bridge that lives in a namespace of its own (`<name>-br`): no address, link or route is added to the
  machine's own namespace, and 127.0.0.1 on one host is not 127.0.0.1 on another;
- pid, mount and UTS namespaces whose pid 1 (`_INIT`, it reaps orphans) holds them: its own process table,
  hostname (`<name>-h<i>`), a fresh tmpfs on /dev/shm, its own /tmp (the directory `<base>/h<i>/tmp`; a clone
  of the code or a venv that lies under the machine's /tmp is mounted back into it at the same path), an
  /etc/hosts that names every host;
- optionally its own clocks: a time namespace offsets CLOCK_MONOTONIC (`skew_s`), and processes started with
  `env_for` see `time.time()` shifted by as much (`sitecustomize`; CLOCK_REALTIME has no namespace).
What hosts share is what a cluster's hosts share: the bridge, and the machine's files outside /tmp and
/dev/shm (the code, the venv, a shared folder for run directories and models: `<base>/shared`).

A process runs on host i through `nsenter` (`exec_argv(i)`, `popen`, `run`). Killing host i kills its pid 1,
and the kernel kills every process of its pid namespace; `partition(i)` takes its link down (packets to and
from it are dropped, connections stay open) and `heal(i)` brings it back. `down()` kills every host, deletes
the namespaces and the base folder; a cluster whose creator died is removed by the next `SimCluster.up()`
(`sweep_stale`).

    with SimCluster(3) as c:                      # needs root, iproute2 and util-linux (nsenter, unshare)
        c.start_ray(cpus=[2, 2, 2], resources=[{"h0": 1}, {"h1": 1}, {"h2": 1}])
        c.run(0, ["asyncrl", "train", ..., f"ray.address={c.ray_address}"], env=c.env)
        c.shm_files(1)                            # what host 1 holds in its /dev/shm
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "deploy" / "ray" / "start_cluster.sh"
STATE = Path("/run/asyncrl-sim")
"""One JSON file per cluster (`<name>.json`): its hosts' pids and namespaces, and who made it."""
BASE = Path("/var/tmp/asyncrl-sim")
"""Parent of each cluster's folder: hosts' /tmp, the shared folder (outside /tmp: a host's /tmp is its own)."""
RAY_PORT = 6379

_INIT = r"""
import json, os, signal, socket, subprocess, sys, time
name, tmp, hosts, skew, keep = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4]), json.loads(sys.argv[5])
run = lambda *cmd: subprocess.run(list(cmd), check=True)
run("mount", "-t", "tmpfs", "-o", "mode=1777,size=2g", "tmpfs", "/dev/shm")
if keep:  # the machine's /tmp, seen under another name while the host's own covers /tmp
    os.makedirs("/run/asyncrl-machine-tmp", exist_ok=True)
    run("mount", "--bind", "/tmp", "/run/asyncrl-machine-tmp")
run("mount", "--bind", tmp, "/tmp")
for path in keep:  # what every host shares although it lies in /tmp: the code and the venv of this clone
    os.makedirs(path, exist_ok=True)
    run("mount", "--bind", "/run/asyncrl-machine-tmp/" + os.path.relpath(path, "/tmp"), path)
run("mount", "--bind", hosts, "/etc/hosts")
socket.sethostname(name)
signal.signal(signal.SIGTERM, lambda *a: os._exit(0))  # pid 1 ignores signals it has no handler for
print("ready", flush=True)
while True:  # reap whatever ends in this pid namespace (Ray's workers are re-parented here)
    try:
        os.waitpid(-1, 0)
    except ChildProcessError:
        time.sleep(0.2)
"""

_SKEW = """import time as _t
_s = float(__import__("os").environ.get("ASYNCRL_SIM_SKEW_S", "0") or 0)
if _s:
    _time, _time_ns = _t.time, _t.time_ns
    _t.time = lambda: _time() + _s
    _t.time_ns = lambda: _time_ns() + int(_s * 1e9)
"""


def available() -> str:
    """'' where simulated hosts can be made here, else why not (the reason a test skips with)."""
    if sys.platform != "linux":
        return "simulated hosts need Linux namespaces"
    if os.geteuid() != 0:
        return "simulated hosts need root (network, mount and pid namespaces)"
    for tool in ("ip", "nsenter", "unshare", "mount", "ps"):
        if shutil.which(tool) is None:
            return f"simulated hosts need `{tool}` (iproute2, util-linux, procps)"
    probe = f"asyncrl-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot make a network namespace: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return ""


def _sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run(list(argv), capture_output=True, text=True)
    if check and out.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {out.stderr.strip() or out.stdout.strip()}")
    return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


class SimHost:
    """One simulated host: `address` on `eth0`, `init_pid` its pid 1 (as the machine sees it)."""

    def __init__(self, index: int, name: str, netns: str, address: str, init_pid: int, dir: Path, skew_s: float = 0.0) -> None:
        self.index, self.name, self.netns, self.address = index, name, netns, address
        self.init_pid, self.dir, self.skew_s = init_pid, dir, skew_s
        self.link = f"v{index}"
        """Its link's end on the bridge (in the bridge's namespace)."""

    def path(self, inside: str) -> Path:
        """A path as this host sees it (its /dev/shm, /tmp), read from the machine."""
        return Path(f"/proc/{self.init_pid}/root") / inside.lstrip("/")

    def as_dict(self) -> dict[str, Any]:
        return {"index": self.index, "name": self.name, "netns": self.netns, "address": self.address,
                "init_pid": self.init_pid, "dir": str(self.dir), "skew_s": self.skew_s}


class SimCluster:
    """`n` simulated hosts (see the module docstring); `skew_s[i]` offsets host i's clocks."""

    def __init__(self, n: int, name: str = "", subnet: str = "10.213.0", skew_s: Sequence[float] = ()) -> None:
        if not 1 <= n <= 200:
            raise ValueError(f"hosts: 1 to 200, got {n}")
        self.n = n
        self.name = name or f"ar{os.getpid()}{secrets.token_hex(2)}"
        self.subnet = subnet
        self.skew = list(skew_s) + [0.0] * (n - len(skew_s))
        self.base = BASE / self.name
        self.shared = self.base / "shared"
        """A folder every host sees at the same path (run directories, models): the cluster's shared filesystem."""
        self.hosts: list[SimHost] = []
        self.bridge = f"{self.name}-br"
        self.ray_address = ""
        self.env: dict[str, str] = {}
        """Environment for the cluster's processes: this venv first on PATH, Ray's token, the run secret."""
        self._procs: list[subprocess.Popen] = []
        self._ray_args: dict[int, list[str]] = {}
        """Each host's `start_cluster.sh` arguments (`revive` starts its Ray node again with them)."""

    # ---- up and down ---------------------------------------------------------------
    def __enter__(self) -> "SimCluster":
        return self.up()

    def __exit__(self, *exc: Any) -> None:
        self.down()

    def up(self) -> "SimCluster":
        why = available()
        if why:
            raise RuntimeError(why)
        sweep_stale()
        STATE.mkdir(parents=True, exist_ok=True)
        self.base.mkdir(parents=True, exist_ok=False)
        self.shared.mkdir()
        os.chmod(self.shared, 0o1777)
        self._save()  # before anything is made: a crash from here on leaves a record for sweep_stale
        try:
            self._make()
        except BaseException:
            self.down()
            raise
        return self

    def _make(self) -> None:
        _sh("ip", "netns", "add", self.bridge)
        _sh("ip", "-n", self.bridge, "link", "add", "br0", "type", "bridge")
        _sh("ip", "-n", self.bridge, "link", "set", "br0", "up")
        hosts_file = self.base / "hosts"
        lines = ["127.0.0.1 localhost"] + [f"{self.subnet}.{i + 1} {self.name}-h{i}" for i in range(self.n)]
        hosts_file.write_text("\n".join(lines) + "\n")
        bin_dir = Path(sys.executable).parent
        skew_dir = self.base / "skew"
        skew_dir.mkdir()
        (skew_dir / "sitecustomize.py").write_text(_SKEW)
        self.env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}", PYTHON=sys.executable,
                        RAY=str(bin_dir / "ray"), RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(16),
                        ASYNCRL_SECRET=secrets.token_hex(16), HOME=str(self.base / "home"))
        (self.base / "home").mkdir()
        for key in ("TMPDIR", "RAY_ADDRESS", "ASYNCRL_NODE_IP"):  # the machine's, not a host's
            self.env.pop(key, None)
        for i in range(self.n):
            netns, address = f"{self.name}-h{i}", f"{self.subnet}.{i + 1}"
            _sh("ip", "netns", "add", netns)
            _sh("ip", "-n", self.bridge, "link", "add", f"v{i}", "type", "veth", "peer", "name", "eth0", "netns", netns)
            _sh("ip", "-n", self.bridge, "link", "set", f"v{i}", "master", "br0", "up")
            _sh("ip", "-n", netns, "addr", "add", f"{address}/24", "dev", "eth0")
            _sh("ip", "-n", netns, "link", "set", "eth0", "up")
            _sh("ip", "-n", netns, "link", "set", "lo", "up")
            hdir = self.base / f"h{i}"
            (hdir / "tmp").mkdir(parents=True)
            os.chmod(hdir / "tmp", 0o1777)
            self.hosts.append(SimHost(i, f"{self.name}-h{i}", netns, address, self._boot(i, netns), hdir, self.skew[i]))
            self._save()

    def _boot(self, i: int, netns: str) -> int:
        """Start host i's pid 1 in its network namespace (new pid, mount, UTS and, with a skew, time
        namespaces; its /dev/shm a fresh tmpfs); its pid as the machine sees it."""
        hdir = self.base / f"h{i}"
        clock = ["--time", "--monotonic", str(int(self.skew[i])), "--boottime", str(int(self.skew[i]))] if self.skew[i] else []
        init = subprocess.Popen(
            ["ip", "netns", "exec", netns, "unshare", "--pid", "--fork", "--mount", "--uts", "--propagation", "private",
             "--mount-proc", *clock, sys.executable, "-c", _INIT, f"{self.name}-h{i}", str(hdir / "tmp"), str(self.base / "hosts"),
             str(self.skew[i]), json.dumps(_shared_in_tmp())],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        line = init.stdout.readline() if init.stdout else ""
        if line.strip() != "ready":
            raise RuntimeError(f"host {i} did not start: {line}{init.stderr.read() if init.stderr else ''}")
        self._procs.append(init)
        return _pid_one(init.pid)

    def _save(self) -> None:
        state = {"name": self.name, "owner": os.getpid(), "bridge": self.bridge, "base": str(self.base),
                 "hosts": [h.as_dict() for h in self.hosts], "ray_address": self.ray_address,
                 "env": {k: self.env[k] for k in ("RAY_AUTH_TOKEN", "ASYNCRL_SECRET", "HOME") if k in self.env}}
        tmp = STATE / f"{self.name}.json.tmp"
        tmp.write_text(json.dumps(state))
        os.chmod(tmp, 0o600)
        tmp.replace(STATE / f"{self.name}.json")

    def down(self) -> None:
        """End every process of every host, delete the namespaces and the cluster's folders."""
        _remove(self.name, [h.init_pid for h in self.hosts], self.bridge, [f"{self.name}-h{i}" for i in range(self.n)], self.base)
        for p in self._procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass

    # ---- running things on a host --------------------------------------------------
    def exec_argv(self, i: int) -> list[str]:
        """The prefix that runs a command on host i (its network, mounts, process table, hostname, clocks)."""
        h = self.hosts[i]
        spaces = ["--net", "--mount", "--pid", "--uts"] + (["--time"] if h.skew_s else [])
        return ["nsenter", "--target", str(h.init_pid), *spaces, "--wd=" + str(REPO), "--"]

    def env_for(self, i: int, **extra: str) -> dict[str, str]:
        """`env` for a process on host i: with a clock offset, Python's `time.time()` is shifted by it too."""
        env = dict(self.env, **extra)
        if self.hosts[i].skew_s:
            env["ASYNCRL_SIM_SKEW_S"] = str(self.hosts[i].skew_s)
            env["PYTHONPATH"] = os.pathsep.join(p for p in (str(self.base / "skew"), env.get("PYTHONPATH", "")) if p)
        return env

    def popen(self, i: int, argv: Sequence[str], env: dict[str, str] | None = None, **kw: Any) -> subprocess.Popen:
        return subprocess.Popen(self.exec_argv(i) + list(argv), env=env or self.env_for(i), **kw)

    def run(self, i: int, argv: Sequence[str], env: dict[str, str] | None = None, timeout: float = 600,
            **kw: Any) -> subprocess.CompletedProcess:
        if "stderr" in kw or "stdout" in kw:
            kw.setdefault("stdout", subprocess.PIPE)
        else:
            kw.setdefault("capture_output", True)
        kw.setdefault("text", True)
        return subprocess.run(self.exec_argv(i) + list(argv), env=env or self.env_for(i), timeout=timeout, **kw)

    def python(self, i: int, code: str, *args: str, timeout: float = 120) -> str:
        """Run `code` with this venv's Python on host i; its stdout (a failure raises with its stderr)."""
        out = self.run(i, [sys.executable, "-c", code, *args], timeout=timeout)
        if out.returncode != 0:
            raise RuntimeError(f"host {i}: {out.stderr[-3000:]}")
        return out.stdout

    # ---- Ray -----------------------------------------------------------------------
    def start_ray(self, cpus: Sequence[int], resources: Sequence[dict[str, float]] = (), hosts: Sequence[int] = (),
                  wait_s: float = 120) -> str:
        """A Ray head on host 0 and a worker on every other host of `hosts` (default: all), each started by
        `deploy/ray/start_cluster.sh` with its host's address as `--node-ip-address`; returns the head's address."""
        hosts = list(hosts) or list(range(self.n))
        self.ray_address = f"{self.hosts[hosts[0]].address}:{RAY_PORT}"
        for k, i in enumerate(hosts):
            res = json.dumps(dict(resources[k])) if k < len(resources) and resources[k] else "{}"
            role = ["head", "--port", str(RAY_PORT)] if k == 0 else ["worker", "--address", self.ray_address]
            self._ray_args[i] = [*role, "--ip", self.hosts[i].address, "--num-cpus", str(cpus[k]), "--resources", res, "--block"]
            self._start_node(i)
            if k == 0:
                self.wait_nodes(1, hosts[0], wait_s)
        self.wait_nodes(len(hosts), hosts[0], wait_s)
        self._save()
        return self.ray_address

    def _start_node(self, i: int) -> None:
        log = open(self.hosts[i].dir / "ray.log", "ab")
        self._procs.append(self.popen(i, ["bash", str(SCRIPT), *self._ray_args[i]], stdout=log, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL))
        log.close()

    def wait_nodes(self, count: int, on: int = 0, wait_s: float = 120) -> None:
        out = self.run(on, ["bash", str(SCRIPT), "run", "--address", self.ray_address, "--wait-nodes", str(count),
                            "--wait-s", str(int(wait_s)), "--", "true"], timeout=wait_s + 60)
        if out.returncode != 0:
            logs = "".join(f"\n-- host {h.index} ray.log: " + _tail(h.dir / "ray.log") for h in self.hosts)
            raise RuntimeError(f"Ray nodes did not come up: {out.stdout[-1000:]}{out.stderr[-2000:]}{logs}")

    # ---- faults --------------------------------------------------------------------
    def kill_host(self, i: int) -> None:
        """Host i dies: every process on it is killed at once (its pid 1 first) and its link goes down."""
        self.partition(i)
        try:
            os.kill(self.hosts[i].init_pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def revive(self, i: int, wait_s: float = 120) -> None:
        """Host i, killed, boots again: a new pid 1 (an empty process table, /dev/shm and /tmp as they were
        left on disk: its /tmp is a folder), its link up, its Ray node started again (a new node to Ray, on
        the same address) if it had one."""
        h = self.hosts[i]
        if _alive(h.init_pid):
            raise RuntimeError(f"host {i} is alive")
        h.init_pid = self._boot(i, h.netns)
        self.heal(i)
        self._save()
        if i in self._ray_args:
            self._start_node(i)
            head = next(k for k, args in self._ray_args.items() if args[0] == "head")
            self.wait_nodes(len(self._ray_args), head, wait_s)

    def partition(self, i: int) -> None:
        """Cut host i off: its link on the bridge goes down; its processes run on, their packets are lost."""
        _sh("ip", "-n", self.bridge, "link", "set", self.hosts[i].link, "down")

    def heal(self, i: int) -> None:
        _sh("ip", "-n", self.bridge, "link", "set", self.hosts[i].link, "up")

    # ---- looking at a host ---------------------------------------------------------
    def shm_files(self, i: int) -> list[str]:
        """Names in host i's /dev/shm."""
        d = self.hosts[i].path("/dev/shm")
        return sorted(p.name for p in d.iterdir()) if d.is_dir() else []

    def processes(self, i: int) -> list[str]:
        """`pid command` of every live process host i's process table holds (its own pids; zombies left out)."""
        out = self.run(i, ["ps", "-eo", "pid=,stat=,args="], timeout=30).stdout
        rows = [line.split(None, 2) for line in out.splitlines() if line.strip()]
        return [f"{r[0]} {r[2]}" for r in rows if len(r) == 3 and not r[1].startswith("Z")]


def _shared_in_tmp() -> list[str]:
    """What every host must see although it lies under /tmp, which each host replaces by its own: this
    clone of the code and the Python environment it runs in (a clone made under /tmp is still shared, as a
    cluster's shared filesystem is)."""
    wanted = {str(REPO), sys.prefix, os.path.dirname(os.path.dirname(os.path.realpath(sys.executable)))}
    under = sorted(p for p in wanted if Path(p).resolve().is_relative_to("/tmp") and Path(p).resolve() != Path("/tmp"))
    return [p for p in under if not any(p != q and Path(p).is_relative_to(q) for q in under)]


def _pid_one(unshare_pid: int, wait_s: float = 10) -> int:
    """The machine's pid of the pid 1 that `ip netns exec ... unshare --fork` started (a child of unshare)."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        for pid in _descendants(unshare_pid):
            try:
                status = Path(f"/proc/{pid}/status").read_text()
            except OSError:
                continue
            ns = [line for line in status.splitlines() if line.startswith("NSpid:")]
            if ns and ns[0].split()[-1] == "1":
                return pid
        time.sleep(0.05)
    raise RuntimeError("the host's pid 1 did not appear")


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            kids = Path(f"/proc/{p}/task/{p}/children").read_text().split()
        except OSError:
            continue
        out += [int(k) for k in kids]
        todo += [int(k) for k in kids]
    return out


def _tail(path: Path, n: int = 1500) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return "(none)"


def _remove(name: str, init_pids: list[int], bridge: str, netns: list[str], base: Path) -> None:
    for pid in init_pids:  # a pid namespace ends with its pid 1: the kernel kills the rest
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for ns in netns + [bridge]:
        pids = _sh("ip", "netns", "pids", ns, check=False).stdout.split()
        for p in pids:  # anything that joined the network namespace only
            try:
                os.kill(int(p), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in init_pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    for ns in netns + [bridge]:
        _sh("ip", "netns", "del", ns, check=False)
    shutil.rmtree(base, ignore_errors=True)
    (STATE / f"{name}.json").unlink(missing_ok=True)


def sweep_stale() -> list[str]:
    """Remove the clusters whose creator process is gone (a test run killed before its teardown); the
    names removed."""
    gone = []
    for f in sorted(STATE.glob("*.json")) if STATE.is_dir() else []:
        try:
            s = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        if s.get("owner") and not _alive(int(s["owner"])) and not s.get("kept"):
            _remove(s["name"], [h["init_pid"] for h in s["hosts"]], s["bridge"],
                    [h["netns"] for h in s["hosts"]] or [f"{s['name']}-h{i}" for i in range(8)], Path(s["base"]))
            gone.append(s["name"])
    return gone


# ---- a command for people: deploy/local/sim_cluster.sh --------------------------------
def _load(name: str) -> dict[str, Any]:
    f = STATE / f"{name}.json"
    if not f.is_file():
        raise SystemExit(f"sim_cluster: no cluster named {name!r} (up makes one; status lists them)")
    return json.loads(f.read_text())


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="sim_cluster", description="simulated hosts on this machine (root)")
    p.add_argument("--name", default="sim", help="the cluster's name (several may exist at once)")
    sub = p.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="make N hosts (and a Ray node on each with --ray)")
    up.add_argument("n", type=int)
    up.add_argument("--ray", action="store_true", help="start a Ray head on host 0 and a worker on every other host")
    up.add_argument("--cpus", type=int, default=2, help="Ray CPUs per host")
    sub.add_parser("down", help="end every process of the cluster and delete it")
    ex = sub.add_parser("exec", help="run a command on host I: exec I -- CMD ...")
    ex.add_argument("i", type=int)
    ex.add_argument("command", nargs=argparse.REMAINDER)
    sub.add_parser("status", help="the clusters this machine holds")
    a = p.parse_args(argv)
    if a.cmd == "up":
        c = SimCluster(a.n, name=a.name)
        c.up()
        if a.ray:
            c.start_ray(cpus=[a.cpus] * a.n, resources=[{f"host{i}": 1} for i in range(a.n)])
        state = json.loads((STATE / f"{c.name}.json").read_text())
        state["kept"] = True  # outlives this command: only `down` removes it
        (STATE / f"{c.name}.json").write_text(json.dumps(state))
        for h in c.hosts:
            print(f"host {h.index}: {h.name} {h.address} (pid 1 = {h.init_pid})")
        if c.ray_address:
            print(f"ray: {c.ray_address} (RAY_AUTH_TOKEN and ASYNCRL_SECRET are set by `exec`)")
        print(f"shared folder: {c.shared}; run on a host: deploy/local/sim_cluster.sh --name {c.name} exec 0 -- CMD")
        return 0
    if a.cmd == "down":
        s = _load(a.name)
        _remove(s["name"], [h["init_pid"] for h in s["hosts"]], s["bridge"], [h["netns"] for h in s["hosts"]], Path(s["base"]))
        print(f"sim_cluster: {a.name} removed")
        return 0
    if a.cmd == "exec":
        s = _load(a.name)
        cmd = a.command[1:] if a.command[:1] == ["--"] else a.command
        h = s["hosts"][a.i]
        bin_dir = Path(sys.executable).parent
        env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}", RAY_AUTH_MODE="token", **s["env"])
        spaces = ["--net", "--mount", "--pid", "--uts"] + (["--time"] if h.get("skew_s") else [])
        os.execvpe("nsenter", ["nsenter", "--target", str(h["init_pid"]), *spaces, f"--wd={os.getcwd()}", "--", *(cmd or ["bash"])], env)
    if a.cmd == "status":
        for f in sorted(STATE.glob("*.json")) if STATE.is_dir() else []:
            s = json.loads(f.read_text())
            hosts = ", ".join(f"{h['name']} {h['address']}" for h in s["hosts"])
            print(f"{s['name']}: {hosts}" + (f"; ray {s['ray_address']}" if s.get("ray_address") else ""))
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
