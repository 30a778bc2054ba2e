"""`Receiver`: the rollout-server end of the weight plane.

A rollout server process builds one `Receiver`, which joins the sender over ZeroMQ, and
for every update hands the server an iterator of (name, tensor) that yields tensors as
their buckets land, so the engine loads early tensors while later buckets are still in
flight:

    rx = Receiver(cfg, "server-0", endpoint=sender_endpoint)
    update = rx.next_update()                                  # blocks until the sender begins
    await server.pause("keep")                                 # (`server_loop.apply_update`)
    await server.load_update(update)                           # load, drop KV, bump version
    await server.resume()

Yielded tensors are views of freshly allocated buffers the receiver never touches again.
A receiver built with `confirm_loads=True` tells the sender when its engine finished loading
(`update.confirm()`, or `update.refuse(reason)`: it stays at its old version and is re-synced);
otherwise the update counts as loaded when its last bucket landed. The sender's `publish`
returns only after these confirmations.
A transport that `consumes` buckets (an engine's workers receive and load the bytes
themselves, e.g. vLLM through its worker extension) yields no tensors: the update then only
drives it bucket by bucket.
`next_update` returns when the sender begins; iterating the update tells the sender the
receiver is ready, so pausing (e.g. draining) in between counts against `timeout_s` for the
ready message, not for a bucket. An update must be consumed to the end; a consumer that
stalls is evicted by the sender after `timeout_s`. A bucket whose checksum does not match is refused (the sender is told,
the iterator raises `ChecksumError`) and the receiver stays at its old version until the
next publish / sync re-sends everything.
A frame from the sender's socket that is not a valid record is counted (`malformed`) and
dropped; a liveness `Probe` (sent when this receiver re-joins after a timeout) is answered
whenever the receiver reads its socket.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from typing import Any, Iterator

import torch
import zmq

from checkpoint_engine.backends import make_receiver_transport
from checkpoint_engine.backends.base import ReceiverTransport
from checkpoint_engine.buckets import TensorAssembler, crc32
from checkpoint_engine.config import WeightsConfig
from checkpoint_engine.wire import (MAX_REASON, Abort, Ack, Begin, Bucket, End, Group, Join, Malformed, Nack, Pong, Probe,
                                    decode, encode)
from plane_common import curve, net

READY = -1
GROUP = -2
LOADED = -3


class ChecksumError(RuntimeError):
    """A bucket's bytes did not match its checksum; the update was refused."""


class UpdateAborted(RuntimeError):
    """The sender evicted this receiver from the update (timeout, checksum) or closed."""


class Receiver:
    delivered_bytes: int = 0
    """Bucket bytes landed by every receiver of this process: what a process that must never
    receive weights (the controller) checks."""

    def __init__(self, config: WeightsConfig, receiver_id: str, endpoint: str | None = None,
                 version: int = -1, *, transport: ReceiverTransport | None = None, confirm_loads: bool = False):
        self.config = config
        self.receiver_id = receiver_id
        self.version = version
        """Version of the weights last received in full (-1: none)."""
        self.transport = transport if transport is not None else make_receiver_transport(config)
        self.confirm_loads = confirm_loads
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.IDENTITY, receiver_id.encode())
        self._sock.setsockopt(zmq.LINGER, 0)
        curve.client(self._sock, config.secret, config.max_message_bytes)
        self.malformed = 0
        """Frames from the sender's socket that were not a valid record (dropped)."""
        self._sock.connect(endpoint or net.endpoint(net.resolve(config.host, "weights.host"), config.port))
        self._send(self._join())
        self._inbox: deque = deque()
        """Messages read ahead while looking for an Abort (see `_evicted`)."""
        self._rejoin = False
        """Set when the sender dropped us from an update; the next `next_update` joins again."""
        self._leaving = threading.Event()
        """Set by `leave` (any thread), which also writes to `_wake`: every wait on the sender ends at once."""
        self._wake = os.pipe()
        """(read, write) ends of a pipe every wait polls beside the socket: a wait has no timeout of its own to
        look at `_leaving` (an idle server's thread then never wakes; a 0.2 s look cost 1% of a core each)."""
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._poller.register(self._wake[0], zmq.POLLIN)

    def _join(self) -> Join:
        return Join(self.receiver_id, self.version, self.transport.width)

    def _send(self, msg) -> None:
        self._sock.send(encode(msg))

    def _read(self) -> object | None:
        """One frame off the socket as a record; a liveness probe is answered here and a malformed
        frame counted and dropped (both give None)."""
        try:
            msg = decode(self._sock.recv())
        except Malformed:
            self.malformed += 1
            return None
        if isinstance(msg, Probe):
            self._send(Pong(msg.nonce))
            return None
        return msg

    def leave(self) -> None:
        """Stop waiting on the sender (safe from any thread; the socket is left to the thread using it): a
        wait for an update, or for the next bucket of one in flight, raises `UpdateAborted` at once. For a
        server leaving this weight plane (it joins another: the trainer restarted), whose sender may have
        died mid-update (the bucket wait alone lasts `3 * timeout_s + 5` s)."""
        if not self._leaving.is_set():
            self._leaving.set()
            try:
                os.write(self._wake[1], b"x")
            except OSError:  # deliberate: closed already, nobody waits
                pass

    def _recv(self, timeout_s: float | None):
        if self._inbox:
            return self._inbox.popleft()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            if self._leaving.is_set():
                raise UpdateAborted(f"receiver {self.receiver_id}: left the weight plane")
            ms = None if deadline is None else max(0, int((deadline - time.monotonic()) * 1000))
            ready = dict(self._poller.poll(ms))
            if self._sock not in ready:
                if not ready and deadline is not None and time.monotonic() >= deadline:
                    raise TimeoutError(f"receiver {self.receiver_id}: no message from the sender in {timeout_s} s")
                continue  # woken by `leave`
            msg = self._read()
            if msg is not None:
                return msg

    def _evicted(self, update_id: int) -> bool:
        """Whether an Abort for `update_id` is already queued. Checked after reading a slot:
        once the sender evicted us it refills slots, so those bytes must not be used."""
        while self._sock.poll(0):
            msg = self._read()
            if msg is not None:
                self._inbox.append(msg)
        return any(isinstance(m, Abort) and m.update_id == update_id for m in self._inbox)

    def next_update(self, timeout_s: float | None = None, borrow: bool = False) -> "Update":
        """Block until the sender begins an update for this receiver; attach to its data plane.

        `borrow=True` (shm, nixl, local): tensors that fit a bucket are yielded as views of the
        transport's buffer, valid only until the iterator advances past their bucket; for
        engines that copy each tensor into their parameters as it comes (vLLM
        `load_weights`). It saves one copy and a fresh allocation per tensor."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        if self._rejoin:
            self._send(self._join())
            self._rejoin = False
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            msg = self._recv(left)
            if isinstance(msg, Begin):
                if msg.version < self.version:
                    raise RuntimeError(f"versions only grow: got {msg.version} after {self.version}")
                self.transport.attach(msg.info)
                return Update(self, msg.update_id, msg.version, borrow and self.transport.borrowed)
            if isinstance(msg, Abort) and msg.reason == "sender closed":
                raise UpdateAborted("sender closed")
            # anything else belongs to an update this receiver already left: drop it

    def receive(self, timeout_s: float | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """The next update as a plain (name, tensor) iterator; `self.version` is bumped at its end
        (and the load confirmed then, whatever `confirm_loads` says)."""
        update = self.next_update(timeout_s)
        yield from update
        update.confirm()

    def close(self) -> None:
        self._sock.close(0)
        self.transport.close()
        fds, self._wake = self._wake, (-1, -1)  # a late `leave` writes to no descriptor (call it before close)
        for fd in fds:
            try:
                os.close(fd)
            except OSError:  # deliberate: closed twice
                pass


class Update:
    """One update in progress; iterate it once to receive its tensors, then `confirm()` the load
    (receivers with `confirm_loads=True`; the others confirm at the end of the iteration)."""

    def __init__(self, receiver: Receiver, update_id: int, version: int, borrow: bool = False):
        self.receiver = receiver
        self.borrow = borrow
        self.assembler: TensorAssembler | None = None
        """Shared with the updates of the other senders of a sharded publish (`sharded.py`); each
        sender then sends pieces, and completeness is judged over all of them."""
        self.destinations: dict[str, torch.Tensor] | None = None
        """Where tensors land in place (`into`)."""
        self.update_id = update_id
        self.version = version
        self.buckets = 0
        self.bytes = 0
        self.complete = False
        """Every bucket landed (the iteration reached the sender's End)."""
        self._answered = False

    def into(self, destinations: dict[str, torch.Tensor]) -> "Update":
        """Land tensors straight in `destinations[name]` (an engine's parameters, while it is paused)
        when dtype and shape match: one copy out of the bucket, no allocation; call before iterating."""
        self.destinations = destinations
        return self

    def confirm(self) -> None:
        """Tell the sender the engine now serves this version (after the whole update landed)."""
        if not self.complete:
            raise RuntimeError(f"update {self.update_id}: confirm() before every bucket landed")
        if not self._answered:
            self._answered = True
            self.receiver._send(Ack(self.update_id, LOADED))

    def refuse(self, reason: str) -> None:
        """Tell the sender the engine could not load this update; it stays at its old version,
        is evicted from the update and re-joins at the next `next_update` (then re-synced)."""
        rx = self.receiver
        if not self._answered:
            self._answered = True
            rx._send(Nack(self.update_id, LOADED, reason[:MAX_REASON]))
        rx._rejoin = True
        if self.complete:
            rx.version = self._before

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        rx, uid = self.receiver, self.update_id
        transport = rx.transport
        assembler = self.assembler or TensorAssembler(self.destinations)
        landed: set[int] = set()
        timeout = rx.config.timeout_s * 3 + 5.0
        self._before = rx.version
        rx._rejoin = True  # cleared only by a complete update: any failure below re-joins
        rx._send(Ack(uid, READY))  # ready only now: the server may pause (drain) in between
        transport.begin_update(self.version)
        while True:
            msg = rx._recv(timeout)
            if getattr(msg, "update_id", uid) != uid:
                continue
            if isinstance(msg, Group):
                try:
                    transport.form_group(msg.epoch, msg.rank, msg.world_size)
                except RuntimeError:  # translated: the sender retries with who answers
                    rx._send(Nack(uid, GROUP, "transport"))
            elif isinstance(msg, Bucket):
                meta = msg.meta
                try:
                    if transport.consumes:  # the engine's workers receive, check and load it themselves
                        if not transport.consume(meta):
                            rx._send(Nack(uid, meta.index, "checksum"))
                            raise ChecksumError(f"receiver {rx.receiver_id}: bucket {meta.index} of version "
                                                f"{self.version} failed its checksum in the engine; update refused")
                    else:
                        buf = transport.recv(meta)
                except RuntimeError as e:  # translated: a group member died; await a new group
                    if isinstance(e, ChecksumError):
                        raise
                    rx._send(Nack(uid, meta.index, "transport"))
                    continue
                if meta.index in landed:  # re-sent after a regroup; already loaded
                    rx._send(Ack(uid, meta.index))
                    continue
                if transport.consumes:
                    if rx._evicted(uid):
                        continue  # the Abort is next in the inbox
                    self._landed(meta, landed)
                    rx._send(Ack(uid, meta.index))
                    continue
                if transport.borrowed and rx._evicted(uid):
                    continue  # the Abort is next in the inbox
                if meta.checksum is not None and crc32(buf) != meta.checksum:
                    if transport.borrowed and rx._evicted(uid):
                        continue  # the slot was refilled after our eviction: not corruption
                    rx._send(Nack(uid, meta.index, "checksum"))
                    raise ChecksumError(
                        f"receiver {rx.receiver_id}: bucket {meta.index} of version {self.version} "
                        "failed its checksum; update refused")
                tensors = assembler.add(meta, buf, transport.borrowed and not self.borrow)
                if transport.borrowed and rx._evicted(uid):
                    continue  # the Abort is next in the inbox
                self._landed(meta, landed)
                if self.borrow:  # the consumer reads the slot itself; ack once it moved on
                    yield from tensors
                transport.release(meta)
                rx._send(Ack(uid, meta.index))  # the sender may now refill the slot
                if not self.borrow:
                    yield from tensors
            elif isinstance(msg, End):
                missing = [] if self.assembler is not None else assembler.incomplete()
                if missing:
                    raise RuntimeError(f"update {uid} ended with incomplete tensors {missing[:5]}")
                transport.end_update()
                rx.version = msg.version
                rx._rejoin = False
                self.complete = True
                if not rx.confirm_loads:
                    self.confirm()
                return
            elif isinstance(msg, Abort):
                raise UpdateAborted(f"receiver {rx.receiver_id} left update {uid}: {msg.reason}")

    def _landed(self, meta, landed: set[int]) -> None:
        landed.add(meta.index)
        self.buckets += 1
        self.bytes += meta.nbytes
        Receiver.delivered_bytes += meta.nbytes


def land_into(update: "Update | Any", dest: dict[str, torch.Tensor], *, strict: bool = True,
              cast_from: torch.dtype | None = None) -> int:
    """Receive `update` into `dest` (name -> tensor): in place where dtype and shape match, copied
    otherwise; returns the number of tensors. `strict`: a name `dest` lacks raises KeyError, a
    shape or dtype it does not match ValueError; else an unknown name is added to `dest` (an
    engine that allocates on first sight). Tensors landed before an error stay landed.

    `cast_from`: an engine configured in another float dtype than its sender (a bfloat16 rollout
    engine, a float32 trainer) names the sender's dtype here; a tensor of that dtype is then cast
    into its floating destination as it is copied (the publish sends the trainer's dtype and every
    receiver casts: a sender that cast once before sending would move fewer bytes). Any other dtype
    mismatch, a cast into a non-float destination and every shape mismatch are still refused."""
    n = 0
    for name, t in update.into(dest):
        d = dest.get(name)
        if d is None:
            if strict:
                raise KeyError(f"update: model has no parameter {name!r} (names look like: {', '.join(list(dest)[:4])}, ...)")
            dest[name] = t
        elif t is not d:
            castable = t.dtype == cast_from and t.dtype.is_floating_point and d.dtype.is_floating_point
            if t.shape != d.shape or (t.dtype != d.dtype and not castable):
                raise ValueError(f"update: {name} is {t.dtype} {tuple(t.shape)}, the model's is {d.dtype} {tuple(d.shape)}")
            d.copy_(t)
        n += 1
    return n
