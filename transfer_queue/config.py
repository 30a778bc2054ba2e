"""Configuration of a TransferQueue: which metadata backend, which data plane, how big.

One dataclass, defaults on the fields, validated in `__post_init__` with errors that
name the key to change (`queue.<field>`). It knows nothing about the asyncrl config
tree; asyncrl nests it under `queue:`.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

from plane_common.net import check_spec

METADATA_BACKENDS = ("memory", "redis")
STORAGE_PLANES = ("local", "shm", "zmq", "nixl")
CROSSING_PLANES = ("zmq", "nixl")
"""The planes whose tensors a consumer on another host than the producer's can read; `local` stays in
one process, `shm` in one host (its /dev/shm)."""


def new_run_id() -> str:
    """A queue namespace of its own (`queue.run_id` left unset): `tq-` and 12 random hex digits."""
    return f"tq-{secrets.token_hex(6)}"


@dataclass
class TransferQueueConfig:
    metadata: str = "memory"
    """Metadata backend: `memory` (one controller process; other processes reach it over
    ZeroMQ at `controller_address`) or `redis` (Redis Streams at `redis_url`, durable)."""

    storage: str = "shm"
    """Data plane for tensors: `local` (in-process only), `shm` (same host, producer writes
    once into /dev/shm, consumers map it), `zmq` (a storage unit served over ZeroMQ),
    `nixl` (the producer registers its memory with NIXL; consumers READ it)."""

    capacity: int = 4096
    """Records resident at once (put and not yet acked by every consumer group).
    `put` waits while the queue is full."""

    consumer_groups: list[str] = field(default_factory=lambda: ["trainer"])
    """Consumer groups that each see every record (e.g. `trainer`, `eval`). A record is
    freed once every group acked it or dropped it by a counted rule."""

    lease_timeout_s: float = 60.0
    """A batch handed to a consumer and neither acked nor renewed within this time is
    redelivered to the next consumer of the same group."""

    read_timeout_s: float = 30.0
    """How long a consumer waits for another process's bytes (a `zmq` storage unit, a `nixl` producer's
    agent), asking a `zmq` unit again meanwhile (a request lost with a connection that broke and came
    back). Past it the read fails with `StorageUnreachable` naming the producer: its process is gone or
    its host cut off. asyncrl's trainer then drops that producer's records of the step, counted as
    `unreadable`, and trains on the rest."""

    put_timeout_s: float | None = None
    """How long `put` waits for space before raising `TimeoutError`; None waits forever."""

    controller_address: str = ""
    """ZeroMQ address of a memory controller service (`tcp://127.0.0.1:5555`). Empty: the
    controller lives in this process (memory backend only)."""

    bind_host: str = "127.0.0.1"
    """Where every listener of this package (a `zmq` storage unit, an arena's free endpoint, the controller
    service) binds, resolved in the listener's own process (`plane_common.net`): an address (`127.0.0.1`: one
    host), `auto` (each process its node's address: a run over several hosts), `iface:NAME` or a CIDR (this
    host's address inside it); never every interface. Handles and addresses carry the address bound."""

    redis_url: str = "redis://127.0.0.1:6379/0"
    """Redis server of the `redis` backend."""

    run_id: str = field(default_factory=new_run_id)
    """Namespace of the run's queue state: every Redis key (`tq:<run_id>:...`) and shm file (`tq-<run_id>-...`);
    a handle of another run is refused and a sweep touches only this run's files. Unset, each config draws its
    own (`tq-<12 hex>`), so two queues never share one by accident; every process of one queue must be given
    the same (the service prints its own: `python -m transfer_queue.service`), and a durable (`redis`) queue
    that is reopened must be given its id again. asyncrl sets `default` here and replaces it with the run's
    own (`<run name>-<8 hex>`, kept in the run directory so that a resume finds it)."""

    storage_address: str = ""
    """ZeroMQ address of the `zmq` storage unit. Empty: start one in this process."""

    shm_dir: str = "/dev/shm"
    """Directory of the `shm` plane's files (a tmpfs)."""

    shm_arena_bytes: int = 1 << 30
    """Size of each producer's `shm` arena (one tmpfs file, reused slot by slot; pages are
    only used once touched). 0: one file per tensor, slower but a record then outlives the
    process that wrote it."""

    shm_keep_s: float = 86400.0
    """How long files a run that is gone left in `shm_dir` are kept for its resume after their last write,
    where it may need them (a durable queue's run with a checkpoint, or a run of unknown state); runs
    whose queue was in memory, that finished or have no checkpoint leave nothing that is kept. asyncrl
    removes what is due at the start of every run and on `asyncrl status --gc` (`asyncrl/shm_gc.py`)."""

    nixl_arena_bytes: int = 1 << 30
    """Bytes each producer registers once with its NIXL agent (`nixl` plane)."""

    nixl_backend: str = "UCX"
    """NIXL backend plugin used by the `nixl` plane."""

    max_message_bytes: int = 16 << 20
    """Largest control message (metadata, not tensors) a service accepts; larger ones are
    rejected and counted."""

    max_tensor_bytes: int = 4 << 30
    """Largest single tensor a storage unit accepts."""

    max_frame_bytes: int = 64 << 20
    """ZMQ_MAXMSGSIZE of the controller service's clients (a frame over it closes the connection before
    it is buffered; `get` replies of big batches need the headroom; >= `max_message_bytes`). Listening
    sockets (the service, zmq units, arena free endpoints) take at most 256 KiB a frame whatever this
    says: what is sent to them travels in parts (`transfer_queue/auth.py`)."""

    data_max_frame_bytes: int = (4 << 30) + (1 << 20)
    """ZMQ_MAXMSGSIZE of the `zmq` plane's client sockets, and the most one key may hold at a unit
    (>= `max_tensor_bytes`); tensors travel in parts of at most 256 KiB."""

    secret: str = field(default="", repr=False)
    """Per-run secret. Set: every listening socket of the package is a ZeroMQ CURVE server that admits
    only clients holding the same secret (keys derived in `plane_common/curve.py`, as the weight plane's). Empty: no
    authentication, for standalone use on a trusted host. Never in a repr (nor in asyncrl's saved
    config, which says `<set>`)."""

    record_key: str = field(default="", repr=False)
    """Key material of the `redis` backend's record MACs (`metadata/record_auth.py`); empty: derived from
    `secret`. A durable queue outlives its processes, so a reopened one needs the key its records were
    written under: asyncrl keeps one per run in `RUN_DIR/queue_record_key` (0600), since its `secret` is drawn
    anew by each process unless given. Neither set: records are not authenticated. Never in a repr."""

    max_connections: int = 256
    """Peers each listening socket of the package (controller service, zmq storage unit, arena free
    endpoints) keeps at once; one more is disconnected at once (counted). With the small frames a
    listener takes before a handshake (256 KiB), it bounds what strangers can make it hold."""

    max_blocking_ops: int = 32
    """Controller service: `get`s (and `put`s) that may wait (timeout > 0 or None) in flight at once,
    each kind its own pool; one more is refused at once with a counted `busy` error. Other ops run
    on a separate pool, so waiting calls never starve `stats`, `ack` or a `put` that fits."""

    inline_max_bytes: int = 1024
    """Tensors of at most this many bytes travel inside their handle, i.e. with the metadata,
    instead of in the data plane (no segment, round trip or registration for tiny fields);
    0 sends every tensor through the plane, so metadata holders never receive tensor bytes."""

    @property
    def crosses_hosts(self) -> bool:
        """Whether the storage plane serves consumers on other hosts than the producer's."""
        return self.storage in CROSSING_PLANES

    def __post_init__(self) -> None:
        if self.metadata not in METADATA_BACKENDS:
            raise ValueError(f"queue.metadata={self.metadata!r}: expected one of {METADATA_BACKENDS}")
        if self.storage not in STORAGE_PLANES:
            raise ValueError(f"queue.storage={self.storage!r}: expected one of {STORAGE_PLANES}")
        if self.capacity < 1:
            raise ValueError(f"queue.capacity={self.capacity}: must be >= 1")
        if not self.consumer_groups or len(set(self.consumer_groups)) != len(self.consumer_groups):
            raise ValueError(f"queue.consumer_groups={self.consumer_groups!r}: must be non-empty and unique")
        if any(not isinstance(g, str) or not g or ":" in g for g in self.consumer_groups):
            raise ValueError(f"queue.consumer_groups={self.consumer_groups!r}: names must be non-empty strings without ':'")
        if self.lease_timeout_s <= 0:
            raise ValueError(f"queue.lease_timeout_s={self.lease_timeout_s}: must be > 0")
        if not self.read_timeout_s > 0:
            raise ValueError(f"queue.read_timeout_s={self.read_timeout_s}: must be > 0")
        if self.put_timeout_s is not None and self.put_timeout_s < 0:
            raise ValueError(f"queue.put_timeout_s={self.put_timeout_s}: must be >= 0 or None")
        if self.controller_address and self.metadata != "memory":
            raise ValueError("queue.controller_address: only the memory backend has a controller service")
        if self.controller_address and self.storage == "local":
            raise ValueError("queue.storage='local' keeps tensors in one process; use shm, zmq or nixl with queue.controller_address")
        if not self.run_id or ":" in self.run_id:
            raise ValueError(f"queue.run_id={self.run_id!r}: must be non-empty without ':'")
        check_spec(self.bind_host, "queue.bind_host")
        if not self.shm_keep_s >= 0:
            raise ValueError(f"queue.shm_keep_s={self.shm_keep_s}: must be >= 0 (seconds)")
        if self.shm_arena_bytes < 0:
            raise ValueError(f"queue.shm_arena_bytes={self.shm_arena_bytes}: must be >= 0 (0: a file per tensor)")
        if self.nixl_arena_bytes < 1 << 20:
            raise ValueError(f"queue.nixl_arena_bytes={self.nixl_arena_bytes}: must be >= 1 MiB")
        if self.max_message_bytes < 1024:
            raise ValueError(f"queue.max_message_bytes={self.max_message_bytes}: must be >= 1024")
        if self.inline_max_bytes < 0:
            raise ValueError(f"queue.inline_max_bytes={self.inline_max_bytes}: must be >= 0")
        if self.max_tensor_bytes < 1:
            raise ValueError(f"queue.max_tensor_bytes={self.max_tensor_bytes}: must be >= 1")
        if self.max_frame_bytes < self.max_message_bytes:
            raise ValueError(f"queue.max_frame_bytes={self.max_frame_bytes}: must be >= queue.max_message_bytes")
        if self.data_max_frame_bytes < self.max_tensor_bytes:
            raise ValueError(f"queue.data_max_frame_bytes={self.data_max_frame_bytes}: must be >= queue.max_tensor_bytes")
        if not isinstance(self.secret, str):
            raise ValueError("queue.secret: must be a string ('' for none)")
        if not 1 <= self.max_connections <= 65536:
            raise ValueError(f"queue.max_connections={self.max_connections}: must be in [1, 65536]")
        if not 1 <= self.max_blocking_ops <= 4096:
            raise ValueError(f"queue.max_blocking_ops={self.max_blocking_ops}: must be in [1, 4096]")
