"""The run state the controller publishes for observers: typed, read-only, one moment at a time.

Job: say in one place which figures of a running pipeline an observer (`asyncrl.observe`:
status snapshots, the reporter) may read, and read them from the live `Pipeline` here, on the
controller's side. `RunInfo` is fixed for the run; `RunState` is a frozen copy of the
counters at one instant (its mappings are copies behind read-only proxies: a reader can
neither change the pipeline through it nor see it move); the queue's and the fleets' own
accounting come from their `stats()` verbs, asked through the same source.

Boundary: observers get a `RunSource` and never the pipeline, so nothing in `observe/`
can change a run or depend on an attribute name of the controller; this module only reads.

    source = PipelineSource(pipeline)      # what `Pipeline.run` hands the `StatusReporter`
    s = source.state()                      # RunState(step=3, version=3, ...)
    stats = await source.queue_stats()      # the queue's QueueStats at this instant
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Protocol

from transfer_queue.records import QueueStats

if TYPE_CHECKING:
    from asyncrl.controller import Pipeline


@dataclass(frozen=True)
class RunInfo:
    """What does not change while the run goes on."""

    name: str
    """The run directory's name: the run's name in `asyncrl status` and in Redis keys."""
    dir: Path
    mode: str
    """`trainer.mode`."""
    total_steps: int
    eta: int
    """The staleness bound of the mode (`trainer.max_staleness` in `fully_async`)."""
    publish_every: int
    queue_backend: str
    """`queue.metadata`: `memory` or `redis`."""
    redis_url: str
    """`queue.redis_url` (used when `queue_backend` is `redis`)."""
    consumer: str
    """The trainer's consumer name in the queue (its figures in `QueueStats` are keyed by it)."""


@dataclass(frozen=True)
class RunState:
    """The pipeline's own counters at one instant."""

    step: int
    version: int
    """The version the servers were last asked to load (the trainer step at that publish)."""
    trained_samples: int
    trained_tokens: int
    staleness_hist: Mapping[int, int]
    """Staleness of every trained sample so far (cumulative, resumed segments included)."""
    wait_s: float
    """Seconds the trainer waited for batches in this segment of the run."""
    segment_start: float
    """Wall time this segment of the run started (a resumed run starts a new segment)."""
    running_groups: int
    accepted_groups: int
    admission_limit: int
    admission: str
    """`pace` (a paced `fully_async` run) or `bound` (the eta bound alone)."""
    drops: Mapping[str, int]
    """Groups dropped, by cause (the staleness manager's count)."""
    generated_tokens: int
    reward_failures: int
    rollout_idle_s: float
    last_publish_time: float | None
    last_publish_s: float
    evicted: Mapping[str, str]
    """Servers taken out of routing for a missed publish (or a failed parity check): name -> the
    last reason (`timeout`, `checksum`, `not joined`, `parity`, ...)."""
    parity_max_abs: float | None = None
    """The largest gap on the weight-parity probe at the servers' last checks (None: never checked)."""
    parity_tol: float | None = None
    """`weights.parity_tol` as applied (None: the probe is off)."""
    lengths: Mapping[str, Mapping[str, Any]] = field(default_factory=lambda: MappingProxyType({}))
    """Response lengths by fate (`asyncrl.lengths.LengthBias.summary`): trained, dropped_stale, ..."""
    data_plane: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    """The back-pressure of the controller's data plane (`StoragePlane.backpressure`): its arena's waits
    (the embedded default's servers write there) and `undelivered_frees`, the frees it sent that a
    producer did not get (rows {endpoint, producer, frees})."""
    mismatch: Mapping[str, float] = field(default_factory=lambda: MappingProxyType({}))
    """The latest trainer step's `mismatch/*` metrics (`asyncrl/trainer/mismatch.py`) keyed without the prefix, and
    `step`, the step they are of; empty before the first step."""


class RunSource(Protocol):
    """What an observer may ask of a run."""

    @property
    def info(self) -> RunInfo: ...

    def state(self) -> RunState: ...

    async def queue_stats(self) -> QueueStats: ...

    async def fleet_stats(self) -> dict[str, dict[str, Any]]:
        """Per fleet: its servers (name, version, in_flight, tokens_per_s, generated_tokens,
        healthy, paused, arena_waits, arena_wait_s, arena_waiting) and totals (healthy, in_flight, tokens_per_s)."""
        ...


def _frozen(m: Mapping[Any, Any]) -> Mapping[Any, int]:
    """A read-only copy of a count mapping."""
    return MappingProxyType({k: int(v) for k, v in m.items()})


def _frozen_text(m: Mapping[str, Any]) -> Mapping[str, str]:
    """A read-only copy of a name -> reason mapping."""
    return MappingProxyType({str(k): str(v) for k, v in m.items()})


def _frozen_plane(bp: Mapping[str, Any]) -> Mapping[str, Any]:
    """A read-only copy of a plane's `backpressure()`."""
    rows = tuple(MappingProxyType(dict(r)) for r in bp.get("undelivered_frees", ()))
    return MappingProxyType({**bp, "undelivered_frees": rows})


class PipelineSource:
    """A `RunSource` over a live `Pipeline` (the only reader of its attributes for observers)."""

    def __init__(self, pipeline: Pipeline) -> None:
        p = self._p = pipeline
        self.info = RunInfo(
            name=p.run_dir.name, dir=p.run_dir.resolve(), mode=p.cfg.trainer.mode, total_steps=p.cfg.trainer.total_steps,
            eta=p.staleness.eta, publish_every=p.publish_every, queue_backend=p.cfg.queue.metadata,
            redis_url=p.cfg.queue.redis_url, consumer=p.queue.consumer,
        )

    def state(self) -> RunState:
        p = self._p
        s, fleets, roll = p.staleness, p.parts.fleets, p.rollouter
        return RunState(
            step=p.step, version=s.version, trained_samples=p.trained_samples, trained_tokens=p.trained_tokens,
            staleness_hist=_frozen(p.staleness_hist), wait_s=p.wait_s, segment_start=p.t_start,
            running_groups=s.running, accepted_groups=s.accepted, admission_limit=s.admission_limit(),
            admission="pace" if s.pace is not None else "bound", drops=_frozen(s.dropped),
            generated_tokens=roll.generated_tokens, reward_failures=roll.reward_failures,
            rollout_idle_s=roll.idle_seconds(), last_publish_time=fleets.last_publish_time or None,
            last_publish_s=fleets.last_publish_s, evicted=_frozen_text(fleets.evicted),
            parity_max_abs=p.parity.max_gap() if p.parity is not None and p.parity.gaps else None,
            parity_tol=p.parity.tol if p.parity is not None else None,
            lengths=MappingProxyType({k: MappingProxyType(v) for k, v in p.lengths.summary().items()}),
            data_plane=_frozen_plane(p.queue.storage.backpressure()),
            mismatch=MappingProxyType(dict(p.mismatch)),
        )

    async def queue_stats(self) -> QueueStats:
        return await self._p.queue.client.stats()

    async def fleet_stats(self) -> dict[str, dict[str, Any]]:
        """From the run's `FleetManager` when it has `stats`; otherwise all of `parts.servers`
        form one fleet `default`."""
        parts = self._p.parts
        manager = getattr(parts, "fleets", None)
        if manager is not None and hasattr(manager, "stats"):
            return dict((await manager.stats())["fleets"])
        rows = []
        for i, srv in enumerate(parts.servers):
            st = await srv.refresh() if hasattr(srv, "refresh") else srv.stats()
            rows.append({
                "name": getattr(srv, "name", f"server-{i}"), "version": st.version, "in_flight": st.in_flight,
                "tokens_per_s": round(st.tokens_per_s, 3), "generated_tokens": st.generated_tokens,
                "healthy": bool(st.healthy), "paused": bool(st.paused), "arena_waits": st.arena_waits,
                "arena_wait_s": round(st.arena_wait_s, 3), "arena_waiting": st.arena_waiting,
            })
        return {"default": {
            "servers": rows, "healthy": sum(r["healthy"] for r in rows),
            "in_flight": sum(r["in_flight"] for r in rows), "tokens_per_s": round(sum(r["tokens_per_s"] for r in rows), 3),
            "arena_waiting": sum(r["arena_waiting"] for r in rows),
        }}
