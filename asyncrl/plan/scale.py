"""What stops a cluster from scaling: weight publish and gradient collectives that grow with its size.

Job: two closed-form costs a `Profile` adds to `Costs` for a split (the `scaling:` block of a
profile YAML, every number with its source or marked assumed there):

- publish: the trainer's weights reach every rollout server. `tree` (store and forward down a
  binary broadcast tree): `bytes / link_bw x ceil(log2(receivers + 1))`; `ring` (pipelined, as
  NCCL's broadcast): `2 x bytes / link_bw + receivers x hop_latency`. Both on top of the
  profile's fixed `publish_s` (pause, load, drop the KV cache).
- collective: the trainer's gradient all-reduce (ring over the inter-node links, as FSDP's
  reduce-scatter + all-gather add up to): per gradient sync
  `2 (n-1)/n x grad_bytes / link_bw + collectives_per_sync x 2 (n-1) x hop_latency` for n ranks,
  `grad_syncs_per_step` times a step. The bandwidth term saturates; the latency term grows with n.

It knows GPU counts and bytes, nothing of modes, admission or the simulator (see `costs.py`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

TOPOLOGIES = ("tree", "ring")


@dataclass
class Scaling:
    weight_bytes: float = 0.0
    """Bytes of the weights one publish sends to each server (0: publish does not grow with the fleet)."""
    publish_gb_per_s: float = 50.0
    """Per-link bandwidth of the weight broadcast, GB/s."""
    publish_topology: str = "tree"
    """`tree` or `ring` (see the module docstring)."""
    publish_hop_latency_s: float = 0.0
    """`ring` only: seconds per receiver the pipeline's fill adds."""
    grad_bytes: float = 0.0
    """Bytes of the gradients one sync all-reduces (0: no collective cost)."""
    collective_gb_per_s: float = 50.0
    """Inter-node bandwidth per trainer rank, GB/s."""
    collective_hop_latency_s: float = 0.0
    """Seconds per ring hop of one collective."""
    collectives_per_sync: int = 1
    """Collectives one gradient sync is split into (FSDP: one per sharded block)."""
    grad_syncs_per_step: int = 1
    """Gradient syncs per trainer step (mini-batches x micro-batches that reduce-scatter)."""

    def __post_init__(self) -> None:
        if self.publish_topology not in TOPOLOGIES:
            raise ValueError(f"scaling.publish_topology: {self.publish_topology!r} is not one of {TOPOLOGIES}")
        for key in ("weight_bytes", "grad_bytes", "publish_hop_latency_s", "collective_hop_latency_s"):
            if getattr(self, key) < 0:
                raise ValueError(f"scaling.{key} must be >= 0, got {getattr(self, key)}")
        for key in ("publish_gb_per_s", "collective_gb_per_s"):
            if getattr(self, key) <= 0:
                raise ValueError(f"scaling.{key} must be > 0, got {getattr(self, key)}")
        for key in ("collectives_per_sync", "grad_syncs_per_step"):
            if getattr(self, key) < 1:
                raise ValueError(f"scaling.{key} must be >= 1, got {getattr(self, key)}")

    def publish_s(self, receivers: int) -> float:
        """Seconds the broadcast of `weight_bytes` to `receivers` servers takes."""
        if receivers < 1 or self.weight_bytes == 0:
            return 0.0
        hop = self.weight_bytes / (self.publish_gb_per_s * 1e9)
        if self.publish_topology == "tree":
            return hop * math.ceil(math.log2(receivers + 1))
        return 2 * hop + receivers * self.publish_hop_latency_s

    def collective_s(self, ranks: int) -> float:
        """Trainer seconds per step the gradient all-reduce over `ranks` ranks takes (0 for one rank)."""
        if ranks <= 1 or self.grad_bytes == 0:
            return 0.0
        bandwidth = 2 * (ranks - 1) / ranks * self.grad_bytes / (self.collective_gb_per_s * 1e9)
        latency = self.collectives_per_sync * 2 * (ranks - 1) * self.collective_hop_latency_s
        return self.grad_syncs_per_step * (bandwidth + latency)
