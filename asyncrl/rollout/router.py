"""Router: picks a rollout server per request and is the `LLMClient` the agents call.

Job: one `generate` call in, exactly one `GenerateOutput` out (or one `call`: any verb of one
server, such as a whole sample its host runs), whatever happens to the servers meanwhile: a weight update that aborts the request (partial rollout, `partial.py`), a server
that dies (failover, `Failover`), a fleet added or drained. Servers are local `RolloutServer`s
or proxies of Ray actors (`remote_server.RemoteServer`): the router sees only the interface, and
learns that a server died from the `ServerDied` error a proxy raises.
Boundary: no Ray, no placement, no weights; the `FleetManager` (fleet.py) owns those, and hears
of a dead server through `on_dead` (it restarts the server and `add`s it back once synced).
In-flight counts are the router's own, so a choice needs no round trip to the servers, and it costs
O(log servers), not a scan (`_LoadOrder`): at 1,024 servers a scan was 63 us per sample.
"""

from __future__ import annotations

import asyncio
import dataclasses
import heapq
import itertools
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Iterable, TypeVar

from asyncrl.engines.base import GenerateOutput, RolloutServer, SamplingParams
from asyncrl.rollout.partial import PartialRollout

DEFAULT_FLEET = "main"
T = TypeVar("T")


class ServerDied(ConnectionError):
    """A rollout server's process is gone; raised by proxies (e.g. a killed Ray actor)."""


class NoServerError(RuntimeError):
    """No active server can take the request (all dead, draining, or none in that fleet)."""


@dataclass(eq=False)
class Slot:
    """A server as the router sees it."""

    server: RolloutServer
    fleet: str
    in_flight: int = 0
    state: str = "active"
    """`active` (takes requests), `draining` (finishes its own, takes none), `out` (removed)."""
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    """Set whenever `in_flight` is 0 (what a drain waits for)."""
    seq: int = 0
    """Its place in the order servers were added (ties in load go to the lowest)."""


class _LoadOrder:
    """The active slots of one fleet (or of all) by (in-flight, order added), for a least-loaded pick in
    O(log n): a heap of (in_flight, seq, slot) entries pushed whenever a slot's count changes, the stale ones
    (an old count, or a slot no longer active) dropped when they reach the top, and the heap rebuilt from
    the live slots when stale entries outnumber them 3 to 1 (so its size stays O(slots), amortised O(1) per
    change). What it picks is exactly what `min(active, key=in_flight)` over the slots in added order picks."""

    def __init__(self) -> None:
        self.heap: list[tuple[int, int, Slot]] = []
        self.slots: dict[int, Slot] = {}
        """seq -> slot, the members."""

    def add(self, slot: Slot) -> None:
        self.slots[slot.seq] = slot
        self.changed(slot)

    def discard(self, slot: Slot) -> None:
        self.slots.pop(slot.seq, None)
        self._bound()

    def changed(self, slot: Slot) -> None:
        heapq.heappush(self.heap, (slot.in_flight, slot.seq, slot))
        self._bound()

    def _bound(self) -> None:
        if len(self.heap) > 4 * len(self.slots) + 16:
            self.heap = [(s.in_flight, s.seq, s) for s in self.slots.values() if s.state == "active"]
            heapq.heapify(self.heap)

    def least(self) -> Slot | None:
        heap = self.heap
        while heap:
            count, seq, slot = heap[0]
            if slot.state == "active" and slot.in_flight == count and self.slots.get(seq) is slot:
                return slot
            heapq.heappop(heap)
        return None


class Failover:
    """The failover rule of one caller request: a `ServerDied` moves the request to another
    server, at most `max_failovers` times (a deliberate, bounded retry); the tokens of segments
    that finished before the death are kept, the lost segment is generated again.

    Trace (2 servers, max_failovers 2): r1 -> s0; s0's actor is killed -> r1's call raises
    ServerDied -> router takes s0 out (sessions on s0 forgotten, on_dead(s0) -> the fleet manager
    restarts it) -> r1 resubmitted to s1 -> r1 returns once. A third death for r1 raises.
    """

    def __init__(self, max_failovers: int) -> None:
        self.max_failovers = max_failovers
        self.moves = 0

    def retry_after(self, exc: ServerDied) -> None:
        """Count one move; raise (chained to the last death) when the bound is spent."""
        self.moves += 1
        if self.moves > self.max_failovers:
            raise ServerDied(f"request failed over {self.max_failovers} times; last: {exc}") from exc


class Router:
    """Routing policy: a request of a known session goes to the server that served that session
    before (its prefix cache holds the conversation) while that server is active; otherwise to
    the active server (of the requested fleet, if any) with the fewest requests in flight, ties
    to the one added first. An `abort`ed request (weight update) is resubmitted to the same server,
    which queues it until it resumes, with the tokens so far (`partial_rollouts`).

    Trace (2 servers): r1 -> s0 (0,0); r2 -> s1 (1,0); r1 ends; r3 -> s0 (0,1);
    session "a" first served by s1 -> its next turns go to s1 while it is active;
    s1 drained -> session "a" moves to the least-loaded active server.

        router = Router([s0, s1])
        out = await router.generate(prompt_ids, SamplingParams(max_tokens=64), session_id="a")
    """

    def __init__(self, servers: Iterable[RolloutServer] = (), *, fleet: str = DEFAULT_FLEET,
                 max_sessions: int = 100_000, max_failovers: int = 2, partial_rollouts: bool = True,
                 on_dead: Callable[[RolloutServer, ServerDied], None] | None = None) -> None:
        self._slots: list[Slot] = []
        self._order: dict[str | None, _LoadOrder] = {None: _LoadOrder()}
        """The least-loaded pick's order of every active slot (None) and of each fleet's."""
        self._seq = itertools.count()
        self._sessions: OrderedDict[str, Slot] = OrderedDict()
        self._max_sessions = max_sessions
        self.max_failovers = max_failovers
        self.partial_rollouts = partial_rollouts
        self.on_dead = on_dead
        self.failovers = 0
        """Requests moved off a dead server, since start."""
        self.resubmits = 0
        """Aborted segments resubmitted (partial rollouts), since start."""
        self._ids = itertools.count()
        self.live: dict[str, PartialRollout] = {}
        """Requests given a `request_id`, while they run: the segments they have so far."""
        self.server_wait_s = 0.0
        """With no active server but one coming (`server_coming(fleet)`: a restart in progress), how
        long a request waits for it before `NoServerError`; 0 raises at once. Set by the `FleetManager`."""
        self.server_coming: Callable[[str | None], bool] = lambda fleet: False
        self._added = asyncio.Event()
        for s in servers:
            self.add(s, fleet)

    # -- membership ------------------------------------------------------------------------

    @property
    def servers(self) -> list[RolloutServer]:
        """Active servers, in the order they were added."""
        return [s.server for s in self._slots if s.state == "active"]

    @property
    def in_flight(self) -> list[int]:
        """Router-side in-flight count of each active server (same order as `servers`)."""
        return [s.in_flight for s in self._slots if s.state == "active"]

    @property
    def fleets(self) -> list[str]:
        """The fleet of each active server (same order as `servers`)."""
        return [s.fleet for s in self._slots if s.state == "active"]

    def slots(self) -> list[Slot]:
        return list(self._slots)

    def add(self, server: RolloutServer, fleet: str = DEFAULT_FLEET) -> None:
        """Start sending requests to `server` (it must already hold the current weights)."""
        if any(s.server is server for s in self._slots):
            raise ValueError("router: server added twice")
        slot = Slot(server, fleet, seq=next(self._seq))
        slot.idle.set()
        self._slots.append(slot)
        self._order[None].add(slot)
        self._order.setdefault(fleet, _LoadOrder()).add(slot)
        self._added.set()

    async def drain(self, server: RolloutServer) -> None:
        """Send `server` no new request, wait until its requests have returned, forget it."""
        slot = self._slot(server)
        slot.state = "draining"
        await slot.idle.wait()
        if slot in self._slots:  # not when it died meanwhile: `take_out` forgot it already
            self._remove(slot)

    def remove(self, server: RolloutServer) -> None:
        """Stop routing to `server` at once (its calls in flight finish); no `on_dead`."""
        slot = next((s for s in self._slots if s.server is server), None)
        if slot is not None:
            self._remove(slot)

    def take_out(self, server: RolloutServer, cause: ServerDied) -> None:
        """Forget a dead server at once (its callers fail over) and tell `on_dead`, once."""
        slot = next((s for s in self._slots if s.server is server), None)
        if slot is None:
            return  # another request already reported this death
        self._remove(slot)
        if self.on_dead is not None:
            self.on_dead(server, cause)

    def _remove(self, slot: Slot) -> None:
        slot.state = "out"
        self._slots.remove(slot)
        self._order[None].discard(slot)
        self._order[slot.fleet].discard(slot)
        for sid in [k for k, v in self._sessions.items() if v is slot]:
            del self._sessions[sid]

    def _slot(self, server: RolloutServer) -> Slot:
        for s in self._slots:
            if s.server is server:
                return s
        raise KeyError("router: unknown server")

    # -- policy ----------------------------------------------------------------------------

    def pick(self, session_id: str | None = None, fleet: str | None = None) -> Slot:
        if session_id is not None:
            slot = self._sessions.get(session_id)
            if slot is not None and slot.state == "active" and fleet in (None, slot.fleet):
                self._sessions.move_to_end(session_id)
                return slot
        order = self._order.get(fleet)
        slot = order.least() if order is not None else None
        if slot is None:
            raise NoServerError(f"router: no active rollout server{'' if fleet is None else f' in fleet {fleet!r}'}")
        if session_id is not None:
            self._sessions[session_id] = slot
            self._sessions.move_to_end(session_id)
            if len(self._sessions) > self._max_sessions:
                self._sessions.popitem(last=False)
        return slot

    async def _pick(self, session_id: str | None, fleet: str | None) -> Slot:
        """`pick`, or, while every server is being restarted, wait up to `server_wait_s` for one."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.server_wait_s
        while True:
            try:
                return self.pick(session_id, fleet)
            except NoServerError:
                left = deadline - loop.time()
                if left <= 0 or not self.server_coming(fleet):
                    raise
                self._added.clear()
                try:
                    async with asyncio.timeout(left):
                        await self._added.wait()
                except asyncio.TimeoutError:
                    raise NoServerError(f"router: no active rollout server for {self.server_wait_s} s") from None

    def recheck(self) -> None:
        """Wake requests waiting for a server (`server_wait_s`): one may have come, or stopped coming."""
        self._added.set()

    def end_session(self, session_id: str) -> None:
        self._sessions.pop(session_id, None)

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams, session_id: str | None = None,
                       fleet: str | None = None, *, request_id: str | None = None,
                       prefix: GenerateOutput | None = None) -> GenerateOutput:
        """One whole response: segments cut by `abort` pauses are joined, dead servers failed over.

        `request_id`: the caller's name for the request; then segment k goes to its server as
        `<request_id>.<k>` and the request is in `live` while it runs (what a checkpoint reads,
        with the server's `live_requests`). `prefix`: tokens generated for this request before (a
        sample continued after a resume); it counts as the first segment."""
        acc = PartialRollout(prompt_ids, sampling, request_id=request_id or f"route-{next(self._ids)}")
        if prefix is not None and prefix.token_ids:
            acc.add(dataclasses.replace(prefix, finish_reason="abort"))
            if acc.done:  # the saved tokens spent the budget
                return acc.result()
        failover = Failover(self.max_failovers)
        slot = await self._pick(session_id, fleet)
        if request_id is not None:
            self.live[request_id] = acc
        try:
            while True:
                prompt, seg_sampling = acc.request()
                try:
                    out = await self._call(slot, prompt, seg_sampling, None if request_id is None else f"{request_id}.{acc.segments}")
                except ServerDied as exc:
                    self.take_out(slot.server, exc)
                    failover.retry_after(exc)
                    self.failovers += 1
                    slot = await self._pick(session_id, fleet)
                    continue
                if out.finish_reason == "abort" and not self.partial_rollouts:
                    return out
                acc.add(out)
                if acc.done:
                    return acc.result()
                self.resubmits += 1
                if slot.state != "active":  # drained or taken out meanwhile: move on
                    slot = await self._pick(session_id, fleet)
        finally:
            if request_id is not None:
                self.live.pop(request_id, None)

    async def call(self, verb: Callable[[RolloutServer], Awaitable[T]], session_id: str | None = None,
                   fleet: str | None = None) -> T:
        """`verb(server)` on the server the policy picks (e.g. a whole sample that the server's
        host runs); a `ServerDied` moves it to another server, as `generate` does. The work of
        the dead server is redone from the start."""
        failover = Failover(self.max_failovers)
        slot = await self._pick(session_id, fleet)
        while True:
            try:
                return await self._run(slot, verb(slot.server))
            except ServerDied as exc:
                self.take_out(slot.server, exc)
                failover.retry_after(exc)
                self.failovers += 1
                slot = await self._pick(session_id, fleet)

    async def call_once(self, verb: Callable[[RolloutServer], Awaitable[T]], requests: int, session_id: str | None = None,
                        fleet: str | None = None) -> T:
        """`verb(server)` on the server the policy picks, counted as `requests` in flight there (a group's
        samples in one call). No failover: a `ServerDied` takes the server out (`on_dead`), counts the
        `requests` as moved, and is raised with the dead server as its `server`; the caller moves the work
        (each sample alone, from that server's snapshots: `resume.run_group_moving`)."""
        slot = await self._pick(session_id, fleet)
        try:
            return await self._run(slot, verb(slot.server), requests)
        except ServerDied as exc:
            self.take_out(slot.server, exc)
            self.failovers += requests
            exc.server = slot.server  # type: ignore[attr-defined]
            raise

    async def _call(self, slot: Slot, prompt: list[int], sampling: SamplingParams, request_id: str | None = None) -> GenerateOutput:
        return await self._run(slot, slot.server.generate(prompt, sampling, request_id))

    async def _run(self, slot: Slot, work: Awaitable[T], requests: int = 1) -> T:
        self._count(slot, requests)
        slot.idle.clear()
        try:
            return await work
        finally:
            self._count(slot, -requests)
            if slot.in_flight == 0:
                slot.idle.set()

    def _count(self, slot: Slot, delta: int) -> None:
        """A request started (+1) or ended (-1) on `slot`: its count and its place in the pick's order."""
        slot.in_flight += delta
        if slot.state == "active":
            self._order[None].changed(slot)
            self._order[slot.fleet].changed(slot)
