"""What stops a cluster from scaling: the costs that grow with its size, each a closed form with its assumption.

Job: the terms a `Profile` adds to `Costs` for a split (the `scaling:` block of a profile YAML,
every number with its source or marked assumed there), and the same terms as JSON for the
projection's rows (`*_terms`), so a reader sees what each one costs at each size:

- publish fan-out: the trainer's weights reach every rollout GPU (each TP worker takes the full
  weights and loads its shard, as checkpoint-engine style receivers do). `ring`: NCCL's
  pipelined ring broadcast (what `torch.distributed.broadcast` over NCCL runs): every link
  carries the weights once, `bytes / link_bw`, and each receiver adds its pipeline fill,
  `receivers x hop_latency`. `tree`: store and forward down a binary tree, whole weights per hop,
  `bytes / link_bw x ceil(log2(receivers + 1))` (the pessimistic side). Both on top of the
  profile's fixed `publish_s` (gather the full weights, load them, drop the KV cache).
- all-reduce: the trainer's gradient sync, a ring over the inter-node links (FSDP's
  reduce-scatter + all-gather add up to it): per sync `2 (n-1)/n x grad_bytes / link_bw +
  collectives_per_sync x 2 (n-1) x hop_latency` for n ranks, `grad_syncs_per_step` times a
  trainer step. The bandwidth term saturates; the latency term grows linearly with n (NCCL's
  tree all-reduce would grow as log n: this is the pessimistic side).
- straggler: a step that waits for its whole batch (colocated sync) waits for its longest
  sample, and the longest of N draws grows with N until the response cap (`longest_tokens`). The
  simulator runs a slice of the batch (`Costs.slice_factor`), which sees the longest of its own
  samples only; `straggler_terms` prices the difference at a lone request's per-token cost.

It knows GPU counts, bytes and length distributions, nothing of modes, admission or the simulator (see `costs.py`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from asyncrl.engines.cost_model import LongTail

TOPOLOGIES = ("tree", "ring")


@dataclass
class Scaling:
    weight_bytes: float = 0.0
    """Bytes of the weights one publish sends to each receiver (0: publish does not grow with the fleet)."""
    publish_gb_per_s: float = 50.0
    """Per-link bandwidth of the weight broadcast, GB/s."""
    publish_topology: str = "tree"
    """`tree` or `ring` (see the module docstring)."""
    publish_hop_latency_s: float = 0.0
    """`ring` only: seconds of pipeline fill each receiver adds."""
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
        """Seconds the broadcast of `weight_bytes` to `receivers` takes."""
        return self.publish_terms(receivers)["seconds"]

    def publish_terms(self, receivers: int) -> dict[str, Any]:
        """The broadcast's seconds split into the transfer (bytes over one link) and what the fan-out adds."""
        if receivers < 1 or self.weight_bytes == 0:
            return {"model": "none (no weight_bytes)", "receivers": receivers, "transfer_s": 0.0, "fanout_s": 0.0, "seconds": 0.0}
        hop = self.weight_bytes / (self.publish_gb_per_s * 1e9)
        if self.publish_topology == "tree":
            hops = math.ceil(math.log2(receivers + 1))
            model = f"store-and-forward binary tree: bytes / link_bw x ceil(log2(receivers + 1)) = {hops} hops"
            transfer, fanout = hop, hop * (hops - 1)
        else:
            model = "NCCL pipelined ring broadcast: bytes / link_bw + receivers x hop_latency (pipeline fill)"
            transfer, fanout = hop, receivers * self.publish_hop_latency_s
        return {"model": model, "receivers": receivers, "link_gb_per_s": self.publish_gb_per_s, "transfer_s": round(transfer, 4),
                "fanout_s": round(fanout, 4), "seconds": transfer + fanout}

    def collective_s(self, ranks: int) -> float:
        """Trainer seconds per step the gradient all-reduce over `ranks` ranks takes (0 for one rank)."""
        return self.collective_terms(ranks)["seconds"]

    def collective_terms(self, ranks: int) -> dict[str, Any]:
        """The all-reduce's seconds per trainer step split into its bandwidth and latency terms."""
        if ranks <= 1 or self.grad_bytes == 0:
            return {"model": "none (one rank or no grad_bytes)", "ranks": ranks, "bandwidth_s": 0.0, "latency_s": 0.0, "seconds": 0.0}
        bandwidth = self.grad_syncs_per_step * 2 * (ranks - 1) / ranks * self.grad_bytes / (self.collective_gb_per_s * 1e9)
        latency = self.grad_syncs_per_step * self.collectives_per_sync * 2 * (ranks - 1) * self.collective_hop_latency_s
        return {"model": "ring all-reduce per sync: 2(n-1)/n x grad_bytes / link_bw + collectives x 2(n-1) x hop_latency",
                "ranks": ranks, "syncs_per_step": self.grad_syncs_per_step, "link_gb_per_s": self.collective_gb_per_s,
                "bandwidth_s": round(bandwidth, 4), "latency_s": round(latency, 4), "seconds": bandwidth + latency}


def longest_tokens(lengths: LongTail, n: int) -> float:
    """E[max of `n` draws of `lengths`]: its CDF is piecewise linear (a mixture of two uniforms), so
    `integral (1 - F(x)^n) dx` is exact piece by piece. Grows with n up to `lengths.max` (the response cap)."""
    if n < 1:
        return 0.0
    s, j, p, f = lengths.short_tokens, lengths.jitter, lengths.long_fraction, lengths.long_factor
    parts = [(1 - p, s * (1 - j), s * (1 + j)), (p, s * f * (1 - j), s * f * (1 + j))]

    def cdf(x: float, right: bool) -> float:
        """F's limit at x from the right (`right`) or the left: a uniform of no width is a step."""
        def u(lo: float, hi: float) -> float:
            if hi == lo:
                return 1.0 if x > lo or (right and x == lo) else 0.0
            return min(1.0, max(0.0, (x - lo) / (hi - lo)))
        return sum(w * u(lo, hi) for w, lo, hi in parts if w)

    points = sorted({0.0, *(x for w, lo, hi in parts if w for x in (lo, hi))})
    total = 0.0
    for a, b in zip(points, points[1:]):
        fa, fb = cdf(a, right=True), cdf(b, right=False)  # F is linear from fa to fb inside (a, b)
        if fb == fa:
            total += (b - a) * (1 - fa ** n)
        else:  # integral of F^n over (a, b) = (b - a) (fb^(n+1) - fa^(n+1)) / ((n+1) (fb - fa))
            total += (b - a) * (1 - (fb ** (n + 1) - fa ** (n + 1)) / ((n + 1) * (fb - fa)))
    return total


def straggler_terms(lengths: LongTail, samples: int, simulated: int, lone_token_cost_s: float) -> dict[str, Any]:
    """Seconds a step that waits for all of its `samples` waits longer than a simulated slice of
    `simulated` of them: the longest sample's expected excess, generated alone at `lone_token_cost_s` per token."""
    whole, part = longest_tokens(lengths, samples), longest_tokens(lengths, simulated)
    return {"model": "E[max of N long-tail draws] (capped at the longest response), beyond the simulated slice's, at a lone request's token cost",
            "samples": samples, "longest_tokens": round(whole, 1), "simulated_samples": simulated,
            "simulated_longest_tokens": round(part, 1), "seconds": max(0.0, whole - part) * lone_token_cost_s}
