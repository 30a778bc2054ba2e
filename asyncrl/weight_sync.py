"""Publishing the trainer's weights to the rollout servers through the CheckpointEngine.

`WeightPublisher` owns the `Sender` (trainer side) and, for servers that live in this
process, one receiver thread per server that turns each update into
`server.update_weights(tensors, version)` on the pipeline's event loop (Ray server
actors run their own receiver, see `asyncrl.rollout.server_actor`). Around an update
the servers are paused in `rollout.update_mode`:
`keep` (in-flight requests continue afterwards under the new weights; their later tokens
carry the new version), `wait` (drain first) or `abort` (in-flight requests return and
are resubmitted with their partial tokens). A server that fails or stalls is evicted by
the CheckpointEngine and re-synced later; it never blocks the others.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any, Callable, Iterable

from checkpoint_engine import Receiver, Sender, UpdateAborted, WeightSyncConfig

from asyncrl.rollout.base import RolloutServer


class _LocalReceiver(threading.Thread):
    """Receives updates for one in-process server (its own ZeroMQ socket, used only by this
    thread) and loads them on the event loop."""

    def __init__(self, cfg: WeightSyncConfig, rid: str, endpoint: str, server: RolloutServer, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(name=f"weights-{rid}", daemon=True)
        self.cfg, self.rid, self.endpoint = cfg, rid, endpoint
        self.server, self.loop = server, loop
        self.error: BaseException | None = None
        self._halt = threading.Event()

    def run(self) -> None:
        rx = Receiver(self.cfg, self.rid, endpoint=self.endpoint)
        try:
            while not self._halt.is_set():
                try:
                    update = rx.next_update(timeout_s=0.2)
                except TimeoutError:
                    continue
                except UpdateAborted:
                    return
                try:
                    tensors = list(update)  # buckets land one by one; tensors are owned copies
                except UpdateAborted:
                    continue  # evicted from this update: the next publish re-syncs us
                fut = asyncio.run_coroutine_threadsafe(self.server.update_weights(tensors, update.version), self.loop)
                try:
                    fut.result()
                except BaseException as e:  # surfaced by WeightPublisher.check(): stops the run loudly
                    self.error = e
                    return
        finally:
            rx.close()

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=5)


class WeightPublisher:
    def __init__(self, cfg: WeightSyncConfig, servers: list[RolloutServer], *, update_mode: str) -> None:
        self.cfg, self.servers, self.update_mode = cfg, servers, update_mode
        self.sender = Sender(cfg)
        self._receivers: list[_LocalReceiver] = []
        self.last_seconds = 0.0
        self.last_time = 0.0
        self.evicted: dict[str, str] = {}

    @property
    def endpoint(self) -> str:
        return self.sender.endpoint

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        for i, server in enumerate(self.servers):
            r = _LocalReceiver(self.cfg, f"server-{i}", self.sender.endpoint, server, loop)
            r.start()
            self._receivers.append(r)
        self.sender.wait_for(len(self._receivers), timeout_s=self.cfg.timeout_s)

    def check(self) -> None:
        for r in self._receivers:
            if r.error is not None:
                raise RuntimeError(f"weight load failed on {r.rid}") from r.error

    async def publish(self, params: Callable[[], Iterable[tuple[str, Any]]], version: int) -> dict[str, float]:
        """Pause servers, broadcast `params()` as `version`, wait until every live server loaded it, resume."""
        t0 = time.time()
        await asyncio.gather(*(s.pause(self.update_mode) for s in self.servers))
        try:
            outcome = await asyncio.to_thread(lambda: self.sender.publish(params(), version))
            # receivers hand the last bucket to the engine after acking it: wait for the load itself
            while any(s.version < version for i, s in enumerate(self.servers) if f"server-{i}" in outcome.completed):
                self.check()
                await asyncio.sleep(0.002)
        finally:
            await asyncio.gather(*(s.resume() for s in self.servers))
        self.check()
        self.evicted.update(outcome.evicted)
        self.last_seconds, self.last_time = time.time() - t0, time.time()
        return {"weights/publish_s": self.last_seconds, "weights/gbps": outcome.gbps, "weights/evicted": len(outcome.evicted)}

    def close(self) -> None:
        for r in self._receivers:
            r.stop()
        self.sender.close()
