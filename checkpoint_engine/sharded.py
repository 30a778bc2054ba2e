"""A receiver of several senders: each trainer rank publishes its own shard of every tensor.

With FSDP each rank holds a contiguous slice (rows) of every parameter. Instead of gathering
the full tensors onto one rank, every rank runs its own `Sender` and publishes its slices as
pieces of the full tensors (`BucketPacker` items `(name, piece, full shape, byte offset)`);
a rollout server joins all of them and assembles the pieces into whole tensors. No
collective runs on the trainer, and the bytes leave every rank in parallel.

`ShardedReceiver` holds one `Receiver` per sender endpoint (same receiver id). Its
`next_update` waits for every sender to begin the same version and returns a `ShardedUpdate`,
which receives all of them at once (a thread per sender, one shared `TensorAssembler`) and
yields each tensor as soon as all its pieces landed; `confirm` / `refuse` answer every sender.
The per-sender protocol (acks, eviction, loaded) is the one of `receiver.py`, unchanged.

    rx = ShardedReceiver(cfg, "server-0", endpoints=[rank0.endpoint, rank1.endpoint], confirm_loads=True)
    update = rx.next_update()
    await server.update_weights(list(update), update.version); update.confirm()
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Iterator

import torch

from checkpoint_engine.buckets import TensorAssembler
from checkpoint_engine.config import WeightsConfig
from checkpoint_engine.receiver import Receiver, Update

_DONE = object()


class ShardedReceiver:
    def __init__(self, config: WeightsConfig, receiver_id: str, endpoints: list[str], version: int = -1,
                 *, confirm_loads: bool = False) -> None:
        if len(endpoints) < 1:
            raise ValueError("ShardedReceiver needs at least one sender endpoint")
        self.config, self.receiver_id, self.confirm_loads = config, receiver_id, confirm_loads
        self.receivers = [Receiver(config, receiver_id, e, version, confirm_loads=True) for e in endpoints]

    @property
    def version(self) -> int:
        return min(r.version for r in self.receivers)

    @property
    def transport(self) -> Any:
        """The first sender's transport (its kind is every sender's)."""
        return self.receivers[0].transport

    def next_update(self, timeout_s: float | None = None) -> "ShardedUpdate":
        """Wait (up to `timeout_s`) for the first sender to begin, then up to `timeout_s` of the
        config for the others: every rank publishes the same version at the same time."""
        first = self.receivers[0].next_update(timeout_s)
        rest = [r.next_update(self.config.timeout_s) for r in self.receivers[1:]]
        updates = [first, *rest]
        versions = {u.version for u in updates}
        if len(versions) != 1:
            for u in updates:
                u.refuse(f"senders began different versions {sorted(versions)}")
            raise RuntimeError(f"receiver {self.receiver_id}: senders began different versions {sorted(versions)}")
        return ShardedUpdate(self, updates)

    def leave(self) -> None:
        """Every sender's wait ends (`Receiver.leave`); safe from any thread."""
        for r in self.receivers:
            r.leave()

    def close(self) -> None:
        for r in self.receivers:
            r.close()


class ShardedUpdate:
    """One version from every sender; iterate it once, then `confirm()` (or `refuse(reason)`)."""

    def __init__(self, receiver: ShardedReceiver, updates: list[Update]) -> None:
        self.receiver, self.updates = receiver, updates
        self.version = updates[0].version
        self.complete = False
        self.buckets = self.bytes = 0
        self.destinations: dict[str, torch.Tensor] | None = None

    def into(self, destinations: dict[str, torch.Tensor]) -> "ShardedUpdate":
        """Land the assembled tensors in place (`Update.into`); call before iterating."""
        self.destinations = destinations
        return self

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        assembler = TensorAssembler(self.destinations)
        out: queue.Queue = queue.Queue()
        for u in self.updates:
            u.assembler = assembler

        def receive(u: Update) -> None:
            try:
                for item in u:
                    out.put(item)
                out.put(_DONE)
            except BaseException as e:  # handed to the consumer, which re-raises it
                out.put(e)

        threads = [threading.Thread(target=receive, args=(u,), name=f"weights-rx-{i}", daemon=True)
                   for i, u in enumerate(self.updates)]
        for t in threads:
            t.start()
        done = 0
        while done < len(threads):
            item = out.get()
            if item is _DONE:
                done += 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
        for t in threads:
            t.join()
        missing = assembler.incomplete()
        if missing:
            raise RuntimeError(f"sharded update of version {self.version} ended with incomplete tensors {missing[:5]}")
        self.buckets = sum(u.buckets for u in self.updates)
        self.bytes = sum(u.bytes for u in self.updates)
        self.complete = True
        if not self.receiver.confirm_loads:
            self.confirm()

    def confirm(self) -> None:
        if not self.complete:
            raise RuntimeError(f"sharded update of version {self.version}: confirm() before every piece landed")
        for u in self.updates:
            u.confirm()

    def refuse(self, reason: str) -> None:
        for u in self.updates:
            u.refuse(reason)
