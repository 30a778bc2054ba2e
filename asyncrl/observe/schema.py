"""The status snapshot as typed records: what `asyncrl status` accepts from a status file or a Redis key.

Job: describe, field by field, the JSON that `snapshot.py` (`SnapshotBuilder.build`) and `reporter.py` write
and the lifecycle record that `asyncrl train` writes (`run_dir.write_status`), as msgspec Structs, and
`check` a snapshot against them: the typed form, or `MalformedSnapshot` naming the field that is wrong
(`...: Expected `int`, got `str` - at `$.fleets[...].servers[0].in_flight``). Every view (`view.py`, `--json`,
`prometheus.py`) reads what `check` returns, so a snapshot of another shape never reaches one.

Rules: a field the writer always writes is required, one that older writers did not write (or that only
some runs have) is `UNSET` when absent and stays absent in what `check` returns; wrong types are errors
(strict: a number is not a string, a bool is not a number, a list is not an object); keys that are not
described here are accepted and left out (a newer writer's field is not an error for an older reader, and
what is shown is only what is described). Fields are declared in the writer's order, the order `--json`
prints them in. Schema and field meanings: docs/status.md.

Boundary: types and the check only; no I/O. Reading and the reader's own fields (`source`, `liveness`,
`clock_offset_s`, `heartbeat_expired`, `shm_dead`) are `command.py`'s: they are added after the check.
"""

from __future__ import annotations

from typing import Any, Union

import msgspec
from msgspec import UNSET, Struct, UnsetType

from asyncrl.observe.snapshot import MalformedSnapshot

Hist = dict[str, int]
"""A histogram `{"<staleness>": count}` (string keys, as JSON has them)."""


class Run(Struct, kw_only=True):
    name: str
    dir: str
    mode: str | None
    host: str | None
    pid: int | None
    started_at: float | None


class Trainer(Struct, kw_only=True):
    step: int
    total_steps: int
    version: int
    trained_samples: int
    trained_tokens: int
    wait_s: float
    idle_ratio: float


class Weights(Struct, kw_only=True):
    version: int
    publish_every: int
    last_publish_time: float | None
    last_publish_s: float
    evicted: dict[str, str]
    parity_max_abs: float | None | UnsetType = UNSET
    parity_tol: float | None | UnsetType = UNSET


class Rollout(Struct, kw_only=True):
    running_groups: int
    accepted_groups: int
    admission_limit: int | UnsetType = UNSET
    admission: str | UnsetType = UNSET
    generated_tokens: int
    reward_failures: int
    idle_ratio: float


class QueueStats(Struct, kw_only=True):
    """`transfer_queue.QueueStats` as `msgspec.to_builtins(..., str_keys=True)` writes it. Its own type refuses
    unknown fields (a wire type); a snapshot's copy accepts a newer queue's counters."""

    capacity: int
    resident: int
    put: int
    complete_groups: int
    depth: dict[str, dict[str, int]]
    acked: dict[str, int]
    dropped: dict[str, dict[str, int]]
    redelivered: dict[str, int]
    staleness: dict[str, Hist]
    rejected: int = 0
    busy: int = 0
    not_owner: int = 0
    forged: int = 0
    """Records refused as not the run's (their MAC fails); 0 from a queue that does not count them."""
    auth_refused: int = 0
    handshake_failed: int = 0
    rates: dict[str, float] = msgspec.field(default_factory=dict)


class Queue(Struct, kw_only=True):
    backend: str
    consumer: str
    capacity: int
    resident: int
    put: int
    complete_groups: int
    ready: int
    leased: int
    waiting: int
    acked: int
    redelivered: int
    drops: dict[str, int]
    stats: QueueStats


class Staleness(Struct, kw_only=True):
    eta: int
    queue: Hist
    trained: Hist
    last_batch: Hist


class Lengths(Struct, kw_only=True):
    """One fate's response lengths (`asyncrl.lengths.LengthBias.summary`); the figures only when measured."""

    count: int
    mean: float | UnsetType = UNSET
    p50: int | UnsetType = UNSET
    p90: int | UnsetType = UNSET
    max: int | UnsetType = UNSET


class Mismatch(Struct, kw_only=True):
    """The latest trainer step's training-inference mismatch (`snapshot.mismatch_block`; the `mismatch/*` metrics of
    `asyncrl/trainer/mismatch.py`); a figure that was not finite at that step is absent."""

    step: int
    """The trainer step the figures are of."""
    logprob_gap_mean: float | UnsetType = UNSET
    logprob_gap_max: float | UnsetType = UNSET
    k3_seq_mean: float | UnsetType = UNSET
    k3_seq_max: float | UnsetType = UNSET
    token_masked_share: float | UnsetType = UNSET
    token_truncated_share: float | UnsetType = UNSET
    seq_masked_share: float | UnsetType = UNSET
    ess: float | UnsetType = UNSET


class Server(Struct, kw_only=True):
    name: str
    healthy: bool
    routed: bool | UnsetType = UNSET
    in_flight: int
    version: int
    paused: bool | UnsetType = UNSET
    tokens_per_s: float
    generated_tokens: int | UnsetType = UNSET
    arena_waits: int | UnsetType = UNSET
    arena_wait_s: float | UnsetType = UNSET
    arena_waiting: int | UnsetType = UNSET
    parity_max_abs: float | None | UnsetType = UNSET
    parity_version: int | None | UnsetType = UNSET


class Event(Struct, kw_only=True):
    """A fleet change (`asyncrl/rollout/fleet_log.py`): what every one has, then the details of some kinds."""

    time: float
    kind: str
    server: str
    fleet: str | UnsetType = UNSET
    via: str | UnsetType = UNSET
    seconds: float | UnsetType = UNSET
    moved: int | UnsetType = UNSET
    replaced: bool | UnsetType = UNSET
    cause: str | UnsetType = UNSET
    why: str | UnsetType = UNSET
    error: str | UnsetType = UNSET
    attempts: int | UnsetType = UNSET
    version: int | UnsetType = UNSET
    startup: dict[str, float] | UnsetType = UNSET


class Autoscale(Struct, kw_only=True):
    """The autoscaler's latest window (`asyncrl/rollout/autoscale.py`): only `bottleneck` before the first."""

    bottleneck: str
    trainer_idle: float | UnsetType = UNSET
    rollout_idle: float | UnsetType = UNSET
    servers: int | UnsetType = UNSET
    min: int | UnsetType = UNSET
    max: int | UnsetType = UNSET
    decided: int | UnsetType = UNSET
    trainer_tokens_per_s: float | UnsetType = UNSET
    server_tokens_per_s_full: float | UnsetType = UNSET
    servers_for_trainer: int | UnsetType = UNSET


class Fleet(Struct, kw_only=True):
    servers: list[Server]
    healthy: int
    in_flight: int
    tokens_per_s: float
    arena_waiting: int | UnsetType = UNSET
    size: int | UnsetType = UNSET
    target: int | UnsetType = UNSET
    history: list[tuple[float, int]] | UnsetType = UNSET
    events: list[Event] | UnsetType = UNSET
    autoscale: Autoscale | UnsetType = UNSET


class UndeliveredFrees(Struct, kw_only=True):
    endpoint: str
    producer: str
    frees: int


class DataPlane(Struct, kw_only=True):
    arena_waits: int
    arena_wait_s: float
    arena_waiting: int
    undelivered_frees: list[UndeliveredFrees]


class Snapshot(Struct, kw_only=True):
    """A pipeline's snapshot (`SnapshotBuilder.build`), also with a lifecycle record laid over it."""

    schema_version: int
    run: Run
    state: str
    error: str | None = None
    time: float | None
    interval_s: float
    trainer: Trainer
    weights: Weights
    rollout: Rollout
    queue: Queue
    staleness: Staleness
    drops: dict[str, int]
    lengths: dict[str, Lengths] | UnsetType = UNSET
    mismatch: Mismatch | UnsetType = UNSET
    """Absent before the first trainer step, and in snapshots of runs from before it was written."""
    fleets: dict[str, Fleet]
    data_plane: DataPlane | UnsetType = UNSET
    rates: dict[str, float]
    heartbeats: dict[str, float | None]
    heartbeat_ttl_s: int | UnsetType = UNSET
    """Written to Redis only: the heartbeat key's full TTL (`RedisStatus`)."""


class LifecycleRecord(Struct, kw_only=True):
    """What `asyncrl train` writes to `status.json` before the pipeline runs and after it ends."""

    pid: int | None | UnsetType = UNSET
    time: float | None | UnsetType = UNSET
    state: str | UnsetType = UNSET
    step: int | UnsetType = UNSET
    error: str | None | UnsetType = UNSET


class PartialRun(Struct, kw_only=True):
    name: str | UnsetType = UNSET
    dir: str | UnsetType = UNSET
    mode: str | None | UnsetType = UNSET
    host: str | None | UnsetType = UNSET
    pid: int | None | UnsetType = UNSET
    started_at: float | None | UnsetType = UNSET


class Steps(Struct, kw_only=True):
    step: int


class EarlySnapshot(Struct, kw_only=True):
    """A snapshot without the pipeline's figures (no `queue`): a lifecycle record before the pipeline
    reported (`snapshot.lifecycle_snapshot`); the views show its head and step only."""

    schema_version: int | UnsetType = UNSET
    run: PartialRun | UnsetType = UNSET
    state: str | UnsetType = UNSET
    error: str | None | UnsetType = UNSET
    time: float | None | UnsetType = UNSET
    interval_s: float | None | UnsetType = UNSET
    trainer: Steps | UnsetType = UNSET
    heartbeats: dict[str, float | None] | UnsetType = UNSET
    heartbeat_ttl_s: int | UnsetType = UNSET


def typed(snap: dict[str, Any], source: str, kind: type[Struct] | None = None) -> Union[Snapshot, EarlySnapshot, LifecycleRecord]:
    """`snap` as `kind` (default: `Snapshot` when it has `queue`, else `EarlySnapshot`), or
    `MalformedSnapshot` in one line that names `source` and the path of the wrong field."""
    kind = kind or (Snapshot if "queue" in snap else EarlySnapshot)
    try:
        return msgspec.convert(snap, type=kind)  # type: ignore[return-value]
    except msgspec.ValidationError as e:
        raise MalformedSnapshot(f"{source}: not a status snapshot: {e}") from None


def check(snap: dict[str, Any], source: str, kind: type[Struct] | None = None) -> dict[str, Any]:
    """`typed`, as JSON data again: what the views read (only the described fields, each of its type)."""
    return msgspec.to_builtins(typed(snap, source, kind))
