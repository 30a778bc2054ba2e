"""The memory controller as a ZeroMQ service, and the proxy clients use to reach it.

`ControllerService` owns a `MemoryController` and a ROUTER socket bound to
`bind_host`. The socket thread decodes each request and hands it to a worker pool
(`get` and `put` may block for their timeout); workers send replies back through an
inproc socket. A malformed, truncated or oversized request is rejected, counted
(`stats().rejected`) and answered with an error; it never reaches the controller.
`RemoteController` implements the same `MetadataStore` over that socket.

Wire: request `{"id": int, "op": str, "args": map}`, reply `{"id", "ok", "result" | "error", "kind"}`.

Start one in its own process with `python -m transfer_queue.service --port 5555
--storage shm` (prints its address), or in-process with `ControllerService(config)`.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import zmq

from transfer_queue.codec import WireError, expect_map, pack, unpack
from transfer_queue.config import TransferQueueConfig
from transfer_queue.metadata.base import GetRequest, MetadataStore
from transfer_queue.metadata.memory import MemoryController
from transfer_queue.records import Batch, QueueStats, SampleMeta
from transfer_queue.storage import make_storage

_ERRORS: dict[str, type[Exception]] = {"ValueError": ValueError, "KeyError": KeyError,
                                       "TimeoutError": TimeoutError, "WireError": WireError}


class ControllerService:
    """Example: `svc = ControllerService(TransferQueueConfig(storage="shm")); svc.address`."""

    def __init__(self, config: TransferQueueConfig, port: int = 0, workers: int = 64) -> None:
        self.config = config
        self.plane = make_storage(config)  # frees handles; for `zmq` it also hosts the storage unit
        self.controller = MemoryController(config.capacity, config.consumer_groups, config.lease_timeout_s,
                                           on_free=self.plane.free)
        self.rejected = 0
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        if port:
            self._sock.bind(f"tcp://{config.bind_host}:{port}")
        else:
            port = self._sock.bind_to_random_port(f"tcp://{config.bind_host}")
        self.address = f"tcp://{config.bind_host}:{port}"
        self._inproc = f"inproc://tq-replies-{id(self)}"
        self._replies = self._ctx.socket(zmq.PULL)
        self._replies.bind(self._inproc)
        self._local = threading.local()
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="tq-ctl")
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
                    if req["op"] not in self._ops:
                        raise WireError(f"unknown op {req['op']!r}")
                except WireError as e:
                    self.rejected += 1
                    self._sock.send_multipart([ident, pack({"id": -1, "ok": False, "error": str(e), "kind": "WireError"})])
                    continue
                self._pool.submit(self._run, ident, req)
        self._sock.close(0)
        self._replies.close(0)

    def _run(self, ident: bytes, req: dict) -> None:
        try:
            rep = {"id": req["id"], "ok": True, "result": self._ops[req["op"]](req["args"])}
        except Exception as e:  # translated into an error reply; the caller re-raises it
            if isinstance(e, (WireError, TypeError)):
                self.rejected += 1
            rep = {"id": req["id"], "ok": False, "error": str(e), "kind": type(e).__name__}
        out = self._local.__dict__.get("push")
        if out is None:
            out = self._local.push = self._ctx.socket(zmq.PUSH)
            out.connect(self._inproc)
        out.send_multipart([ident, pack(rep)])

    # ---- ops: arguments are checked here, before they reach the controller -----
    def _put(self, a: dict) -> None:
        expect_map(a, {"samples": list}, "put")
        self.controller.put([SampleMeta.from_wire(s) for s in a["samples"]], _timeout(a))

    def _update(self, a: dict) -> None:
        expect_map(a, {"uid": str, "handles": dict, "meta": dict, "seal": bool}, "update")
        SampleMeta.from_wire({"uid": a["uid"], "group_id": "-", "group_size": 1, "version": 0,
                              "meta": a["meta"], "handles": a["handles"], "sealed": True})
        self.controller.update(a["uid"], a["handles"], a["meta"], a["seal"])

    def _get(self, a: dict) -> dict:
        return self.controller.get(GetRequest.from_wire(a)).to_wire()

    def _ack(self, a: dict) -> int:
        expect_map(a, {"consumer": str, "uids": list}, "ack")
        return self.controller.ack(a["consumer"], _strs(a["uids"]))

    def _nack(self, a: dict) -> int:
        expect_map(a, {"consumer": str, "lease_id": str, "uids": list}, "nack")
        return self.controller.nack(a["consumer"], a["lease_id"], _strs(a["uids"]))

    def _drop(self, a: dict) -> int:
        expect_map(a, {"consumer": str, "uids": list, "cause": str}, "drop")
        return self.controller.drop(a["consumer"], _strs(a["uids"]), a["cause"])

    def _renew(self, a: dict) -> bool:
        expect_map(a, {"consumer": str, "lease_id": str, "uids": list}, "renew")
        return self.controller.renew(a["consumer"], a["lease_id"], _strs(a["uids"]))

    def _stats(self, a: dict) -> dict:
        s = self.controller.stats()
        s.rejected = self.rejected
        return s.to_wire()

    def _info(self, a: dict) -> dict:
        return {"storage": self.config.storage, "storage_address": self.plane.address(),
                "consumer_groups": self.config.consumer_groups, "capacity": self.config.capacity}

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.plane.close()


def _timeout(a: dict) -> float | None:
    t = a.get("timeout")
    if t is not None and (not isinstance(t, (int, float)) or isinstance(t, bool) or t < 0):
        raise WireError(f"timeout must be a number >= 0 or nil, got {t!r}")
    return t


def _strs(xs: list) -> list[str]:
    if not all(isinstance(x, str) for x in xs):
        raise WireError("uids must be strings")
    return xs


class RemoteController(MetadataStore):
    """`MetadataStore` over a `ControllerService`; one DEALER socket per calling thread."""

    def __init__(self, address: str, rpc_grace_s: float = 60.0) -> None:
        self.address = address
        self._ctx = zmq.Context()
        self._local = threading.local()
        self._socks: list[zmq.Socket] = []
        self._ids = itertools.count(1)
        self._grace_ms = int(rpc_grace_s * 1000)
        self.consumer_groups = self.call("info", {})["consumer_groups"]

    def call(self, op: str, args: dict[str, Any], timeout: float | None = 0.0) -> Any:
        sock = self._local.__dict__.get("sock")
        if sock is None:
            sock = self._local.sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(self.address)
            self._socks.append(sock)
        rid = next(self._ids)
        sock.send(pack({"id": rid, "op": op, "args": args}))
        wait = None if timeout is None else int(timeout * 1000) + self._grace_ms
        while True:
            if not sock.poll(wait):
                raise TimeoutError(f"controller {self.address} did not answer {op}")
            rep = unpack(sock.recv(), 1 << 30)
            if rep.get("id") in (rid, -1):
                break  # replies to calls that timed out earlier are skipped
        if not rep["ok"]:
            raise _ERRORS.get(rep.get("kind"), RuntimeError)(f"controller: {rep.get('error')}")
        return rep["result"]

    def put(self, samples: list[SampleMeta], timeout: float | None = None) -> None:
        self.call("put", {"samples": [s.to_wire() for s in samples], "timeout": timeout}, timeout)

    def update(self, uid: str, handles: dict, meta: dict | None = None, seal: bool = True) -> None:
        self.call("update", {"uid": uid, "handles": handles, "meta": meta or {}, "seal": seal})

    def get(self, req: GetRequest) -> Batch:
        return Batch.from_wire(self.call("get", req.to_wire(), req.timeout))

    def ack(self, consumer: str, uids: list[str]) -> int:
        return self.call("ack", {"consumer": consumer, "uids": uids})

    def nack(self, consumer: str, lease_id: str, uids: list[str]) -> int:
        return self.call("nack", {"consumer": consumer, "lease_id": lease_id, "uids": uids})

    def drop(self, consumer: str, uids: list[str], cause: str) -> int:
        return self.call("drop", {"consumer": consumer, "uids": uids, "cause": cause})

    def renew(self, consumer: str, lease_id: str, uids: list[str]) -> bool:
        return self.call("renew", {"consumer": consumer, "lease_id": lease_id, "uids": uids})

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
    svc = ControllerService(cfg, port=a.port)
    print(svc.address, flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        svc.close()


if __name__ == "__main__":
    main(sys.argv[1:])
