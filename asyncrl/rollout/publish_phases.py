"""Where the time of one publish goes: its phases, named once, as `weights/publish_<phase>_s` metrics.

Job: turn the timings a publish's parts record where they happen (the trainer rank: its wait for
receivers, the transfer, its reshard, its probe forward; `AsyncTrainer`: the wait for the trainer and
the call; `FleetWeights`: the whole publish and the servers' probe) into one metric per phase, so that a
publish slower than its transfer says why (`asyncrl bench planes` reports their means as
`publish_phases_s`). The phases add up to `weights/publish_s`, the time the caller waited; a probe
phase that runs after the publish returned (`probe_servers`, and `probe_trainer` when the trainer
scores it as a verb of its own) is reported as it ran but is not part of that wait.
Boundary: arithmetic on the outcome dict; it times nothing itself.

Phases, in the order a publish meets them:
    lock           waiting for the trainer (a step, a re-sync or the previous probe in flight)
    join           the sender waiting for its receivers' Join (`wait_for_ids`)
    transfer       `Sender.publish`: pack, ship, every server paused, loaded and confirmed (gather included)
    finish         the ranks' drain and reshard after the transfer
    probe_trainer  the trainer's forward on the parity probe (the reference)
    dispatch       the call's own cost: the worker thread, the Ray round trip, merging the ranks' outcomes
    probe_servers  the servers scoring the probe and the comparison
    bookkeeping    the rest of `FleetManager.publish`: routing, notes, the membership lock
Servers resume after they confirm the load: their resume is on no one's path, so it has no phase.
"""

from __future__ import annotations

from typing import Any

PHASES = ("lock", "join", "transfer", "finish", "probe_trainer", "dispatch", "probe_servers", "bookkeeping")
"""Every phase, in order; each is a metric `weights/publish_<phase>_s`."""


def metric(phase: str) -> str:
    return f"weights/publish_{phase}_s"


def phase_metrics(out: dict[str, Any], total_s: float, probe_servers_s: float = 0.0) -> dict[str, float]:
    """`weights/publish_<phase>_s` from a trainer's publish outcome `out` (the keys its parts wrote:
    `lock_s`, `call_s`, `rank_s`, `join_s`, `seconds`, `finish_s`, `probe_s`), the whole publish as the
    fleet timed it (`total_s`) and the servers' probe while the publish waited for it (`probe_servers_s`).
    A probe that runs after the publish returned is in none of them (`weights/parity_*_s` say what it
    cost). A source that times nothing (a test double) gets its whole call as `dispatch`.

    >>> m = phase_metrics({"lock_s": 0.1, "call_s": 1.0, "rank_s": 0.9, "seconds": 0.5, "finish_s": 0.1, "probe_s": 0.3}, 1.5)
    >>> round(sum(m.values()), 6), round(m["weights/publish_dispatch_s"], 6), round(m["weights/publish_bookkeeping_s"], 6)
    (1.5, 0.1, 0.4)
    """
    call, rank = float(out.get("call_s", 0.0)), float(out.get("rank_s", 0.0))
    phases = {
        "lock": float(out.get("lock_s", 0.0)),
        "join": float(out.get("join_s", 0.0)),
        "transfer": float(out.get("seconds", 0.0)) if rank else 0.0,
        "finish": float(out.get("finish_s", 0.0)),
        "probe_trainer": float(out.get("probe_s", 0.0)),
        "dispatch": max(0.0, call - rank) if rank else call,
        "probe_servers": probe_servers_s,
    }
    phases["bookkeeping"] = max(0.0, total_s - phases["lock"] - call - probe_servers_s)
    return {metric(p): phases[p] for p in PHASES}
