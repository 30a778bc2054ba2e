"""`gloo` / `nccl`: torch.distributed broadcast in a dedicated group of sender + receivers.

The group is built directly as a `ProcessGroupGloo` / `ProcessGroupNCCL` on a TCP store
the sender hosts, never through `init_process_group`, so it cannot collide with the
trainer's own default group and can be rebuilt at will: each membership *epoch* gets
its own store prefix. The sender is rank 0 and the broadcast root. With `nccl` the slots
and the receive buffers live on `config.device`; the code path is otherwise identical.

Listeners bind `config.host` only (the sender's, resolved on its host: `Sender`): the store's socket is
bound here and handed to the TCPStore (`master_listen_fd`; TCPStore itself would listen on every
interface), and gloo's pair listener binds `config.host` on the sender and, on a receiver, the local
address that routes to it (`plane_common.net.route_to`), so members on several hosts reach each other.
NCCL's own bootstrap listener follows `NCCL_SOCKET_IFNAME` (process-wide, read once by NCCL): asyncrl's
server and trainer processes set it to the interface that reaches their peer (`plane_common.net.socket_env`).

The store has no authentication of its own (anyone who reaches its port may set and get keys),
so every key the groups use lives under a random prefix of the sender's (`key`, 128 bits), handed
to receivers in `Begin.info` over the control socket (CURVE with `secret`). A process that knows
only the port cannot find the rendezvous keys (a TCPStore cannot list its keys), so it cannot take
a rank in a group, read the members' addresses or NCCL's unique id (whose magic NCCL's bootstrap
checks on every connection).

Every wait is bounded by `timeout_s` on the host, whatever the backend: `wait()` on an NCCL work
only orders streams, and a stream synchronize behind a broadcast a dead peer never joins would
block until NCCL's watchdog tears the whole process down. So a broadcast is polled
(`work.is_completed()`) against a deadline; past it the group is aborted (`ncclCommAbort`: the
kernel stops, the communicator is gone) and RuntimeError raised, which the sender and receiver
translate into the regroup of the survivors (`Sender._ship`). The watchdog's own timeout is set
well past that deadline so that it never fires first. NCCL builds its communicator lazily, at the
first collective, and that blocks the host until every rank joins: `form_group` does it at once
(`eager_connect_single_device`) under the same bound, so a member missing from a new group fails
the group, as a gloo handshake does, not the first bucket. A group is aborted when it is replaced
(after an eviction) or closed, so no communicator that names an evicted member stays alive.
An asynchronous NCCL error (a network transport that sees its peer die) would, under torch's
default `TORCH_NCCL_ASYNC_ERROR_HANDLING=3`, also tear the process down from the watchdog; the
weight plane's groups are built with it at 2 (clean up only: the failed work raises, the sender
evicts), set just around their construction (torch reads it there) and restored at once.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import secrets
import socket
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from checkpoint_engine.backends.base import ReceiverTransport, SenderTransport, resolve_device, sync_stream
from checkpoint_engine.config import WeightsConfig
from checkpoint_engine.wire import BucketMeta
from plane_common.net import route_to


def _listen(host: str, port: int) -> tuple[int, int]:
    """A listening TCP socket on `host:port` only: (file descriptor the TCPStore takes over, port)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(512)
    except OSError as e:
        sock.close()
        raise OSError(f"weights.host / weights.store_port: cannot listen on {host}:{port}: {e}") from e
    bound = sock.getsockname()[1]
    return sock.detach(), bound


def _watchdog_s(timeout_s: float) -> float:
    """NCCL's own timeout: past the host's deadline (`timeout_s`), so the bounded wait aborts the
    group before the watchdog would kill the process."""
    return 2 * timeout_s + 30.0


def _new_group(config: WeightsConfig, device: torch.device, store: dist.Store, epoch: int, rank: int,
               world: int, bind: str, key: str = ""):
    prefixed = dist.PrefixStore(f"{key}/weights/epoch{epoch}", store)
    if config.backend == "nccl":
        torch.cuda.set_device(device)
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = datetime.timedelta(seconds=_watchdog_s(config.timeout_s))
        with _env("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2"):  # a failing group raises, never kills the process
            pg = dist.ProcessGroupNCCL(prefixed, rank, world, opts)
        _bounded(lambda: pg.eager_connect_single_device(device), config.timeout_s, pg,
                 f"nccl group of epoch {epoch} (rank {rank} of {world})")
        return pg
    gloo_opts = dist.ProcessGroupGloo._Options()
    gloo_opts._timeout = datetime.timedelta(seconds=config.timeout_s)
    gloo_opts._devices = [dist.ProcessGroupGloo.create_device(hostname=bind)]
    return dist.ProcessGroupGloo(prefixed, rank, world, gloo_opts)


@contextlib.contextmanager
def _env(key: str, value: str):
    """`os.environ[key] = value` for the block only."""
    before = os.environ.get(key)
    os.environ[key] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = before


def _bounded(call, timeout_s: float, pg, what: str) -> None:
    """Run `call` (a blocking NCCL communicator init) on a helper thread; past `timeout_s` abort `pg`
    and raise RuntimeError (the thread is abandoned: a blocking init cannot be interrupted)."""
    error: list[BaseException] = []

    def run() -> None:
        try:
            call()
        except BaseException as e:  # handed to the caller below
            error.append(e)

    t = threading.Thread(target=run, name="weights-nccl-init", daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        abort_group(pg)
        raise RuntimeError(f"{what}: not every rank joined within {timeout_s} s")
    if error:
        raise RuntimeError(f"{what}: {error[0]}") from error[0]


def abort_group(pg) -> None:
    """Abort `pg` (NCCL: `ncclCommAbort`, which stops its kernels and frees the communicator; gloo has
    no kernel to stop, its pending op ends at its own timeout); never raises, since it runs on a group
    already failing or being replaced."""
    if pg is None:
        return
    try:
        pg.abort()
    except (RuntimeError, AttributeError):  # deliberate: an aborted or never-connected group has nothing left
        pass


def wait_bounded(pg, work, timeout_s: float, what: str = "broadcast") -> None:
    """Wait for `work` on the host, at most `timeout_s`: poll `is_completed()`, then `wait()` (raises
    the collective's own error; on CUDA it orders the current stream after it, already done). Past
    the deadline `pg` is aborted and RuntimeError raised: the member that did not join is evicted by
    the sender and the survivors form a new group."""
    deadline = time.monotonic() + timeout_s
    pause = 0.00005
    while not work.is_completed():
        if time.monotonic() > deadline:
            abort_group(pg)
            raise RuntimeError(f"{what}: not complete after {timeout_s} s (a member died or stalled); group aborted")
        time.sleep(pause)
        pause = min(pause * 2, 0.001)
    work.wait()


def _broadcast(pg, tensor: torch.Tensor, config: WeightsConfig) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    opts.rootTensor = 0
    # gloo's own timeout is the deadline (its worker thread must be free when the group is dropped);
    # NCCL's watchdog must come later than the deadline
    op_s = _watchdog_s(config.timeout_s) if config.backend == "nccl" else config.timeout_s
    opts.timeout = datetime.timedelta(seconds=op_s)
    wait_bounded(pg, pg.broadcast([tensor], opts), config.timeout_s)


class CollectiveSenderTransport(SenderTransport):
    collective = True

    def __init__(self, config: WeightsConfig):
        super().__init__(config)
        self.device = resolve_device(config.device)
        fd, port = _listen(config.host, config.store_port)
        self.store = dist.TCPStore(
            config.host, port, is_master=True, wait_for_workers=False,
            timeout=datetime.timedelta(seconds=config.timeout_s), master_listen_fd=fd)
        self.key = secrets.token_hex(16)
        """Prefix of every store key of this sender's groups: only who got `Begin.info` knows it."""
        self.slots = [torch.empty(config.bucket_bytes, dtype=torch.uint8, device=self.device)
                      for _ in range(2)]
        self.pg = None

    def begin_info(self) -> dict[str, Any]:
        return {"host": self.config.host, "port": self.store.port, "key": self.key}

    def form_group(self, epoch: int, world_size: int) -> None:
        abort_group(self.pg)  # the old group may name an evicted member
        self.pg = None
        self.pg = _new_group(self.config, self.device, self.store, epoch, 0, world_size, self.config.host, self.key)

    def seal(self, meta: BucketMeta) -> None:
        sync_stream(self.device)  # the packer's copies into the slot are done before it is broadcast

    def send(self, meta: BucketMeta) -> None:
        assert self.pg is not None, "form_group before send"
        _broadcast(self.pg, self.slots[meta.slot][: meta.nbytes], self.config)

    def close(self) -> None:
        abort_group(self.pg)
        self.pg = None
        super().close()


class CollectiveReceiverTransport(ReceiverTransport):
    borrowed = True  # one landing buffer, reused: no fresh allocation (page faults) per bucket

    def __init__(self, config: WeightsConfig):
        super().__init__(config)
        self.device = resolve_device(config.device)
        self.landing = torch.empty(config.bucket_bytes, dtype=torch.uint8, device=self.device)
        self.store: dist.TCPStore | None = None
        self.addr: tuple[str, int] | None = None
        self.key = ""
        self.pg = None

    def attach(self, info: dict[str, Any]) -> None:
        addr = (info["host"], int(info["port"]))
        self.key = str(info["key"])
        if addr != self.addr:
            self.store = dist.TCPStore(
                addr[0], addr[1], is_master=False,
                timeout=datetime.timedelta(seconds=self.config.timeout_s))
            self.addr = addr

    def form_group(self, epoch: int, rank: int, world_size: int) -> None:
        assert self.store is not None, "attach before form_group"
        abort_group(self.pg)
        self.pg = None
        self.pg = _new_group(self.config, self.device, self.store, epoch, rank, world_size,
                             route_to(self.addr[0]) or self.addr[0], self.key)

    def recv(self, meta: BucketMeta) -> torch.Tensor:
        assert self.pg is not None, "form_group before recv"
        out = self.landing[: meta.nbytes]
        _broadcast(self.pg, out, self.config)
        return out

    def release(self, meta: BucketMeta) -> None:
        sync_stream(self.device)  # reads of the landing buffer are done before the next bucket lands in it

    def close(self) -> None:
        abort_group(self.pg)
        self.pg = None
        self.store = None
        self.addr = None
