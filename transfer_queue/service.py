"""The memory controller as a ZeroMQ service, and the proxy clients use to reach it.

`ControllerService` owns a `MemoryController` and a ROUTER socket bound to
`bind_host`. The socket thread decodes each request and hands it to a worker pool;
workers send replies back through an inproc socket. A malformed, truncated or oversized request is rejected, counted
(`stats().rejected`) and answered with an error; it never reaches the controller.
`RemoteController` implements the same `MetadataStore` over that socket.

Wire: request `{"id": int, "op": str, "args": map}`, reply `{"id", "ok", "result" | "error", "kind"}`.
Every op's args are an exact field set; ops that change or finish records carry the
caller's `client_id` (ownership: `rules.may_act`). Numbers are checked (NaN, inf,
negatives, absurd counts are rejected and counted); handles are checked per plane
(`storage.handles`, `StoragePlane.verify`) before they are stored.

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
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import zmq

from transfer_queue import auth
from transfer_queue.codec import MAX_COUNT, WireError, check_int, check_seconds, expect_map, pack, unpack
from transfer_queue.config import TransferQueueConfig
from transfer_queue.metadata.base import GetRequest, MetadataStore, default_consumer_id
from transfer_queue.metadata.memory import MemoryController
from transfer_queue.records import Batch, QueueStats, SampleMeta
from transfer_queue.storage import make_storage

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
                                           on_free=self.plane.free)
        self.rejected = 0
        self.busy = 0
        self._count_lock = threading.Lock()
        self._ctx = zmq.Context()
        self.gate = auth.Gate(self._ctx, config.secret)
        self._sock = self.gate.server(self._ctx.socket(zmq.ROUTER), config.max_frame_bytes)
        if port:
            self._sock.bind(f"tcp://{config.bind_host}:{port}")
        else:
            port = self._sock.bind_to_random_port(f"tcp://{config.bind_host}")
        self.address = f"tcp://{config.bind_host}:{port}"
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
        self._ops: dict[str, Callable[[dict], Any]] = {
            "put": self._put, "update": self._update, "get": self._get, "ack": self._ack, "nack": self._nack,
            "drop": self._drop, "renew": self._renew, "stats": self._stats, "info": self._info}
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
                frames = self._sock.recv_multipart()
                ident, body = frames[0], frames[1:]
                try:
                    if len(body) != 1:
                        raise WireError(f"expected 1 frame, got {len(body)}")
                    req = expect_map(unpack(body[0], self.config.max_message_bytes),
                                     {"id": int, "op": str, "args": dict}, "request")
                    check_int(req["id"], "request id")
                    if set(req) != {"id", "op", "args"}:
                        raise WireError(f"request: unknown fields {sorted(req)}")
                    if req["op"] not in self._ops:
                        raise WireError(f"unknown op {req['op']!r}")
                    pool = _pool_of(req["op"], req["args"])
                except WireError as e:
                    self._count("rejected")
                    self._sock.send_multipart([ident, pack({"id": -1, "ok": False, "error": str(e), "kind": "WireError"})])
                    continue
                executor, cap = self._pools[pool]
                with self._count_lock:
                    full = cap is not None and self._in_flight[pool] >= cap
                    if not full:
                        self._in_flight[pool] += 1
                if full:
                    self._count("busy")
                    msg = f"busy: {cap} waiting {pool} calls in flight (queue.max_blocking_ops)"
                    self._sock.send_multipart([ident, pack({"id": req["id"], "ok": False, "error": msg, "kind": "BusyError"})])
                    continue
                executor.submit(self._run, ident, req, pool)
        self._sock.close(0)
        self._replies.close(0)

    def _count(self, what: str) -> None:
        with self._count_lock:
            setattr(self, what, getattr(self, what) + 1)

    def _run(self, ident: bytes, req: dict, pool: str) -> None:
        try:
            rep = {"id": req["id"], "ok": True, "result": self._ops[req["op"]](req["args"])}
        except Exception as e:  # translated into an error reply; the caller re-raises it
            if isinstance(e, (WireError, TypeError, ValueError, KeyError)):
                self._count("rejected")  # (PermissionError is counted by the controller as `not_owner`)
            rep = {"id": req["id"], "ok": False, "error": str(e), "kind": type(e).__name__}
        finally:
            with self._count_lock:
                self._in_flight[pool] -= 1
        out = self._local.__dict__.get("push")
        if out is None:
            out = self._local.push = self._ctx.socket(zmq.PUSH)
            out.connect(self._inproc)
        out.send_multipart([ident, pack(rep)])

    # ---- ops: arguments are checked here, before they reach the controller -----
    def _put(self, a: dict) -> None:
        _exact(a, {"samples": list, "timeout": (int, float, type(None)), "client_id": str}, "put")
        check_int(len(a["samples"]), "put: number of samples", 0, self.config.capacity)
        samples = [SampleMeta.from_wire(s) for s in a["samples"]]
        for s in samples:
            for h in s.handles.values():
                self.plane.check(h)
        self.controller.put(samples, check_seconds(a["timeout"], "put: timeout"), _client(a))

    def _update(self, a: dict) -> None:
        _exact(a, {"uid": str, "handles": dict, "meta": dict, "seal": bool, "client_id": str}, "update")
        SampleMeta.from_wire({"uid": a["uid"], "group_id": "-", "group_size": 1, "version": 0,
                              "meta": a["meta"], "handles": {}, "sealed": True})
        for name, h in a["handles"].items():
            if not isinstance(name, str):
                raise WireError("update: field names must be strings")
            self.plane.check(h)
        self.controller.update(a["uid"], a["handles"], a["meta"], a["seal"], _client(a))

    def _get(self, a: dict) -> dict:
        req = GetRequest.from_wire(a)
        if (req.num_groups or 0) > self.config.capacity or (req.num_samples or 0) > self.config.capacity:
            raise WireError(f"get: batch size exceeds queue.capacity={self.config.capacity}")
        return self.controller.get(req).to_wire()

    def _ack(self, a: dict) -> int:
        _exact(a, {"consumer": str, "uids": list, "client_id": str}, "ack")
        return self.controller.ack(a["consumer"], _strs(a["uids"]), _client(a))

    def _nack(self, a: dict) -> int:
        _exact(a, {"consumer": str, "lease_id": str, "uids": list, "client_id": str}, "nack")
        return self.controller.nack(a["consumer"], a["lease_id"], _strs(a["uids"]), _client(a))

    def _drop(self, a: dict) -> int:
        _exact(a, {"consumer": str, "uids": list, "cause": str, "client_id": str}, "drop")
        return self.controller.drop(a["consumer"], _strs(a["uids"]), a["cause"], _client(a))

    def _renew(self, a: dict) -> bool:
        _exact(a, {"consumer": str, "lease_id": str, "uids": list, "client_id": str}, "renew")
        return self.controller.renew(a["consumer"], a["lease_id"], _strs(a["uids"]), _client(a))

    def _stats(self, a: dict) -> dict:
        _exact(a, {}, "stats")
        s = self.controller.stats()
        s.rejected, s.busy = self.rejected, self.busy
        s.auth_refused, s.handshake_failed = self.gate.refused, self.gate.handshake_failed
        return s.to_wire()

    def _info(self, a: dict) -> dict:
        _exact(a, {}, "info")
        return {"storage": self.config.storage, "storage_address": self.plane.address(),
                "consumer_groups": self.config.consumer_groups, "capacity": self.config.capacity}

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        for executor, _ in self._pools.values():
            executor.shutdown(wait=False, cancel_futures=True)
        self.gate.close()
        self.plane.close()


def _pool_of(op: str, args: dict) -> str:
    """`get` / `put` calls that may wait (timeout > 0 or nil) run in their own bounded pool."""
    if op in ("get", "put") and check_seconds(args.get("timeout", 0.0), f"{op}: timeout") != 0:
        return op
    return "quick"


def _exact(a: dict, keys: dict[str, Any], what: str) -> dict:
    expect_map(a, keys, what)
    if set(a) != set(keys):
        raise WireError(f"{what}: unknown fields {sorted(set(a) - set(keys))}")
    return a


def _client(a: dict) -> str:
    c = a["client_id"]
    if not 0 < len(c) <= 1024:
        raise WireError("client_id must be 1..1024 characters")
    return c


def _strs(xs: list) -> list[str]:
    check_int(len(xs), "number of uids", 0, MAX_COUNT)
    if not all(isinstance(x, str) for x in xs):
        raise WireError("uids must be strings")
    return xs


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
        self.consumer_groups = self.call("info", {})["consumer_groups"]

    def call(self, op: str, args: dict[str, Any], timeout: float | None = 0.0) -> Any:
        sock = self._local.__dict__.get("sock")
        if sock is None:
            sock = self._local.sock = auth.client(self._ctx.socket(zmq.DEALER), self._secret, self._max_frame)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(self.address)
            self._socks.append(sock)
        rid = next(self._ids)
        sock.send(pack({"id": rid, "op": op, "args": args}))
        wait = None if timeout is None else int(timeout * 1000) + self._grace_ms
        while True:
            if not sock.poll(wait):
                raise TimeoutError(f"controller {self.address} did not answer {op}")
            rep = unpack(sock.recv(), self._max_frame)
            if rep.get("id") in (rid, -1):
                break  # replies to calls that timed out earlier are skipped
        if not rep["ok"]:
            raise _ERRORS.get(rep.get("kind"), RuntimeError)(f"controller: {rep.get('error')}")
        return rep["result"]

    def put(self, samples: list[SampleMeta], timeout: float | None = None, client_id: str = "") -> None:
        self.call("put", {"samples": [s.to_wire() for s in samples], "timeout": timeout,
                          "client_id": client_id or default_consumer_id()}, timeout)

    def update(self, uid: str, handles: dict, meta: dict | None = None, seal: bool = True, client_id: str = "") -> None:
        self.call("update", {"uid": uid, "handles": handles, "meta": meta or {}, "seal": seal,
                             "client_id": client_id or default_consumer_id()})

    def get(self, req: GetRequest) -> Batch:
        return Batch.from_wire(self.call("get", req.to_wire(), req.timeout))

    def ack(self, consumer: str, uids: list[str], client_id: str = "") -> int:
        return self.call("ack", {"consumer": consumer, "uids": uids, "client_id": client_id or default_consumer_id()})

    def nack(self, consumer: str, lease_id: str, uids: list[str], client_id: str = "") -> int:
        return self.call("nack", {"consumer": consumer, "lease_id": lease_id, "uids": uids,
                                  "client_id": client_id or default_consumer_id()})

    def drop(self, consumer: str, uids: list[str], cause: str, client_id: str = "") -> int:
        return self.call("drop", {"consumer": consumer, "uids": uids, "cause": cause,
                                  "client_id": client_id or default_consumer_id()})

    def renew(self, consumer: str, lease_id: str, uids: list[str], client_id: str = "") -> bool:
        return self.call("renew", {"consumer": consumer, "lease_id": lease_id, "uids": uids,
                                   "client_id": client_id or default_consumer_id()})

    def stats(self) -> QueueStats:
        return QueueStats.from_wire(self.call("stats", {}))

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
    p.add_argument("--run-id", default="default")
    a = p.parse_args(argv)
    cfg = TransferQueueConfig(storage=a.storage, capacity=a.capacity, bind_host=a.bind_host, run_id=a.run_id,
                              consumer_groups=a.consumer_groups.split(","), lease_timeout_s=a.lease_timeout_s)
    cfg.secret = os.environ.get("TQ_SECRET", "")  # never on the command line (visible to every user in ps)
    svc = ControllerService(cfg, port=a.port)
    print(svc.address, flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        svc.close()


if __name__ == "__main__":
    main(sys.argv[1:])
