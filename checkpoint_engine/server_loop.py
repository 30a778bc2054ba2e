"""The update protocol on a rollout server: pause, load while buckets land, confirm, resume.

The engine (an `Updatable`: async `pause(mode)`, `load_update(update)`, `resume()` and the flag
`loads_in_place`; asyncrl's `RolloutServer` declares them all, with defaults) loads the update,
drops its KV / prefix cache and bumps the version it stamps on tokens inside `load_update`; this
module only orders the calls around one `Update`. How an update is loaded (streamed into the
parameters, read whole, received by the engine's own workers through a consuming transport) is the
engine's one decision, made in its `load_update`. A `Protocol`, structural on purpose:
checkpoint_engine does not import asyncrl (docs/layers.md, layer 0).

Pause modes (the engine implements them): `abort` (in-flight requests return what they
have, the caller resubmits), `wait` (drain first), `keep` (in-flight requests continue
under the new weights, tokens tagged with their version).

The load is confirmed to the sender (`Update.confirm`) only after the engine finished it,
so the sender's `publish` returns when every live server serves the new version. A load
that fails is refused (`Update.refuse`): the sender evicts this receiver from the update and
re-syncs it later. An engine whose failed load leaves its weights half replaced
(`loads_in_place = True`, e.g. vLLM's layer-wise reload) stays paused until an update
succeeds; the others keep serving their old version.

The update's iterator blocks on the network; it is consumed on the event loop thread, so
the loop is busy while bytes land (the server is paused then anyway, except under `keep`,
whose requests continue on the engine thread and are delivered after the load). Waiting for the
next update blocks too. Both run on one thread of the server's own (`serve_updates`; an engine's
`load_update` reads through `blocking`), never on asyncio's shared default executor (min(32, cores + 4)
threads): with a poll and a load per server there, 16 embedded servers of one process held every thread
of it, a publish to all of them could not finish (every receiver takes each bucket), and record writes and
queue calls waited behind them.
"""

from __future__ import annotations

import asyncio
import contextvars
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import Any, Protocol

from checkpoint_engine.receiver import ChecksumError, Receiver, Update, UpdateAborted


_WEIGHTS_THREAD: contextvars.ContextVar[Executor | None] = contextvars.ContextVar("weights_thread", default=None)


async def blocking(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """`fn(*args, **kwargs)`, a blocking read of an update's buckets (`list(update)`, `land_into(update, ...)`), off the
    event loop: on the weights thread of the `serve_updates` that is loading it, else asyncio's default
    executor (a load called directly, as tests do)."""
    return await asyncio.get_running_loop().run_in_executor(_WEIGHTS_THREAD.get(), lambda: fn(*args, **kwargs))


class Updatable(Protocol):
    """What a server offers the weight plane (asyncrl's `RolloutServer` and `ServerHost` are such)."""

    loads_in_place: bool
    """A load that fails midway leaves the weights half replaced: stay paused until one succeeds."""

    async def pause(self, mode: str = "wait") -> None: ...

    async def load_update(self, update: Update) -> None:
        """Load every (name, tensor) pair of `update` as it lands and serve `update.version` from now on."""

    async def resume(self) -> None: ...


async def apply_update(server: Updatable, update: Update, pause_mode: str = "keep") -> int:
    """pause(mode) -> load (streamed) -> confirm -> resume; returns the version. On failure the
    update is refused and the error raised; the server resumes on its old weights unless a
    failed load leaves it half replaced (`loads_in_place`), then it stays paused."""
    await server.pause(pause_mode)
    resume = True
    try:
        await server.load_update(update)
        update.confirm()
    except BaseException as e:
        update.refuse(f"load: {type(e).__name__}: {e}"[:200])
        resume = not server.loads_in_place
        raise
    finally:
        if resume:
            await server.resume()
    return update.version


async def serve_updates(server: Updatable, receiver: Receiver, pause_mode: str = "keep",
                        stop: asyncio.Event | None = None, on_error: Any = None) -> None:
    """Apply every update the sender publishes until `stop` is set (or forever). A refused
    (checksum), aborted or failed update is skipped: the sender was told and re-syncs later;
    `on_error(exc)` (if given) hears of each failure. The wait for an update, and the engine's reads of it
    (`blocking`), run on one thread of this loop's own. `stop` makes the receiver leave (`Receiver.leave`):
    whatever that thread waits for ends at once. The wait itself has no timeout, so an idle server costs
    its event loop nothing (a wait of 0.2 s woke the loop 5 times a second per server: 1,280
    wake-ups a second for 256 embedded servers in one controller)."""
    loop = asyncio.get_running_loop()
    poller = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weights")
    _WEIGHTS_THREAD.set(poller)  # this task's context: the loads it awaits read on the same thread (`blocking`)
    leaving = None if stop is None else loop.create_task(_leave_on(stop, receiver))
    try:
        while stop is None or not stop.is_set():
            try:
                update = await loop.run_in_executor(poller, receiver.next_update, None)
            except UpdateAborted:  # the sender closed, or `stop`: the receiver left
                return
            try:
                await apply_update(server, update, pause_mode)
            except (ChecksumError, UpdateAborted, RuntimeError, ValueError, KeyError) as e:  # reported to the sender
                if on_error is not None and not (stop is not None and stop.is_set() and isinstance(e, UpdateAborted)):
                    on_error(e)  # (an update left on purpose, `Receiver.leave`, is no failure)
                continue
    finally:
        if leaving is not None:
            leaving.cancel()
        poller.shutdown(wait=False, cancel_futures=True)


async def _leave_on(stop: asyncio.Event, receiver: Receiver) -> None:
    await stop.wait()
    receiver.leave()
