"""`gloo` / `nccl`: torch.distributed broadcast in a dedicated group of sender + receivers.

The group is built directly as a `ProcessGroupGloo` / `ProcessGroupNCCL` on a TCP store
the sender hosts, never through `init_process_group`, so it cannot collide with the
trainer's own default group and can be rebuilt at will: each membership *epoch* gets
its own store prefix. The sender is rank 0 and the broadcast root. With `nccl` the slots
and the receive buffers live on `config.device`; the code path is otherwise identical.

Listeners bind `config.host` only: the store's socket is bound here and handed to the TCPStore
(`master_listen_fd`; TCPStore itself would listen on every interface), and gloo's pair
listener binds `config.host` on the sender and, on a receiver, the local address that routes
to it. NCCL's own bootstrap listener follows `NCCL_SOCKET_IFNAME` (process-wide; not set here).
"""

from __future__ import annotations

import datetime
import socket
from typing import Any

import torch
import torch.distributed as dist

from checkpoint_engine.backends.base import ReceiverTransport, SenderTransport
from checkpoint_engine.config import WeightsConfig
from checkpoint_engine.wire import BucketMeta


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


def local_address(peer: str) -> str:
    """The local address this host uses to reach `peer` (no packet is sent)."""
    family = socket.AF_INET6 if ":" in peer else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((peer, 9))
        return s.getsockname()[0]


def _new_group(config: WeightsConfig, store: dist.Store, epoch: int, rank: int, world: int, bind: str):
    prefixed = dist.PrefixStore(f"weights/epoch{epoch}", store)
    timeout = datetime.timedelta(seconds=config.timeout_s)
    if config.backend == "nccl":
        torch.cuda.set_device(torch.device(config.device))
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, world, opts)
    gloo_opts = dist.ProcessGroupGloo._Options()
    gloo_opts._timeout = timeout
    gloo_opts._devices = [dist.ProcessGroupGloo.create_device(hostname=bind)]
    return dist.ProcessGroupGloo(prefixed, rank, world, gloo_opts)


def _broadcast(pg, tensor: torch.Tensor, timeout_s: float) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    opts.rootTensor = 0
    opts.timeout = datetime.timedelta(seconds=timeout_s)
    pg.broadcast([tensor], opts).wait()
    if tensor.device.type == "cuda":
        torch.cuda.current_stream(tensor.device).synchronize()


class CollectiveSenderTransport(SenderTransport):
    collective = True

    def __init__(self, config: WeightsConfig):
        super().__init__(config)
        fd, port = _listen(config.host, config.store_port)
        self.store = dist.TCPStore(
            config.host, port, is_master=True, wait_for_workers=False,
            timeout=datetime.timedelta(seconds=config.timeout_s), master_listen_fd=fd)
        self.slots = [torch.empty(config.bucket_bytes, dtype=torch.uint8, device=config.device)
                      for _ in range(2)]
        self.pg = None

    def begin_info(self) -> dict[str, Any]:
        return {"host": self.config.host, "port": self.store.port}

    def form_group(self, epoch: int, world_size: int) -> None:
        self.pg = None
        self.pg = _new_group(self.config, self.store, epoch, 0, world_size, self.config.host)

    def send(self, meta: BucketMeta) -> None:
        assert self.pg is not None, "form_group before send"
        _broadcast(self.pg, self.slots[meta.slot][: meta.nbytes], self.config.timeout_s)

    def close(self) -> None:
        self.pg = None
        super().close()


class CollectiveReceiverTransport(ReceiverTransport):
    borrowed = True  # one landing buffer, reused: no fresh allocation (page faults) per bucket

    def __init__(self, config: WeightsConfig):
        super().__init__(config)
        self.landing = torch.empty(config.bucket_bytes, dtype=torch.uint8, device=config.device)
        self.store: dist.TCPStore | None = None
        self.addr: tuple[str, int] | None = None
        self.pg = None

    def attach(self, info: dict[str, Any]) -> None:
        addr = (info["host"], int(info["port"]))
        if addr != self.addr:
            self.store = dist.TCPStore(
                addr[0], addr[1], is_master=False,
                timeout=datetime.timedelta(seconds=self.config.timeout_s))
            self.addr = addr

    def form_group(self, epoch: int, rank: int, world_size: int) -> None:
        assert self.store is not None, "attach before form_group"
        self.pg = None
        self.pg = _new_group(self.config, self.store, epoch, rank, world_size, local_address(self.addr[0]))

    def recv(self, meta: BucketMeta) -> torch.Tensor:
        assert self.pg is not None, "form_group before recv"
        out = self.landing[: meta.nbytes]
        _broadcast(self.pg, out, self.config.timeout_s)
        return out

    def close(self) -> None:
        self.pg = None
        self.store = None
        self.addr = None
