"""Actors that outlive their controller (`ray.detached`): their names, and the watch that ends them
when no controller comes back.

A detached run names every actor and placement group after the run (`queue.run_id`, kept in the run
directory, so a resumed controller finds them): `DetachedNames`. Each such actor holds an
`OrphanWatch`: every verb it runs touches it (`watched`), the controller touches it at least every
`ray.orphan_timeout_s / 4` (its keepalive), and an actor untouched for `ray.orphan_timeout_s` calls
its `on_orphan` (which frees what it holds and removes its placement group: Ray then ends every actor
in it), so GPUs held by a run whose controller is gone for good are given back.

Trace (orphan_timeout_s 300): the controller is SIGKILLed at t=0 -> nobody touches the actors ->
`asyncrl train ... resume=true` at t=40 finds them by name and touches them: they serve on; had no
controller come by t=300, each fleet's and the trainer's placement group would have been removed.
Boundary: no Ray import here (the shells pass `on_orphan`); plain threads, so a busy event loop or a
long training step does not starve the watch.
"""

from __future__ import annotations

import functools
import inspect
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

NAMESPACE = "asyncrl"
"""The Ray namespace of every detached actor and placement group."""


@dataclass(frozen=True)
class DetachedNames:
    """The Ray names of one run's actors and placement groups."""

    run_id: str

    @property
    def trainer_placement(self) -> str:
        return f"{self.run_id}/trainer"

    def rank(self, r: int) -> str:
        return f"{self.run_id}/trainer-{r}"

    def fleet_placement(self, fleet: str) -> str:
        return f"{self.run_id}/fleet-{fleet}"

    def server(self, fleet: str, index: int) -> str:
        return f"{self.run_id}/server-{fleet}-{index}"


@dataclass(frozen=True)
class Detached:
    """What an actor of a detached run is told: its name, its placement group's, and its watch's timeout."""

    name: str
    placement: str
    orphan_timeout_s: float


class OrphanWatch:
    """Calls `on_orphan` once when `touch` has not been called for `timeout_s` (see the module docstring).
    A verb in progress counts as a touch until it returns."""

    def __init__(self, timeout_s: float, on_orphan: Callable[[], None], poll_s: float | None = None) -> None:
        self.timeout_s, self.on_orphan = timeout_s, on_orphan
        self._last = time.monotonic()
        self._busy = 0
        self._lock = threading.Lock()
        self._poll = poll_s if poll_s is not None else min(5.0, timeout_s / 10)
        self.fired = False
        threading.Thread(target=self._run, name="orphan-watch", daemon=True).start()

    def touch(self, busy: int = 0) -> None:
        """The controller is there (`busy` +1 / -1: a verb begins / ends)."""
        with self._lock:
            self._last = time.monotonic()
            self._busy += busy

    def _run(self) -> None:
        while True:
            time.sleep(self._poll)
            with self._lock:
                idle = time.monotonic() - self._last if self._busy == 0 else 0.0
            if idle > self.timeout_s:
                self.fired = True
                self.on_orphan()
                return


def while_name_taken(create: Callable[[], Any], timeout_s: float = 30.0) -> Any:
    """`create()`, again while Ray still holds the name for the dead actor it replaces (Ray frees a dead
    named actor's name a moment after the death; `ValueError: ... already taken` until then)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return create()
        except ValueError as exc:
            if "already taken" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def watched(cls: type) -> type:
    """Wrap every public method of an actor class so that it touches `self.watch` (an `OrphanWatch`, or
    None when the run is not detached) while it runs; async methods stay async (Ray sees the same verbs)."""

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        if inspect.iscoroutinefunction(fn):
            @functools.wraps(fn)
            async def verb(self: Any, *args: Any, **kw: Any) -> Any:
                watch = getattr(self, "watch", None)
                if watch is None:
                    return await fn(self, *args, **kw)
                watch.touch(+1)
                try:
                    return await fn(self, *args, **kw)
                finally:
                    watch.touch(-1)
            return verb

        @functools.wraps(fn)
        def sync_verb(self: Any, *args: Any, **kw: Any) -> Any:
            watch = getattr(self, "watch", None)
            if watch is None:
                return fn(self, *args, **kw)
            watch.touch(+1)
            try:
                return fn(self, *args, **kw)
            finally:
                watch.touch(-1)
        return sync_verb

    for name, fn in list(vars(cls).items()):
        if not name.startswith("_") and inspect.isfunction(fn):
            setattr(cls, name, wrap(fn))
    return cls
