"""`WeightsConfig`: the one config record of the weight plane.

The sender (trainer side) and every receiver (rollout server side) are built from the
same record, so a field means the same thing at both ends. Validation runs at
construction and names the key to change (`weights.<field>`), so a bad YAML value fails
at load, not in the middle of the first publish.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from plane_common.net import check_spec

BACKENDS = ("local", "shm", "gloo", "nccl", "nixl", "cuda_ipc")
CROSSING_BACKENDS = ("gloo", "nccl", "nixl")
"""The backends whose bytes reach a receiver on another host; `local` stays in one process, `shm` and
`cuda_ipc` in one host (its /dev/shm, its GPUs)."""


@dataclass
class WeightsConfig:
    """How weights travel from the trainer to the rollout servers."""

    backend: str = "shm"
    """Data plane for bucket bytes: `local` (in-process reference), `shm` (same host,
    /dev/shm), `gloo` (torch.distributed broadcast, CPU), `nccl` (the same on GPU) or
    `nixl` (receivers READ the sender's registered buckets) or `cuda_ipc` (receivers on the
    sender's GPU, or a peer GPU of the same host, read its slots in place)."""

    bucket_size_mb: float = 64.0
    """Size of one flat bucket in MiB. The sender holds two of them (double buffering);
    tensors larger than a bucket are split across consecutive buckets."""

    checksum: bool = True
    """Send a CRC32 of every bucket; a receiver refuses a bucket whose bytes do not match."""

    timeout_s: float = 30.0
    """Seconds a receiver may take to acknowledge a bucket (or join a group) before the
    sender evicts it from the update in progress."""

    straggler_s: float = 2.0
    """A receiver still silent this long after half of an update's receivers acknowledged a step
    of it (its Begin, a bucket, its load), and at least 3x as long as they took, is evicted from
    the update as a `straggler` (a fleet takes it out of routing and brings it up to date in the
    background): one hung or overloaded server does not hold every publish, and the trainer, for
    `timeout_s`. 0: off (every receiver gets the whole `timeout_s`). A collective backend (gloo,
    nccl) cannot leave a member out of a broadcast in flight: there it applies to the acks only."""

    host: str = "127.0.0.1"
    """Where a sender (a trainer rank, or a server that hands its weights to a joiner) binds its control
    socket, the gloo/nccl TCP store and its gloo pair listener, resolved in that sender's own process
    (`plane_common.net`): an address (`127.0.0.1`: one host), `auto` (each process its node's address, what
    a run over several hosts wants), `iface:NAME` (that interface's address) or a CIDR (this host's address
    inside it); never every interface. Receivers reach a sender at the address it bound (its endpoint), and
    their gloo listeners bind the local address that routes to it."""

    port: int = 0
    """Control socket port (ZeroMQ ROUTER); 0 picks a free port (read `Sender.endpoint`)."""

    store_port: int = 0
    """TCP store port of the gloo/nccl groups; 0 picks a free port."""

    device: str = "cpu"
    """Device of the bucket buffers: `cpu`, or `cuda`/`cuda:N` (required by `nccl` and `cuda_ipc`;
    optional for `nixl`, whose READs are then GPU-direct)."""

    nixl_backend: str = "UCX"
    """NIXL transport plugin used by the `nixl` backend."""

    max_message_bytes: int = 4 << 20
    """Largest control frame (ZMQ_MAXMSGSIZE on every socket of the weight plane): ZeroMQ drops a
    peer whose frame is larger before buffering it. Bucket metadata is the largest frame (about
    150 bytes per tensor in the bucket, so 4 MiB holds ~25k tensors); a receiver's frames (Join, Ack,
    Nack) are far smaller, and the sender refuses any over 64 KiB as `oversized`."""

    max_connections: int = 1024
    """Connections the sender's control socket keeps at once (receivers, one each); one more is shut
    at once and counted. With the sender's 128 KiB frame limit it bounds what peers without the
    secret can make it hold before their handshake fails."""

    secret: str = field(default="", repr=False)
    """Per-run secret. Set: the sender's socket is a ZeroMQ CURVE server whose only admitted
    client key is derived from it (`plane_common.curve`), and receivers connect with CURVE;
    a peer without it cannot join. Empty: no authentication (standalone use on a trusted host).
    The asyncrl launcher always sets one (never written: the saved config says `<set>`)."""

    parity_every: int = 1
    """Weight parity probe: every this many publishes (the first included), each server that loaded
    the version scores a fixed probe sequence and its log-probs are compared with the trainer's
    (asyncrl's `FleetManager` runs it; this package only carries the keys). A re-sync of a
    restarted server is always checked. 0: off."""

    parity_tol: float = 0.0
    """Largest max-abs log-prob gap on the parity probe a server may show (logged as
    `weights/parity_max_abs`). 0: by the least precise of asyncrl's `model.dtype` and `rollout.dtype`:
    1e-2 when both are float32; when either is 16-bit, 0.25 plus 2^-6 of the trainer's |log-prob| on each
    token (16-bit rounding is relative to the value). Correct engines differ by about 1e-6 in float32, a
    corrupted load by about 1 or more. A value > 0 is this absolute bound alone."""

    parity_action: str = "stop"
    """A server above `parity_tol`: `stop` ends the run with one line naming the server, the version
    and the gap; `resync` takes the server out of routing and sends it the version again (a re-sync
    that still fails restarts it; a restart that fails stops the run)."""

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"weights.backend must be one of {BACKENDS}, got {self.backend!r}")
        if not self.bucket_size_mb > 0:
            raise ValueError(f"weights.bucket_size_mb must be > 0, got {self.bucket_size_mb}")
        if not self.timeout_s > 0:
            raise ValueError(f"weights.timeout_s must be > 0, got {self.timeout_s}")
        if not self.straggler_s >= 0:
            raise ValueError(f"weights.straggler_s must be >= 0 (0: off), got {self.straggler_s}")
        for key in ("port", "store_port"):
            value = getattr(self, key)
            if not 0 <= value < 65536:
                raise ValueError(f"weights.{key} must be in [0, 65535], got {value}")
        if not 4096 <= self.max_message_bytes < (1 << 31):
            raise ValueError(f"weights.max_message_bytes must be in [4096, 2**31), got {self.max_message_bytes}")
        check_spec(self.host, "weights.host")
        if not 1 <= self.max_connections <= 65536:
            raise ValueError(f"weights.max_connections must be in [1, 65536], got {self.max_connections}")
        if not isinstance(self.secret, str):
            raise ValueError("weights.secret must be a string")
        if self.parity_every < 0:
            raise ValueError(f"weights.parity_every must be >= 0 (0: off), got {self.parity_every}")
        if not self.parity_tol >= 0:
            raise ValueError(f"weights.parity_tol must be >= 0 (0: by model.dtype), got {self.parity_tol}")
        if self.parity_action not in ("stop", "resync"):
            raise ValueError(f"weights.parity_action must be one of ('stop', 'resync'), got {self.parity_action!r}")
        if self.backend in ("nccl", "cuda_ipc") and not self.device.startswith("cuda"):
            raise ValueError(f"weights.device must be cuda[:N] with backend {self.backend}, got {self.device!r}")
        if self.backend in ("local", "shm", "gloo") and self.device != "cpu":
            raise ValueError(f"weights.device must be cpu with backend {self.backend}, got {self.device!r}")

    @property
    def crosses_hosts(self) -> bool:
        """Whether the backend reaches receivers on other hosts than the sender's."""
        return self.backend in CROSSING_BACKENDS

    @property
    def bucket_bytes(self) -> int:
        """Bucket size in bytes, rounded up to a multiple of 64 for aligned tensor starts."""
        n = int(self.bucket_size_mb * (1 << 20))
        return max(64, (n + 63) // 64 * 64)
