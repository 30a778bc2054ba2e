"""One status snapshot of a running pipeline: the JSON that `asyncrl status` shows.

Job: read the pipeline's own accounting (staleness manager, queue `stats()`, weight
publisher, rollout servers, trainer counters) at one moment and lay it out in the stable
schema documented in docs/status.md (`SCHEMA_VERSION`). The snapshot embeds the
`QueueStats` it read (`queue.stats`), so every queue figure can be checked against the
queue's own numbers at the same instant.

Boundary: it only reads; it never changes the pipeline, and it knows nothing about where
the snapshot goes (see `reporter.py`) or how it is shown (`view.py`). Liveness (dead /
stalled) is judged by the reader, from `pid`, `host` and `time` (see `command.py`).

Why a builder with memory: "time since the last heartbeat" of a component is the time
since it last made progress (a step, a generated token, a publish, a queue change), and
the "last trained batch" histogram is the growth of the cumulative trained histogram;
both need the previous snapshot.
"""

from __future__ import annotations

import os
import socket
import time
from collections import Counter
from typing import Any

SCHEMA_VERSION = 1
STATES = ("starting", "running", "finished", "failed")
"""Run states; `asyncrl status` adds `dead` and `stalled` for runs that stopped reporting."""


def hist(counts: dict[Any, int]) -> dict[str, int]:
    """A staleness histogram as JSON: string keys in increasing numeric order, zero bins left out."""
    return {str(k): int(v) for k, v in sorted(((int(k), v) for k, v in counts.items())) if v}


async def fleet_stats(parts: Any) -> dict[str, dict[str, Any]]:
    """Per fleet, per server: version, in-flight requests, tokens/s, health.

    Uses the run's `FleetManager` (`parts.fleets`) when it has `stats`; otherwise all of
    `parts.servers` form one fleet `default`.
    """
    manager = getattr(parts, "fleets", None)
    if manager is not None and hasattr(manager, "stats"):
        return dict((await manager.stats())["fleets"])
    rows = []
    for i, s in enumerate(parts.servers):
        st = await s.refresh() if hasattr(s, "refresh") else s.stats()
        rows.append({
            "name": getattr(s, "name", f"server-{i}"), "version": st.version, "in_flight": st.in_flight,
            "tokens_per_s": round(st.tokens_per_s, 3), "generated_tokens": st.generated_tokens,
            "healthy": bool(st.healthy), "paused": bool(st.paused),
        })
    return {"default": {
        "servers": rows, "healthy": sum(r["healthy"] for r in rows),
        "in_flight": sum(r["in_flight"] for r in rows), "tokens_per_s": round(sum(r["tokens_per_s"] for r in rows), 3),
    }}


class SnapshotBuilder:
    """Builds snapshots of one pipeline; remembers when each component last made progress."""

    def __init__(self, pipeline: Any, *, interval_s: float = 1.0) -> None:
        self.pipeline, self.interval_s = pipeline, interval_s
        self.started_at = now = time.time()
        self._beats: dict[str, float | None] = {"status": now, "trainer": None, "rollout": None, "weights": None, "queue": None}
        self._seen: dict[str, Any] = {"trainer": pipeline.step, "rollout": pipeline.rollouter.generated_tokens, "queue": None}
        self._trained = Counter(pipeline.staleness_hist)
        self._last_batch: dict[str, int] = {}
        self._base = (pipeline.trained_samples, pipeline.trained_tokens)
        """Totals when reporting started: a resumed run counts earlier segments in them."""

    def _progress(self, name: str, value: Any, now: float) -> None:
        if value != self._seen[name]:
            self._seen[name] = value
            self._beats[name] = now

    def _last_trained(self) -> None:
        """The histogram of the latest batch(es) the trainer took: the growth of the cumulative
        trained histogram since it last grew (one batch when snapshots come faster than steps)."""
        now = Counter(self.pipeline.staleness_hist)
        if sum(now.values()) != sum(self._trained.values()):
            diff = Counter(now)
            diff.subtract(self._trained)
            self._last_batch = hist(diff)
            self._trained = now

    async def build(self, state: str = "running", error: str | None = None) -> dict[str, Any]:
        if state not in STATES:
            raise ValueError(f"state must be one of {STATES}, got {state!r}")
        p = self.pipeline
        stats = await p.queue.client.stats()
        servers = await fleet_stats(p.parts)
        now = time.time()
        wall = max(now - p.t_start, 1e-9)  # this segment of the run (idle ratios, generated tokens)
        span = max(now - self.started_at, 1e-9)  # since reporting started (trained rates)
        step, consumer = p.step, p.queue.consumer
        self._beats["status"] = now
        self._progress("trainer", step, now)
        self._progress("rollout", p.rollouter.generated_tokens, now)
        self._progress("queue", (stats.put, sum(stats.acked.values())), now)
        fleets = p.parts.fleets
        self._beats["weights"] = fleets.last_publish_time or None
        self._last_trained()
        depth = stats.depth.get(consumer, {})
        cfg = p.cfg
        return {
            "schema_version": SCHEMA_VERSION,
            "run": {
                "name": p.run_dir.name, "dir": str(p.run_dir.resolve()), "mode": cfg.trainer.mode,
                "host": socket.gethostname(), "pid": os.getpid(), "started_at": self.started_at,
            },
            "state": state,
            "error": error,
            "time": now,
            "interval_s": self.interval_s,
            "trainer": {
                "step": step, "total_steps": cfg.trainer.total_steps, "version": p.staleness.version,
                "trained_samples": p.trained_samples, "trained_tokens": p.trained_tokens,
                "wait_s": round(p.wait_s, 3), "idle_ratio": round(min(p.wait_s / wall, 1.0), 4),
            },
            "weights": {
                "version": p.staleness.version, "publish_every": p.publish_every,
                "last_publish_time": fleets.last_publish_time or None, "last_publish_s": round(fleets.last_publish_s, 4),
                "evicted": dict(fleets.evicted),
            },
            "rollout": {
                "running_groups": p.staleness.running, "accepted_groups": p.staleness.accepted,
                "admission_limit": p.staleness.admission_limit(), "admission": "pace" if p.staleness.pace is not None else "bound",
                "generated_tokens": p.rollouter.generated_tokens, "reward_failures": p.rollouter.reward_failures,
                "idle_ratio": round(min(p.rollouter.idle_seconds() / wall, 1.0), 4),
            },
            "queue": {
                "backend": cfg.queue.metadata, "consumer": consumer, "capacity": stats.capacity,
                "resident": stats.resident, "put": stats.put, "complete_groups": stats.complete_groups,
                "ready": int(depth.get("ready", 0)), "leased": int(depth.get("leased", 0)),
                "waiting": int(depth.get("waiting", 0)), "acked": int(stats.acked.get(consumer, 0)),
                "redelivered": int(stats.redelivered.get(consumer, 0)),
                "drops": {k: int(v) for k, v in sorted(stats.dropped.get(consumer, {}).items())},
                "stats": stats.to_wire(),
            },
            "staleness": {
                "eta": p.staleness.eta,
                "queue": hist(stats.staleness.get(consumer, {})),
                "trained": hist(p.staleness_hist),
                "last_batch": self._last_batch,
            },
            "drops": {k: int(v) for k, v in sorted(p.staleness.dropped.items())},
            "fleets": servers,
            "rates": {
                "produced_per_s": round(float(stats.rates.get("put_per_s", 0.0)), 4),
                "consumed_per_s": round((p.trained_samples - self._base[0]) / span, 4),
                "generated_tokens_per_s": round(p.rollouter.generated_tokens / wall, 3),
                "trained_tokens_per_s": round((p.trained_tokens - self._base[1]) / span, 3),
            },
            "heartbeats": dict(self._beats),
        }


def lifecycle_snapshot(record: dict[str, Any], run_dir: str, last: dict[str, Any] | None) -> dict[str, Any]:
    """A snapshot for a lifecycle record of `asyncrl train` (`status.json` with only pid, time,
    state, step, error: before the pipeline started or after it ended), on top of the
    pipeline's last full snapshot `last` when there is one."""
    snap = dict(last) if last else {
        "schema_version": SCHEMA_VERSION,
        "run": {"name": os.path.basename(os.path.normpath(run_dir)), "dir": run_dir, "mode": None,
                "host": None, "pid": None, "started_at": None},
        "interval_s": None, "heartbeats": {"status": None},
    }
    snap["run"] = dict(snap["run"], pid=record.get("pid"), host=snap["run"].get("host") or socket.gethostname())
    snap["state"] = record.get("state", "running")
    snap["error"] = record.get("error")
    snap["time"] = record.get("time")
    snap["heartbeats"] = dict(snap.get("heartbeats") or {}, status=record.get("time"))
    if "trainer" in snap:
        snap["trainer"] = dict(snap["trainer"], step=record.get("step", snap["trainer"]["step"]))
    else:
        snap["trainer"] = {"step": record.get("step", 0)}
    return snap
