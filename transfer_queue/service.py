"""The memory controller as a ZeroMQ service, and the proxy clients use to reach it.

`ControllerService` owns a `MemoryController` and a ROUTER socket bound to
`bind_host`. The socket thread decodes each request and hands it to a worker pool;
workers send replies back through an inproc socket. A malformed, truncated or oversized request is rejected, counted
(`stats().rejected`) and answered with an error; it never reaches the controller.
`RemoteController` implements the same `MetadataStore` over that socket.

Wire (`transfer_queue/protocol.py`): request `{"id": int, "op": str, "args": map}`, reply
`{"id", "ok", "result" | "error", "kind"}`. Every op's args are one msgspec Struct, decoded by
that op's typed decoder: an exact field set, numbers checked (NaN, inf, negatives, absurd
counts are rejected and counted); ops that change or finish records carry the caller's
`client_id` (ownership: `rules.may_act`); handles are typed per plane, then checked against
the run's plane (`storage.handles`, `StoragePlane.verify`) before they are stored.

Identities: a client's first call is `hello`, answered with a random token that only its (CURVE
encrypted) connection saw; it sends that token as `client_id` (and a `get`'s `consumer_id`), and
the service acts as the identity behind it (`<name>#<random>`), never as a name a message claims:
with `queue.secret` an unknown token is refused (`rejected`). So a secret holder can act as a
producer or consumer of its own, not as another client. Without a secret (a trusted host) a
client_id that is no token is taken as given. The free capability of a handle (`handles.without_free`)
goes only to the client that put it: other consumers get copies they can read but not free.

A request may arrive cut in parts (`auth.parts`; the listener takes frames of at most
`auth.LISTEN_FRAME_BYTES`, before and after the handshake): the parts are joined, at most
`queue.max_message_bytes` in all (the rest of a longer request is drained and the request rejected).

Workers: `get` and `put` calls that may wait (timeout > 0 or nil) run in two pools of
`queue.max_blocking_ops` threads each; one more such call is refused at once
(`BusyError`, counted in `stats().busy`). Every other op runs on a small separate pool,
so waiting calls never starve `stats`, `ack` or a `put` that fits. The ROUTER socket
limits frames to `queue.max_frame_bytes` and, with `queue.secret`, is a CURVE server
(`transfer_queue/auth.py`): a peer without the secret gets no answer.

Start one in its own process with `python -m transfer_queue.service --port 5555
--storage shm` (prints its address; the secret, if any, from `$TQ_SECRET`), or in-process
with `ControllerService(config)`.
"""

from __future__ import annotations

import argparse
import itertools
import os
import secrets
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import msgspec
import zmq

from plane_common import curve
from plane_common.net import endpoint, resolve
from transfer_queue import auth
from transfer_queue.codec import WireError, decode, pack
from transfer_queue.config import TransferQueueConfig, new_run_id
from transfer_queue.metadata.base import GetRequest, MetadataStore, default_consumer_id
from transfer_queue.metadata.memory import MemoryController
from transfer_queue.protocol import (ARGS, RESULTS, AckArgs, DropArgs, GetArgs, Hello, HelloArgs, Info, NackArgs,
                                     PutArgs, Reply, UpdateArgs, reply_decoder, request_decoder)
from transfer_queue.records import Batch, QueueStats, SampleMeta
from transfer_queue.storage import make_storage
from transfer_queue.storage.handles import Handle, identity, without_free

MAX_CLIENTS = 1 << 16
"""Tokens a service hands out (`hello`) at most; one more is refused (`BusyError`)."""

_ERRORS: dict[str, type[Exception]] = {"ValueError": ValueError, "KeyError": KeyError, "TimeoutError": TimeoutError,
                                       "WireError": WireError, "PermissionError": PermissionError}


class BusyError(RuntimeError):
    """The service already runs `queue.max_blocking_ops` waiting calls of this kind; retry later."""


_ERRORS["BusyError"] = BusyError


class ControllerService:
    """Example: `svc = ControllerService(TransferQueueConfig(storage="shm")); svc.address`."""

    def __init__(self, config: TransferQueueConfig, port: int = 0, quick_workers: int = 4) -> None:
        self.config = config
        self.plane = make_storage(config)  # checks and frees handles; for `zmq` it also hosts the storage unit
        self.controller = MemoryController(config.capacity, config.consumer_groups, config.lease_timeout_s,
                                           on_free=self._freed)
        self.rejected = 0
        self.busy = 0
        self._count_lock = threading.Lock()
        self._clients: dict[str, str] = {}
        """hello token -> the identity the service acts as for it."""
        self._owners: dict[tuple, str] = {}
        """Memory of a live record (`handles.identity`) -> the identity that put it (the one client
        whose `get`s keep the handle's free capability)."""
        self._ctx = zmq.Context()
        self.gate = auth.Gate(self._ctx, config.secret, config.max_connections)
        self._sock = self.gate.server(self._ctx.socket(zmq.ROUTER), config.max_frame_bytes)
        host = resolve(config.bind_host, "queue.bind_host")
        port = self.gate.bind(self._sock, host, port)
        self.address = endpoint(host, port)
        self._inproc = f"inproc://tq-replies-{id(self)}"
        self._replies = self._ctx.socket(zmq.PULL)
        self._replies.bind(self._inproc)
        self._local = threading.local()
        cap = config.max_blocking_ops
        # pool -> (executor, cap on calls in flight or None for unbounded): waiting calls never starve the rest
        self._pools: dict[str, tuple[ThreadPoolExecutor, int | None]] = {
            "get": (ThreadPoolExecutor(cap, thread_name_prefix="tq-ctl-get"), cap),
            "put": (ThreadPoolExecutor(cap, thread_name_prefix="tq-ctl-put"), cap),
            "quick": (ThreadPoolExecutor(quick_workers, thread_name_prefix="tq-ctl"), None)}
        self._in_flight = {name: 0 for name in self._pools}
        self._ops: dict[str, Callable[[Any], Any]] = {
            "put": self._put, "update": self._update, "get": self._get, "ack": self._ack, "nack": self._nack,
            "drop": self._drop, "renew": self._renew, "stats": self._stats, "info": self._info, "hello": self._hello}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="tq-ctl-loop", daemon=True)
        self._thread.start()

    # ---- socket loop -----------------------------------------------------
    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._replies, zmq.POLLIN)
        while not self._stop.is_set():
            for sock, _ in poller.poll(100):
                if sock is self._replies:
                    self._sock.send_multipart(self._replies.recv_multipart())
                    continue
                ident, body = self._recv_request()
                rid = -1
                try:
                    if body is None:
                        raise WireError(f"request over queue.max_message_bytes={self.config.max_message_bytes}")
                    req = decode(request_decoder, body, self.config.max_message_bytes, "request")
                    if req.op not in self._ops:
                        raise WireError(f"unknown op {req.op!r}")
                    rid = req.id
                    args = decode(ARGS[req.op], req.args, self.config.max_message_bytes, req.op)
                    pool = _pool_of(req.op, args)
                except WireError as e:
                    self._count("rejected")
                    self._sock.send_multipart([ident, pack(Reply(rid, False, error=str(e), kind="WireError"))])
                    continue
                executor, cap = self._pools[pool]
                with self._count_lock:
                    full = cap is not None and self._in_flight[pool] >= cap
                    if not full:
                        self._in_flight[pool] += 1
                if full:
                    self._count("busy")
                    msg = f"busy: {cap} waiting {pool} calls in flight (queue.max_blocking_ops)"
                    self._sock.send_multipart([ident, pack(Reply(rid, False, error=msg, kind="BusyError"))])
                    continue
                executor.submit(self._run, ident, rid, req.op, args, pool)
        self._sock.close(0)
        self._replies.close(0)

    def _recv_request(self) -> tuple[bytes, bytes | None]:
        """(routing id, the request's parts joined), or None for a request over `queue.max_message_bytes`
        (its remaining parts are read and dropped, never kept)."""
        ident = self._sock.recv()
        parts: list[bytes] = []
        size, over = 0, False
        while self._sock.getsockopt(zmq.RCVMORE):
            part = self._sock.recv()
            size += len(part)
            over = over or size > self.config.max_message_bytes
            if not over:
                parts.append(part)
        return ident, None if over else b"".join(parts)

    def _count(self, what: str) -> None:
        with self._count_lock:
            setattr(self, what, getattr(self, what) + 1)

    def _run(self, ident: bytes, rid: int, op: str, args: Any, pool: str) -> None:
        try:
            rep = Reply(rid, True, self._ops[op](args))
        except Exception as e:  # translated into an error reply; the caller re-raises it
            if isinstance(e, (WireError, TypeError, ValueError, KeyError)):
                self._count("rejected")  # (PermissionError is counted by the controller as `not_owner`)
            rep = Reply(rid, False, error=str(e), kind=type(e).__name__)
        finally:
            with self._count_lock:
                self._in_flight[pool] -= 1
        out = self._local.__dict__.get("push")
        if out is None:
            out = self._local.push = self._ctx.socket(zmq.PUSH)
            out.connect(self._inproc)
        out.send_multipart([ident, pack(rep)])

    # ---- ops: arguments arrive typed (protocol.ARGS); what a type cannot say is checked here -----
    def _hello(self, a: HelloArgs) -> Hello:
        with self._count_lock:
            if len(self._clients) >= MAX_CLIENTS:
                raise BusyError(f"busy: {MAX_CLIENTS} clients already said hello")
            token = secrets.token_urlsafe(24)
            self._clients[token] = f"{a.name}#{secrets.token_hex(8)}"
        return Hello(token)

    def _who(self, client: str) -> str:
        """The identity behind a `hello` token; with a secret nothing else is anyone."""
        who = self._clients.get(client)
        if who is not None:
            return who
        if self.config.secret:
            raise WireError("unknown client token (a client says hello first; names are not identities)")
        return client  # no secret: a trusted host, the name is taken as given

    def _put(self, a: PutArgs) -> None:
        if len(a.samples) > self.config.capacity:
            raise WireError(f"put: number of samples must be an integer in [0, {self.config.capacity}], got {len(a.samples)}")
        who = self._who(a.client_id)
        for smp in a.samples:
            smp.handles = self._checked(smp.handles)
        self.controller.put(a.samples, a.timeout, who)
        self._own([h for smp in a.samples for h in smp.handles.values()], who)

    def _update(self, a: UpdateArgs) -> None:
        who = self._who(a.client_id)
        handles = self._checked(a.handles)
        self.controller.update(a.uid, handles, a.meta, a.seal, who)
        self._own(list(handles.values()), who)

    def _checked(self, handles: dict[str, Handle]) -> dict[str, Handle]:
        return {name: self.plane.check(h) for name, h in handles.items()}

    def _own(self, handles: list[Handle], who: str) -> None:
        for h in handles:
            i = identity(h)
            if i is not None:
                self._owners[i] = who

    def _freed(self, handles: list[Any]) -> None:
        for h in handles:
            i = identity(h)
            if i is not None:
                self._owners.pop(i, None)
        self.plane.free(handles)

    def _get(self, a: GetArgs) -> Batch:
        a.consumer_id = self._who(a.consumer_id)
        try:
            req = GetRequest(**msgspec.structs.asdict(a))
        except (TypeError, ValueError) as e:
            raise WireError(f"get request: {e}") from e
        if (req.num_groups or 0) > self.config.capacity or (req.num_samples or 0) > self.config.capacity:
            raise WireError(f"get: batch size exceeds queue.capacity={self.config.capacity}")
        batch = self.controller.get(req)
        return msgspec.structs.replace(batch, samples=self._readable(batch.samples, a.consumer_id),
                                       stale=self._readable(batch.stale, a.consumer_id))

    def _readable(self, samples: list[SampleMeta], who: str) -> list[SampleMeta]:
        """`samples` as `who` may see them: the free capability only of handles it put itself."""
        out = []
        for s in samples:
            handles = {n: h if self._owners.get(identity(h)) == who else without_free(h) for n, h in s.handles.items()}
            out.append(s if handles == s.handles else msgspec.structs.replace(s, handles=handles))
        return out

    def _ack(self, a: AckArgs) -> int:
        return self.controller.ack(a.consumer, a.uids, self._who(a.client_id))

    def _nack(self, a: NackArgs) -> int:
        return self.controller.nack(a.consumer, a.lease_id, a.uids, self._who(a.client_id))

    def _drop(self, a: DropArgs) -> int:
        return self.controller.drop(a.consumer, a.uids, a.cause, self._who(a.client_id))

    def _renew(self, a: NackArgs) -> bool:
        return self.controller.renew(a.consumer, a.lease_id, a.uids, self._who(a.client_id))

    def _stats(self, a: Any) -> QueueStats:
        s = self.controller.stats()
        s.rejected, s.busy = self.rejected, self.busy
        s.auth_refused, s.handshake_failed = self.gate.refused, self.gate.handshake_failed
        return s

    def _info(self, a: Any) -> Info:
        return Info(self.config.storage, self.plane.address(), list(self.config.consumer_groups), self.config.capacity)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        for executor, _ in self._pools.values():
            executor.shutdown(wait=False, cancel_futures=True)
        self.gate.close()
        self.plane.close()


def _pool_of(op: str, args: Any) -> str:
    """`get` / `put` calls that may wait (timeout > 0 or nil) run in their own bounded pool."""
    if op in ("get", "put") and args.timeout != 0:
        return op
    return "quick"


class RemoteController(MetadataStore):
    """`MetadataStore` over a `ControllerService`; one DEALER socket per calling thread (CURVE
    client with `secret`; a service that does not answer raises TimeoutError)."""

    def __init__(self, address: str, rpc_grace_s: float = 60.0, secret: str = "",
                 max_frame_bytes: int = 64 << 20) -> None:
        self.address = address
        self._ctx = zmq.Context()
        self._local = threading.local()
        self._socks: list[zmq.Socket] = []
        self._ids = itertools.count(1)
        self._grace_ms = int(rpc_grace_s * 1000)
        self._secret, self._max_frame = secret, max_frame_bytes
        self._tokens: dict[str, str] = {}
        """This process's client ids -> the tokens the service gave them (`hello`)."""
        self._tokens_lock = threading.Lock()
        self.consumer_groups = self.call("info", {}).consumer_groups

    def token(self, client_id: str) -> str:
        """The service's token for `client_id` (asked for once, with `hello`)."""
        client_id = client_id or default_consumer_id()
        with self._tokens_lock:
            token = self._tokens.get(client_id)
        if token is None:
            token = self.call("hello", HelloArgs(name=client_id)).token
            with self._tokens_lock:
                token = self._tokens.setdefault(client_id, token)
        return token

    def call(self, op: str, args: Any, timeout: float | None = 0.0) -> Any:
        """One op; `args` a map or that op's args Struct; returns the op's typed result."""
        sock = self._local.__dict__.get("sock")
        if sock is None:
            sock = self._local.sock = curve.client(self._ctx.socket(zmq.DEALER), self._secret, self._max_frame)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(self.address)
            self._socks.append(sock)
        rid = next(self._ids)
        sock.send_multipart(auth.parts(pack({"id": rid, "op": op, "args": args})), copy=False)
        wait = None if timeout is None else int(timeout * 1000) + self._grace_ms
        while True:
            if not sock.poll(wait):
                raise TimeoutError(f"controller {self.address} did not answer {op}")
            rep = decode(reply_decoder, sock.recv(), self._max_frame, "reply")
            if rep.id in (rid, -1):
                break  # replies to calls that timed out earlier are skipped
        if not rep.ok:
            raise _ERRORS.get(rep.kind, RuntimeError)(f"controller: {rep.error}")
        return decode(RESULTS[op], rep.result, self._max_frame, f"{op} reply") if op in RESULTS else rep.result

    def put(self, samples: list[SampleMeta], timeout: float | None = None, client_id: str = "") -> None:
        self.call("put", PutArgs(samples=samples, timeout=timeout, client_id=self.token(client_id)), timeout)

    def update(self, uid: str, handles: dict, meta: dict | None = None, seal: bool = True, client_id: str = "") -> None:
        self.call("update", {"uid": uid, "handles": handles, "meta": meta or {}, "seal": seal,
                             "client_id": self.token(client_id)})

    def get(self, req: GetRequest) -> Batch:
        wire = req.to_wire()
        wire["consumer_id"] = self.token(req.consumer_id)
        return self.call("get", wire, req.timeout)

    def ack(self, consumer: str, uids: list[str], client_id: str = "") -> int:
        return self.call("ack", {"consumer": consumer, "uids": uids, "client_id": self.token(client_id)})

    def nack(self, consumer: str, lease_id: str, uids: list[str], client_id: str = "") -> int:
        return self.call("nack", {"consumer": consumer, "lease_id": lease_id, "uids": uids,
                                  "client_id": self.token(client_id)})

    def drop(self, consumer: str, uids: list[str], cause: str, client_id: str = "", records_only: bool = False) -> int:
        """The service's store is `memory`: record by record, so `records_only` changes nothing."""
        return self.call("drop", {"consumer": consumer, "uids": uids, "cause": cause,
                                  "client_id": self.token(client_id)})

    def renew(self, consumer: str, lease_id: str, uids: list[str], client_id: str = "") -> bool:
        return self.call("renew", {"consumer": consumer, "lease_id": lease_id, "uids": uids,
                                   "client_id": self.token(client_id)})

    def stats(self) -> QueueStats:
        return self.call("stats", {})

    def close(self) -> None:
        for s in self._socks:
            s.close(0)
        self._socks.clear()


def main(argv: list[str] | None = None) -> None:
    """Run a memory controller service in this process until interrupted."""
    p = argparse.ArgumentParser(prog="python -m transfer_queue.service")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--bind-host", default="127.0.0.1")
    p.add_argument("--storage", default="shm")
    p.add_argument("--capacity", type=int, default=4096)
    p.add_argument("--consumer-groups", default="trainer")
    p.add_argument("--lease-timeout-s", type=float, default=60.0)
    p.add_argument("--run-id", default=new_run_id(), help="queue.run_id (default: its own, printed on line 2)")
    p.add_argument("--max-connections", type=int, default=256)
    a = p.parse_args(argv)
    cfg = TransferQueueConfig(storage=a.storage, capacity=a.capacity, bind_host=a.bind_host,
                              consumer_groups=a.consumer_groups.split(","), lease_timeout_s=a.lease_timeout_s,
                              max_connections=a.max_connections, run_id=a.run_id)
    cfg.secret = os.environ.get("TQ_SECRET", "")  # never on the command line (visible to every user in ps)
    svc = ControllerService(cfg, port=a.port)
    print(svc.address, flush=True)
    print(f"run_id={cfg.run_id}", flush=True)  # what its clients' queue.run_id must be (their handles are refused otherwise)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        svc.close()


if __name__ == "__main__":
    main(sys.argv[1:])
