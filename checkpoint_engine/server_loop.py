"""The update protocol on a rollout server: pause, load while buckets land, resume.

The engine itself (any object with async `pause(mode)`, `update_weights(pairs, version)`
and `resume()`, i.e. asyncrl's `RolloutServer`) drops its KV / prefix cache and bumps the
version it stamps on tokens inside `update_weights`; this module only orders the calls
around one `Update`. Duck-typed on purpose: checkpoint_engine does not import asyncrl.

Pause modes (the engine implements them): `abort` (in-flight requests return what they
have, the caller resubmits), `wait` (drain first), `keep` (in-flight requests continue
under the new weights, tokens tagged with their version).

The update's iterator blocks on the network; it is consumed on the event loop thread, so
the loop is busy while bytes land (the server is paused then anyway, except under `keep`,
whose requests continue on the engine thread and are delivered after the load).
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

from checkpoint_engine.receiver import ChecksumError, Receiver, Update, UpdateAborted


class Updatable(Protocol):
    async def pause(self, mode: str = "wait") -> None: ...
    async def update_weights(self, named_tensors: Any, version: int) -> None: ...
    async def resume(self) -> None: ...


async def apply_update(server: Updatable, update: Update, pause_mode: str = "keep") -> int:
    """pause(mode) -> update_weights(streamed pairs, version) -> resume; returns the version.
    The server resumes even when the update fails (it keeps serving its old version)."""
    await server.pause(pause_mode)
    try:
        await server.update_weights(update, update.version)
    finally:
        await server.resume()
    return update.version


async def serve_updates(server: Updatable, receiver: Receiver, pause_mode: str = "keep",
                        stop: asyncio.Event | None = None, poll_s: float = 1.0) -> None:
    """Apply every update the sender publishes until `stop` is set (or forever). A refused
    (checksum) or aborted update is skipped: the sender reported it and re-syncs later."""
    while stop is None or not stop.is_set():
        try:
            update = await asyncio.to_thread(receiver.next_update, poll_s)
        except TimeoutError:  # deliberate: wake up to look at `stop`
            continue
        try:
            await apply_update(server, update, pause_mode)
        except (ChecksumError, UpdateAborted):  # deliberate: already reported to the sender
            continue
