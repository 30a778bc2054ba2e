"""A run is private: nothing of it can be read, joined or deleted without its secret (issue 24).

One test per finding of the issue, each the attack as it was made, now refused. Attacks of another
local user run as `nobody` (the attacker's interpreter starts as root and drops to uid 65534 before
it touches anything of the run: the venv's interpreter sits in a root-only directory); network
peers are raw sockets. Real sockets, stores, files and sandboxes throughout.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import zmq

from checkpoint_engine import Receiver, Sender, WeightsConfig
from transfer_queue import Record, TransferQueueConfig, connect
from plane_common.curve import client as curve_client
from transfer_queue.codec import WireError, pack, unpack
from transfer_queue.service import ControllerService

ROOT = Path(__file__).resolve().parents[2]
NOBODY = 65534
SECRET = "issue-24-run-secret"
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="attacks of another uid need root to drop to it")

DROP = "import os\nos.setgroups([]); os.setgid(65534); os.setuid(65534)\n"


def as_nobody(setup: str, attack: str, **kw) -> subprocess.Popen:
    """`setup` as root (imports), then `attack` as uid 65534, in a fresh interpreter (stdout piped)."""
    return subprocess.Popen([sys.executable, "-c", f"{setup}\n{DROP}{attack}"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kw)


def nobody_reads(path: Path) -> str:
    """What uid 65534 gets when it opens `path`: its first bytes or the error's name."""
    p = as_nobody("", f"try:\n    print(open({str(path)!r}, 'rb').read(16))\nexcept OSError as e:\n"
                      "    print(type(e).__name__)")
    out, err = p.communicate(timeout=30)
    assert p.returncode == 0, err
    return out.strip()


def _listening(port: int) -> list[str]:
    """Local addresses (hex, as /proc/net/tcp{,6} write them) listening on `port`."""
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            addr, hexport = f[1].rsplit(":", 1)
            if f[3] == "0A" and int(hexport, 16) == port:
                out.append(addr)
    return out


# ---- 1. the weight plane's and the trainer's rendezvous -------------------------------------------

@pytest.mark.timeout(90)
def test_1_weight_group_cannot_be_joined_from_the_store_port_alone():
    """Before: another user who knew the store port joined `weights/epoch<N>` as a rank (and got the
    weights) when it came before the real receiver, which was then evicted. Now every key lives under
    a random prefix handed out over CURVE: the join finds nobody, the slow receiver takes its rank."""
    cfg = WeightsConfig(backend="gloo", bucket_size_mb=0.01, timeout_s=5.0, secret=SECRET)
    sender = Sender(cfg)
    got: dict[str, list[tuple[int, torch.Tensor]]] = {"r0": [], "r1": []}
    rxs = [Receiver(cfg, rid, endpoint=sender.endpoint) for rid in got]
    form = rxs[1].transport.form_group
    rxs[1].transport.form_group = lambda *a: (time.sleep(1.0), form(*a))[1]  # r1 is slow to take its rank

    def serve(rx: Receiver) -> None:
        while True:
            try:
                update = rx.next_update(timeout_s=30)
                got[rx.receiver_id].append((update.version, dict((n, t.clone()) for n, t in update)["w"]))
            except Exception:  # the sender closed
                return

    threads = [threading.Thread(target=serve, args=(rx,), daemon=True) for rx in rxs]
    for t in threads:
        t.start()
    state = {"w": torch.arange(1000, dtype=torch.float32)}
    attacker = None
    try:
        assert sender.wait_for_ids(["r0", "r1"], timeout_s=20) == []
        assert sender.publish(state.items(), 1, receivers=["r0"]).completed == ["r0"]  # group epoch 1
        attacker = as_nobody(
            "import datetime, torch, torch.distributed as dist",
            f"st = dist.TCPStore('127.0.0.1', {sender.transport.store.port}, is_master=False,"
            " timeout=datetime.timedelta(seconds=5))\n"
            "print('connected', flush=True)\n"
            "o = dist.ProcessGroupGloo._Options(); o._timeout = datetime.timedelta(seconds=4)\n"
            "o._devices = [dist.ProcessGroupGloo.create_device(hostname='127.0.0.1')]\n"
            "try:\n"
            "    pg = dist.ProcessGroupGloo(dist.PrefixStore('weights/epoch2', st), 2, 3, o)\n"
            "    print('joined', flush=True)\n"
            "except RuntimeError as e:\n"
            "    print('refused', flush=True)\n")
        assert attacker.stdout.readline().strip() == "connected"
        out = sender.publish(state.items(), 2, receivers=["r0", "r1"])  # a new member: group epoch 2 (world 3)
        said, err = attacker.communicate(timeout=30)
        assert said.split() == ["refused"], err[-2000:]
        assert sorted(out.completed) == ["r0", "r1"] and not out.evicted
        assert got["r1"] and got["r1"][-1][0] == 2 and torch.equal(got["r1"][-1][1], state["w"])
        assert "key" in sender.transport.begin_info() and len(sender.transport.key) == 32
    finally:
        if attacker is not None and attacker.poll() is None:
            attacker.kill()
        sender.close()
        for rx in rxs:
            rx.close()


_RANK = """
import os, sys, torch, torch.distributed as dist
from asyncrl.trainer.setup import ensure_process_group
ensure_process_group(torch.device("cpu"))
t = torch.ones(1)
dist.all_reduce(t)
print(int(t.item()), flush=True)
from asyncrl.trainer.setup import close_process_group
close_process_group()
"""


@pytest.mark.timeout(90)
def test_1_trainer_process_group_binds_its_address_and_admits_only_ranks_with_the_key():
    """Before: the trainer's TCPStore listened on `::` and another user joined the group as a rank.
    Now rank 0's store listens on MASTER_ADDR only and the rendezvous keys need `ASYNCRL_PG_KEY`."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2",
           "ASYNCRL_PG_KEY": "k" + os.urandom(8).hex()}
    rank0 = subprocess.Popen([sys.executable, "-c", _RANK], cwd=ROOT, env={**env, "RANK": "0"},
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    attacker = rank1 = None
    try:
        deadline = time.monotonic() + 60
        while not _listening(port):
            assert time.monotonic() < deadline and rank0.poll() is None, rank0.communicate()[1][-2000:]
            time.sleep(0.05)
        assert _listening(port) == ["0100007F"]  # 127.0.0.1 only, not :: (every interface)
        attacker = as_nobody(  # a plain torch rendezvous on the port, as rank 1 of 2
            "import datetime, torch, torch.distributed as dist",
            "try:\n"
            f"    dist.init_process_group('gloo', init_method='tcp://127.0.0.1:{port}', rank=1, world_size=2,"
            " timeout=datetime.timedelta(seconds=4))\n"
            "    print('joined', flush=True)\n"
            "except Exception as e:\n"
            "    print('refused', flush=True)\n")
        said, err = attacker.communicate(timeout=40)
        assert said.split() == ["refused"], err[-2000:]
        rank1 = subprocess.Popen([sys.executable, "-c", _RANK], cwd=ROOT, env={**env, "RANK": "1"},
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        out0, out1 = rank0.communicate(timeout=60), rank1.communicate(timeout=60)
        assert out0[0].split() == ["2"] and out1[0].split() == ["2"], (out0[1][-2000:], out1[1][-2000:])
    finally:
        for p in (rank0, rank1, attacker):
            if p is not None and p.poll() is None:
                p.kill()


def test_1_a_single_rank_trainer_group_opens_no_store():
    """The embedded default (one rank) used a TCPStore on `::`; it now rendezvouses in memory."""
    code = ("import torch, torch.distributed as dist\nfrom asyncrl.trainer.setup import ensure_process_group\n"
            "ensure_process_group(torch.device('cpu'))\n"
            "from torch.distributed.distributed_c10d import _get_default_store\n"
            "s = _get_default_store()\nwhile isinstance(s, dist.PrefixStore): s = s.underlying_store\n"
            "print(type(s).__name__)")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "MASTER_ADDR", "ASYNCRL_PG_KEY")}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.split() == ["HashStore"], out.stderr[-2000:]


# ---- 2 and 4. the secret never written; run directories and MLflow private --------------------------

@pytest.fixture
def open_tmp():
    """A scratch directory other users may enter (pytest's own are root-only: nothing would be proven)."""
    import shutil
    import tempfile

    d = Path(tempfile.mkdtemp(prefix="asyncrl-privacy-"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.mark.timeout(90)
def test_2_4_secret_is_never_written_and_the_run_is_unreadable_to_other_users(open_tmp, monkeypatch):
    tmp_path = open_tmp
    from asyncrl.config import ConfigError, dump_resolved, load, to_dict
    from asyncrl.config.io import run_secret
    from asyncrl.metrics import MetricsLogger
    from asyncrl.run_dir import resolve_run_dir

    # argv: every user reads /proc/<pid>/cmdline; the value is refused and never echoed
    with pytest.raises(ConfigError, match=r"^queue\.secret: a secret is not taken on the command line") as e:
        load(None, [f"queue.secret={SECRET}"])
    assert SECRET not in str(e.value)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"queue:\n  secret: {SECRET}\n")
    recipe.chmod(0o644)
    with pytest.raises(ConfigError, match="other users can read") as e:
        load(recipe)
    assert SECRET not in str(e.value)
    recipe.chmod(0o600)
    assert load(recipe).queue.secret == SECRET
    # the environment or a 0600 file
    secret_file = tmp_path / "secret"
    secret_file.write_text(SECRET + "\n")
    secret_file.chmod(0o640)
    with pytest.raises(ConfigError, match="mode 0600"):
        run_secret({"ASYNCRL_SECRET_FILE": str(secret_file)})
    secret_file.chmod(0o600)
    assert run_secret({"ASYNCRL_SECRET_FILE": str(secret_file)}) == SECRET

    monkeypatch.chdir(tmp_path)  # ./mlruns here
    umask = os.umask(0o022)
    try:
        cfg = load(None, [f"logging.run_root={tmp_path / 'runs'}", "logging.run_name=private", "logging.experiment=privacy"])
        cfg.queue.secret = cfg.weights.secret = SECRET  # what `launch.share_run_secret` does
        assert SECRET not in repr(cfg) and SECRET not in repr(cfg.queue) + repr(cfg.weights)
        run_dir = resolve_run_dir(cfg)
        dump_resolved(cfg, run_dir / "config.yaml")
        (run_dir / "generations.jsonl").write_text("{}\n")
        metrics = MetricsLogger(cfg.logging, run_dir, to_dict(cfg))
        metrics.log(0, {"x": 1.0})
        metrics.artifact(run_dir / "config.yaml")
        metrics.close()
    finally:
        os.umask(umask)
    saved = (run_dir / "config.yaml").read_text()
    assert "secret: <set>" in saved and SECRET not in saved
    assert load(run_dir / "config.yaml").queue.secret == ""  # read back as a recipe: not a secret of "<set>"
    for p in [*tmp_path.joinpath("runs").rglob("*"), *tmp_path.joinpath("mlruns").rglob("*")]:
        if p.is_file():
            assert SECRET.encode() not in p.read_bytes(), p
    # 4. another user gets nothing of the run
    assert stat.S_IMODE(run_dir.stat().st_mode) == 0o700
    assert stat.S_IMODE((tmp_path / "mlruns").stat().st_mode) == 0o700
    for p in (run_dir / "config.yaml", run_dir / "generations.jsonl", run_dir / "metrics.jsonl"):
        assert stat.S_IMODE(p.stat().st_mode) & 0o077 == 0, p
    assert stat.S_IMODE((tmp_path / "mlruns" / "mlflow.db").stat().st_mode) == 0o600
    assert nobody_reads(tmp_path / "runs") == "IsADirectoryError"  # nobody gets as far as the run directory
    for p in (run_dir / "config.yaml", run_dir / "generations.jsonl", tmp_path / "mlruns" / "mlflow.db"):
        assert nobody_reads(p) == "PermissionError", p
    assert nobody_reads(recipe) == "PermissionError"


# ---- 3. one run cannot delete or feed another's data ------------------------------------------------

def test_3_runs_get_their_own_queue_id_and_handles_stay_in_their_run(tmp_path):
    from asyncrl.config import load
    from asyncrl.run_dir import assign_queue_run_id
    from transfer_queue.storage.shm import ShmStorage

    a, b = load(), load()
    assert a.queue.run_id == b.queue.run_id == "default"  # what every run used before
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    ida, idb = assign_queue_run_id(a, tmp_path / "a"), assign_queue_run_id(b, tmp_path / "b")
    assert ida != idb and ida.startswith("a-") and idb.startswith("b-")
    again = load()
    assert assign_queue_run_id(again, tmp_path / "a") == ida  # the resume path finds its own
    pa = ShmStorage(shm_dir=str(tmp_path), run_id=ida, arena_bytes=1 << 20, inline_max_bytes=0)
    pb = ShmStorage(shm_dir=str(tmp_path), run_id=idb, arena_bytes=1 << 20, inline_max_bytes=0)
    try:
        h = pa.write("u", {"x": np.arange(512)})["x"]
        pa.check(h)
        with pytest.raises(WireError, match="run prefix"):
            pb.check(h)  # run A's handle put into run B
    finally:
        pa.close()
        pb.close()


def test_3_sweeps_remove_only_this_runs_provably_orphaned_segments(tmp_path):
    from transfer_queue.storage.shm import ShmStorage

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()

    def segment(run: str, tag: str) -> Path:
        p = tmp_path / f"tq-{run}-{dead.pid}-{tag}-arena"
        p.write_bytes(b"x" * 4096)
        return p

    orphan, other_run, durable = segment("r", "aaaaaa"), segment("other", "bbbbbb"), segment("d", "cccccc")
    alive_elsewhere, foreign = segment("r", "dddddd"), segment("r", "eeeeee")
    os.chown(foreign, NOBODY, NOBODY)  # another user's (root could unlink it in /dev/shm)
    # a live producer whose pid this process cannot see (another pid namespace): it holds its arena's lock
    holder = subprocess.Popen([sys.executable, "-c", f"import fcntl, os, sys; fd = os.open({str(alive_elsewhere)!r}, "
                               "os.O_RDONLY); fcntl.flock(fd, fcntl.LOCK_SH); print('locked', flush=True); sys.stdin.read()"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        # a new producer of run `r` (memory metadata): only its own run's orphan goes
        p = ShmStorage(shm_dir=str(tmp_path), run_id="r", arena_bytes=1 << 20, inline_max_bytes=0)
        p.write("u", {"x": np.arange(512)})
        p.close()
        assert not orphan.exists()
        assert other_run.exists() and alive_elsewhere.exists() and foreign.exists()
        # a new producer of a durable (redis) run `d`: records there may still name the orphan's slots
        cfg = TransferQueueConfig(metadata="redis", storage="shm", shm_dir=str(tmp_path), run_id="d",
                                  inline_max_bytes=0, shm_arena_bytes=1 << 20)
        from transfer_queue.storage import make_storage

        q = make_storage(cfg)
        q.write("u", {"x": np.arange(512)})
        q.close()
        assert durable.exists()
    finally:
        holder.kill()
        holder.wait()


def test_3_a_producer_starting_at_the_same_moment_never_sweeps_a_live_arena(tmp_path, monkeypatch):
    """Two servers of one run create their arenas at once: the second one's sweep runs while the first
    one's file exists but is not locked yet. The arena is created under a name no sweep matches and
    renamed once locked, so the sweep never takes it for an orphan (it did: the trainer then failed with
    FileNotFoundError reading the first server's records)."""
    from transfer_queue.storage.shm import ShmStorage

    a = ShmStorage(shm_dir=str(tmp_path), run_id="r", arena_bytes=1 << 20, inline_max_bytes=0)
    b = ShmStorage(shm_dir=str(tmp_path), run_id="r", arena_bytes=1 << 20, inline_max_bytes=0)
    create = ShmStorage._create
    swept = []

    def create_then_other_sweeps(path, n, keep_fd=False):
        out = create(path, n, keep_fd)
        if not swept:  # `a`'s file exists, its lock not taken yet: `b` starts now
            swept.append(b.sweep(arenas_only=True))
        return out

    monkeypatch.setattr(ShmStorage, "_create", staticmethod(create_then_other_sweeps))
    try:
        h = a.write("u", {"x": np.arange(512)})
        assert swept == [0]
        assert (a.read([h["x"]])[0] == np.arange(512)).all()
    finally:
        a.close()
        b.close()


# ---- 5. queue identities from the connection ----------------------------------------------------------

@pytest.mark.timeout(60)
def test_5_a_secret_holder_cannot_act_as_another_client(tmp_path):
    cfg = TransferQueueConfig(storage="shm", capacity=16, shm_dir=str(tmp_path), run_id="ids", secret=SECRET)
    svc = ControllerService(cfg)
    remote = dataclasses.replace(cfg, controller_address=svc.address)
    try:
        prod = connect(remote)  # declared id: <host>:<pid>, which anyone can guess
        prod.put([Record("a", "g", tensors={"x": np.arange(2048)}, sealed=False)])
        s = zmq.Context.instance().socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        curve_client(s, SECRET, 64 << 20)
        s.connect(svc.address)
        s.send(pack({"id": 1, "op": "update", "args": {"uid": "a", "handles": {}, "meta": {"reward": 1e9},
                                                        "seal": True, "client_id": prod.consumer_id}}))
        assert s.poll(5000)
        rep = unpack(s.recv(), 1 << 20)
        assert rep["ok"] is False and rep["kind"] == "WireError" and "token" in rep["error"]
        s.close(0)
        mimic = connect(remote, consumer_id=prod.consumer_id)  # the same name, its own hello
        with pytest.raises(PermissionError):
            mimic.update("a", meta={"reward": 1e9})
        prod.update("a", meta={"reward": 1.0})
        cons = connect(remote, consumer_id="trainer-0")
        b = cons.get("trainer", timeout=5)
        assert b.samples[0].meta["reward"] == 1.0 and cons.ack(b) == 1
        st = cons.stats()
        assert st.not_owner == 1 and st.rejected == 1
        for c in (prod, mimic, cons):
            c.close()
    finally:
        svc.close()


# ---- 6. before the handshake: small frames, bounded connections -------------------------------------

_SERVICE = "import sys\nfrom transfer_queue.service import main\nmain(sys.argv[1:])\n"
_GREETING = b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + b"CURVE".ljust(20, b"\x00") + b"\x00" + b"\x00" * 31


@pytest.mark.timeout(90)
def test_6_strangers_make_a_listener_hold_little_and_connections_are_bounded():
    import psutil

    env = {**os.environ, "TQ_SECRET": SECRET}
    svc = subprocess.Popen([sys.executable, "-c", _SERVICE, "--max-connections", "8"], cwd=ROOT,
                           env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    socks: list[socket.socket] = []
    try:
        address = svc.stdout.readline().strip()
        host, port = address.rsplit("/", 1)[1].rsplit(":", 1)
        proc = psutil.Process(svc.pid)
        time.sleep(0.3)
        before = proc.memory_info().rss
        frame = b"\x02" + (48 << 20).to_bytes(8, "big")  # a long ZMTP frame of 48 MiB, before any handshake
        payload = bytes(1 << 20)

        def flood() -> None:
            try:
                with socket.create_connection((host, int(port)), timeout=5) as c:
                    c.sendall(_GREETING + frame)
                    for _ in range(48):
                        c.sendall(payload)
            except OSError:  # the listener cut us off: what should happen
                pass

        floods = [threading.Thread(target=flood) for _ in range(4)]
        for t in floods:
            t.start()
        for t in floods:
            t.join(30)
        grown = proc.memory_info().rss - before
        assert grown < 24 << 20, f"the service grew by {grown >> 20} MiB for 4 strangers"  # was 188 MiB
        for _ in range(20):  # strangers that only greet: 8 are kept (until their handshake times out)
            c = socket.create_connection((host, int(port)), timeout=5)
            c.sendall(_GREETING)
            socks.append(c)
        time.sleep(1.0)
        kept = sum(_still_open(c) for c in socks)
        assert kept == 8, kept
        for c in socks:
            c.close()
        time.sleep(0.5)
        q = connect(TransferQueueConfig(controller_address=address, storage="shm", secret=SECRET))
        assert q.stats().capacity == 4096
        q.close()
    finally:
        for c in socks:
            c.close()
        svc.kill()
        svc.wait()


def _still_open(c: socket.socket) -> bool:
    """True while the listener keeps `c` (its greeting may arrive; EOF means it shut us)."""
    c.settimeout(0.3)
    try:
        while c.recv(4096):
            pass
        return False
    except socket.timeout:
        return True
    except OSError:
        return False


@pytest.mark.timeout(60)
def test_6_the_weight_sender_takes_small_frames_and_bounded_connections():
    import psutil

    cfg = WeightsConfig(backend="local", bucket_size_mb=0.02, timeout_s=2.0, secret=SECRET, max_connections=4)
    sender = Sender(cfg)
    host, port = sender.endpoint.rsplit("/", 1)[1].rsplit(":", 1)
    socks: list[socket.socket] = []
    try:
        me = psutil.Process()
        payload = bytes(1 << 20)
        before = me.memory_info().rss
        for _ in range(2):  # 48 MiB frames before any handshake
            with socket.create_connection((host, int(port)), timeout=5) as c:
                try:
                    c.sendall(_GREETING + b"\x02" + (48 << 20).to_bytes(8, "big"))
                    for _ in range(48):
                        c.sendall(payload)
                except OSError:
                    pass
        assert me.memory_info().rss - before < 16 << 20
        for _ in range(10):
            c = socket.create_connection((host, int(port)), timeout=5)
            c.sendall(_GREETING)
            socks.append(c)
        time.sleep(1.0)
        assert sum(_still_open(c) for c in socks) == 4
        assert sender.stats()["connections_refused"] >= 6
        for c in socks:
            c.close()
        time.sleep(0.5)
        rx = Receiver(cfg, "r0", endpoint=sender.endpoint)
        assert sender.wait_for_ids(["r0"], timeout_s=10) == []
        rx.close()
    finally:
        for c in socks:
            c.close()
        sender.close()


# ---- 7. the sandbox ------------------------------------------------------------------------------------

_SYSCALLS = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
NR = {"x86_64": (319, 248, 308), "aarch64": (279, 217, 268)}[os.uname().machine]
def call(nr, *args):
    ctypes.set_errno(0)
    r = libc.syscall(ctypes.c_long(nr), *args)
    return "ok" if r >= 0 else os.strerror(ctypes.get_errno())
print(call(NR[0], b"x", ctypes.c_uint(0)))                                                 # memfd_create
print(call(NR[1], b"user", b"k", b"v", ctypes.c_size_t(1), ctypes.c_int(-2)))             # add_key
print(call(NR[2], ctypes.c_int(-1), ctypes.c_int(0)))                                      # setns
"""


@pytest.mark.timeout(60)
def test_7_sandbox_refuses_memfd_keyring_and_setns():
    """Before: a memfd held memory `memory_mb` never counted, add_key left keys in the kernel, setns reached
    the kernel (EBADF). Now seccomp refuses all three (EPERM)."""
    from agents.tools import SandboxLimits, run_python

    r = asyncio.run(run_python(_SYSCALLS, SandboxLimits(wall_s=8.0, cpu_s=2, memory_mb=256, max_processes=4, tmp_mb=8)))
    assert r.ok, r.stderr
    assert r.stdout.splitlines() == ["Operation not permitted"] * 3, r.stdout
    assert "no_memfd" in r.isolation["seccomp"]


# ---- 8. Ray's token ----------------------------------------------------------------------------------

def test_8_ray_token_file_is_private_and_slurm_does_not_reuse_the_secret(tmp_path):
    fake_ray = tmp_path / "ray"
    fake_ray.write_text('#!/bin/bash\nmkdir -p "$HOME/.ray"\necho generated > "$HOME/.ray/auth_token"\n')  # as Ray does
    fake_ray.chmod(0o755)
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "RAY": str(fake_ray)}
    subprocess.run(["bash", "-c", "umask 022; exec \"$0\" head --block", str(ROOT / "deploy/ray/start_cluster.sh")],
                   env=env, check=True, timeout=30)
    assert stat.S_IMODE((tmp_path / ".ray" / "auth_token").stat().st_mode) == 0o600
    # asyncrl.sbatch: its Ray token is its own
    repo, bin_dir = tmp_path / "repo", tmp_path / "bin"
    (repo / "deploy" / "ray").mkdir(parents=True)
    bin_dir.mkdir()
    seen = tmp_path / "seen"
    start = repo / "deploy" / "ray" / "start_cluster.sh"
    start.write_text(f'#!/bin/bash\necho "$RAY_AUTH_TOKEN $*" >> {seen}\n')
    (bin_dir / "scontrol").write_text("#!/bin/bash\necho node0\n")
    (bin_dir / "srun").write_text('#!/bin/bash\nwhile [ $# -gt 0 ]; do case "$1" in -w) shift 2 ;; -*) shift ;; '
                                  '*) break ;; esac; done\n[ "$1" = hostname ] && { echo 10.0.0.1; exit 0; }\nexec "$@"\n')
    for p in (start, bin_dir / "scontrol", bin_dir / "srun"):
        p.chmod(0o755)
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "HOME": str(tmp_path), "ASYNCRL_REPO": str(repo),
           "ASYNCRL_SECRET": SECRET, "SLURM_JOB_NODELIST": "node0",
           "ASYNCRL_REDIS_URL": "redis://:pw@10.0.0.1:6380/0"}  # a Redis of the user's: the job starts none
    subprocess.run(["bash", str(ROOT / "deploy/slurm/asyncrl.sbatch"), "configs/demo.yaml"], env=env, check=True,
                   timeout=30)
    deadline = time.monotonic() + 5
    while len(seen.read_text().splitlines()) < 2 and time.monotonic() < deadline:  # the head's srun runs in the background
        time.sleep(0.05)
    lines = seen.read_text().splitlines()
    assert len(lines) == 2, lines
    tokens = {ln.split()[0] for ln in lines if ln.strip()}
    assert len(tokens) == 1 and SECRET not in tokens and len(tokens.pop()) == 32  # one token for head and driver
    assert SECRET not in seen.read_text()  # nor on any command line


# ---- 9. insiders bounded by role -----------------------------------------------------------------------

@pytest.mark.timeout(60)
@pytest.mark.parametrize("storage", ["shm", "zmq"])
def test_9_a_consumer_cannot_free_a_producers_memory(tmp_path, storage):
    """Before: a secret holder that got a batch freed the producer's exact arena slot (or zmq key) with
    the handle it was given; the producer then reused it and the trainer read other bytes. Now a
    consumer's handles carry no free capability."""
    cfg = TransferQueueConfig(storage=storage, capacity=16, shm_dir=str(tmp_path), run_id="roles", secret=SECRET,
                              inline_max_bytes=0)
    svc = ControllerService(cfg)
    remote = dataclasses.replace(cfg, controller_address=svc.address)
    prod, insider, trainer = (connect(remote, consumer_id=n) for n in ("prod", "insider", "trainer"))
    try:
        data = np.arange(4096, dtype=np.int64)
        prod.put([Record("a", "g", tensors={"x": data})])
        b = insider.get("trainer", timeout=5)
        h = b.samples[0].handles["x"]
        assert "slot" not in h and "free" not in h and "token" not in h, dict(h)
        used = prod.storage.arena_used() if storage == "shm" else svc.plane._unit.nbytes
        insider.storage.free([h])  # all the insider can do with what it holds
        time.sleep(0.3)
        assert (prod.storage.arena_used() if storage == "shm" else svc.plane._unit.nbytes) == used
        insider.nack(b)
        got = trainer.get("trainer", timeout=5)
        assert np.array_equal(trainer.fetch(got, as_torch=False)[0]["x"], data) and trainer.ack(got) == 1
    finally:
        for c in (prod, insider, trainer):
            c.close()
        svc.close()


@pytest.mark.timeout(60)
def test_9_fresh_receiver_ids_do_not_stall_publishes():
    """Before: a secret holder that joined under a fresh id before every publish, and never read, cost
    every publish `timeout_s`. Now a newcomer waits for `sync()`; publishes go on at once."""
    cfg = WeightsConfig(backend="local", bucket_size_mb=0.02, timeout_s=2.0, secret=SECRET)
    sender = Sender(cfg)
    rx = Receiver(cfg, "r0", endpoint=sender.endpoint)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                for _ in rx.next_update(timeout_s=0.2):
                    pass
            except TimeoutError:
                continue

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    ctx = zmq.Context()
    ghosts = []
    try:
        assert sender.wait_for_ids(["r0"], timeout_s=10) == []
        state = {"w": torch.randn(64, 64)}
        assert sender.publish(state.items(), 1).completed == ["r0"]
        from checkpoint_engine.wire import Join, encode

        for v in range(2, 5):
            ghost = ctx.socket(zmq.DEALER)
            ghost.linger = 0
            ghost.identity = f"ghost-{v}".encode()
            curve_client(ghost, SECRET, -1)  # -1: no frame limit
            ghost.connect(sender.endpoint)
            ghost.send(encode(Join(f"ghost-{v}", -1)))
            ghosts.append(ghost)
            assert sender.wait_for_ids([f"ghost-{v}"], timeout_s=5) == []
            t = time.monotonic()
            out = sender.publish(state.items(), v)
            assert out.completed == ["r0"] and not out.evicted and time.monotonic() - t < 1.5
        assert sorted(sender.stats()["behind"]) == ["ghost-2", "ghost-3", "ghost-4"]  # for sync(), if wanted
    finally:
        stop.set()
        server.join(5)
        for g in ghosts:
            g.close(0)
        ctx.term()
        rx.close()
        sender.close()
