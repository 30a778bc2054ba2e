"""The fleet manager's shared state: what its parts read and write, and how they look servers up.

Job: `FleetState` holds the server set, the version every routed server holds, the weight source, the
lock and the books the `FleetManager`'s parts share, each documented once, in `__init__`; the lookups
every part uses (`_member`, `_fleet_of`, `size`, `_event`); `WeightSource`, what servers get weights
from; and two small helpers for proxies (`startup_detail`, `note_loaded`).
The parts are mixins on this one state (`fleet_weights.FleetWeights`, `fleet_members.FleetMembership`,
`fleet_health.FleetHealth`; `fleet.FleetManager` combines them), not objects the manager owns, because
they call each other both ways and all move servers in and out of one routing under one lock: a missed
publish is re-synced in the background and restarted if that fails, a restart joins and syncs, a death
during a shrink closes a member, a join that dies is a death. Parts with state of their own would each
hold the other two and the manager's state would be handed to all of them anyway. The verbs one part
asks of another are declared below (under `TYPE_CHECKING`), so those dependencies are written down in
one place.
Boundary: state and lookups only; no policy (that is the parts').
"""

from __future__ import annotations

import asyncio
import weakref
from typing import TYPE_CHECKING, Any, Awaitable, Protocol, TypeVar

from asyncrl.engines.base import PauseMode, RolloutServer
from asyncrl.rollout.fleet_build import Fleet
from asyncrl.rollout.fleet_log import FleetLog
from asyncrl.rollout.parity import ParityCheck
from asyncrl.rollout.router import Router

if TYPE_CHECKING:
    from asyncrl.rollout.router import ServerDied


class WeightSource(Protocol):
    """Where servers get weights: the trainer's weight plane (`AsyncTrainer`, `asyncrl/trainer/calls.py`), or a test double."""

    endpoints: list[str]
    """The senders servers join: one, or one per trainer rank (sharded publish)."""

    async def publish(self, version: int, receivers: list[str], probe: list[int] | None = None) -> dict[str, Any]:
        """`probe`: also return, as `"probe"`, the log-probs of `probe[1:]` under the weights just sent
        (None from a source without a model): the parity probe's reference. Either that list, scored in the
        call, or a future of (the list, seconds the forward took), scored after it while the source keeps
        any step from changing the weights (`trainer.calls.AsyncTrainer.publish`)."""
        ...

    async def sync(self, receivers: list[str], resend: bool = False, probe: list[int] | None = None) -> dict[str, Any]: ...


T = TypeVar("T")
SERVER_WAIT_S = 600.0
"""How long a request waits for a server while every server is being restarted (placement, model load, sync)."""


def server_name(server: RolloutServer) -> str:
    return str(getattr(server, "name", id(server)))


def startup_detail(server: RolloutServer) -> dict[str, Any]:
    """A started server's `startup` split (`remote_server.startup_split`) for its fleet event; none for
    a server in this process."""
    split = getattr(server, "startup", None)
    return {"startup": split} if split else {}


def note_loaded(server: RolloutServer, version: int) -> None:
    """Record on a proxy that its server now holds `version` (a local server knows it itself)."""
    hook = getattr(server, "loaded", None)
    if hook is not None:
        hook(version)


class FleetState:
    """The state every part of the `FleetManager` shares (see the module docstring); not used alone."""

    def __init__(self, router: Router | None = None, *, restart_dead: bool = True) -> None:
        self.router = router if router is not None else Router()
        self.router.on_dead = self._on_dead
        self._restarting: dict[str, int] = {}
        """Restarts and re-syncs in progress per fleet name: servers that will take requests again."""
        self._returning: set[RolloutServer] = set()
        """The servers those restarts and re-syncs are about (the dead one, then its replacement)."""
        self._join_began: dict[RolloutServer, float] = {}
        """Pending joiners: when their join began (their `join` event's `seconds`)."""
        self._draining: dict[RolloutServer, str] = {}
        """Servers a shrink took away, while they drain, with their fleet (a death then is a preemption, not replaced)."""
        self._joined: dict[RolloutServer, Any] = {}
        """The weight source each server last joined (a restarted trainer is a new source)."""
        if restart_dead:  # while every server restarts, requests wait for one
            self.router.server_wait_s = SERVER_WAIT_S
            self.router.server_coming = self._coming
        self.fleets: dict[str, Fleet] = {}
        self.version = -1
        """The version every server that takes requests holds (-1: nothing published yet)."""
        self.restart_dead = restart_dead
        self.restarts = 0
        self.resyncs = 0
        self.probe_failures = 0
        """Servers found dead or hung by `watch` (not by a request or a publish)."""
        self._weights: WeightSource | None = None
        self._weights_cfg: Any = None
        self._pause_mode: PauseMode = "keep"
        self._tasks: set[asyncio.Task] = set()
        self._membership = asyncio.Lock()
        """Held by a publish, and by a server's sync-then-route: a server is routed only at the version every routed server holds."""
        self._error: BaseException | None = None
        self.last_publish_time = 0.0
        self.last_publish_s = 0.0
        self.evicted: dict[str, str] = {}
        """Servers left out of a publish, and why (cumulative)."""
        self._silent: weakref.WeakSet[RolloutServer] = weakref.WeakSet()
        """Servers not worth asking anything (`answering`): dead or hung ones being replaced, and those the
        weight plane heard nothing from until their probe answers."""
        self.parity: ParityCheck | None = None
        """The weight-parity rule (`attach_weights`); None: no probe."""
        self.targets: dict[str, int] = {}
        """Each fleet's size as last asked (`resize`); a server that dies while its fleet is above it is not replaced."""
        self._pending: list[RolloutServer] = []
        """Joiners no peer could give the current weights: the next publish includes them, then they are routed."""
        self.changes = FleetLog()
        """Joins, drains, preemptions and restarts; sizes over time; joins by source (`events`, `history`, `joins`)."""
        self.events, self.history, self.joins = self.changes.events, self.changes.history, self.changes.joins
        self._resizing = asyncio.Lock()
        self._restarts_of: dict[tuple[str, int], asyncio.Task] = {}
        """Dead servers being replaced, and the task that does it (a shrink cancels it: `resize`)."""
        self.capacity: Any = None
        """`rollout.follow_cluster`: () -> {fleet: servers the cluster has room for now}; a server that dies
        while its fleet is above that is a preemption (its node is gone), not restarted."""
        self.autoscale: dict[str, Any] | None = None
        """`rollout.autoscale`'s latest verdict on `main` (set by the controller; `asyncrl status`)."""

    def _member(self, server: RolloutServer) -> bool:
        return any(s is server for f in self.fleets.values() for s in f.servers)

    def _fleet_of(self, server: RolloutServer) -> Fleet:
        return next(f for f in self.fleets.values() if server in f.servers)

    def _event(self, kind: str, server: RolloutServer | None = None, fleet: str = "", **detail: Any) -> None:
        if server is not None and self._member(server):
            fleet = self._fleet_of(server).name
        self.changes.record(kind, server_name(server) if server is not None else "", fleet, self.size(), **detail)

    def size(self) -> dict[str, int]:
        """Routed servers per fleet (what serves requests now)."""
        out = {name: 0 for name in self.fleets}
        for name in self.fleets:
            out[name] = sum(1 for s in self.fleets[name].servers if s in self.router.servers)
        return out

    if TYPE_CHECKING:  # what one part asks of another
        # fleet_weights
        async def _join(self, server: RolloutServer) -> None: ...
        async def _bring_current(self, server: RolloutServer) -> None: ...
        # fleet_members
        async def _close_one(self, fleet: Fleet, server: RolloutServer, index: int) -> None: ...
        # fleet_health
        def _coming(self, fleet: str | None) -> bool: ...
        def _check(self) -> None: ...
        def _on_dead(self, server: RolloutServer, cause: ServerDied) -> None: ...
        def _background(self, work: Awaitable[Any]) -> asyncio.Task: ...
        def _counted(self, server: RolloutServer, work: Awaitable[T]) -> Awaitable[T]: ...
        async def restart(self, server: RolloutServer) -> RolloutServer: ...
