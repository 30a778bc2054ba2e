"""One status snapshot of a running pipeline: the JSON that `asyncrl status` shows.

Job: read the run's own accounting at one moment through its `RunSource`
(`asyncrl/run_state.py`: the typed `RunState` the controller publishes, its data plane's
back-pressure included, the queue's `stats()`, the fleets' stats) and lay it out in the
stable schema documented in docs/status.md (`SCHEMA_VERSION`). The snapshot embeds the
`QueueStats` it read (`queue.stats`), so every queue figure can be checked against the
queue's own numbers at the same instant.

The `mismatch` block is the latest trainer step's training-inference mismatch (`mismatch_block`: the
`mismatch/*` metrics of that step, `asyncrl/trainer/mismatch.py`), absent before the first step.

Boundary: it only reads a `RunSource`, never the pipeline itself, and it knows nothing about where
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
from collections.abc import Mapping
from typing import Any

import math

import msgspec

from asyncrl.metrics import idle_ratio
from asyncrl.run_state import RunSource

SCHEMA_VERSION = 1
STATES = ("starting", "running", "finished", "failed")
"""Run states; `asyncrl status` adds `dead` and `stalled` for runs that stopped reporting."""



class RunNotFound(Exception):
    """No run (or no snapshot of it) where the user pointed (`asyncrl status`)."""


class MalformedSnapshot(RunNotFound):
    """A snapshot that is not JSON of the schema's shape: `asyncrl status` says so in one line, exit 1."""


MALFORMED = (TypeError, ValueError, KeyError, AttributeError, IndexError)
"""What reading a snapshot of the wrong shape raises (a number that is a string, a list that is a map)."""


MISMATCH_KEYS = ("logprob_gap_mean", "logprob_gap_max", "k3_seq_mean", "k3_seq_max", "token_masked_share",
                 "token_truncated_share", "seq_masked_share", "ess")
"""The `mismatch/*` metrics a snapshot's `mismatch` block carries (their meaning: `asyncrl/trainer/mismatch.py`)."""


def mismatch_block(latest: Mapping[str, float] | None) -> dict[str, Any] | None:
    """The snapshot's `mismatch` block from the latest step's `mismatch/*` metrics (keyed without the prefix, with
    `step`: the step they are of), or None before the first step; figures to 6 significant digits (a gap of 2e-7
    is two engines that agree, not 0), one that is not finite left out, as `metrics.jsonl` leaves it out.

    >>> mismatch_block({"step": 3, "ess": 0.97123456, "logprob_gap_mean": 2.1606683e-07, "logprob_gap_max": float("inf")})
    {'step': 3, 'logprob_gap_mean': 2.16067e-07, 'ess': 0.971235}
    """
    if not latest or "step" not in latest:
        return None
    figures = {k: float(f"{float(latest[k]):.6g}") for k in MISMATCH_KEYS if k in latest and math.isfinite(float(latest[k]))}
    return {"step": int(latest["step"]), **figures}


def hist(counts: Mapping[Any, int]) -> dict[str, int]:
    """A staleness histogram as JSON: string keys in increasing numeric order, zero bins left out."""
    return {str(k): int(v) for k, v in sorted(((int(k), v) for k, v in counts.items())) if v}


class SnapshotBuilder:
    """Builds snapshots of one run from its `RunSource`; remembers when each component last made progress."""

    def __init__(self, source: RunSource, *, interval_s: float = 1.0) -> None:
        self.source, self.interval_s = source, interval_s
        self.started_at = now = time.time()
        first = source.state()
        self._beats: dict[str, float | None] = {"status": now, "trainer": None, "rollout": None, "weights": None, "queue": None}
        self._seen: dict[str, Any] = {"trainer": first.step, "rollout": first.generated_tokens, "queue": None}
        self._trained = Counter(first.staleness_hist)
        self._last_batch: dict[str, int] = {}
        self._base = (first.trained_samples, first.trained_tokens)
        """Totals when reporting started: a resumed run counts earlier segments in them."""

    def _progress(self, name: str, value: Any, now: float) -> None:
        if value != self._seen[name]:
            self._seen[name] = value
            self._beats[name] = now

    def _last_trained(self, trained: Mapping[int, int]) -> None:
        """The histogram of the latest batch(es) the trainer took: the growth of the cumulative
        trained histogram since it last grew (one batch when snapshots come faster than steps)."""
        now = Counter(trained)
        if sum(now.values()) != sum(self._trained.values()):
            diff = Counter(now)
            diff.subtract(self._trained)
            self._last_batch = hist(diff)
            self._trained = now

    async def build(self, state: str = "running", error: str | None = None) -> dict[str, Any]:
        if state not in STATES:
            raise ValueError(f"state must be one of {STATES}, got {state!r}")
        info, src = self.source.info, self.source
        stats = await src.queue_stats()
        servers = await src.fleet_stats()
        s = src.state()
        now = time.time()
        wall = max(now - s.segment_start, 1e-9)  # this segment of the run (idle ratios, generated tokens)
        span = max(now - self.started_at, 1e-9)  # since reporting started (trained rates)
        consumer = info.consumer
        self._beats["status"] = now
        self._progress("trainer", s.step, now)
        self._progress("rollout", s.generated_tokens, now)
        self._progress("queue", (stats.put, sum(stats.acked.values())), now)
        self._beats["weights"] = s.last_publish_time
        self._last_trained(s.staleness_hist)
        depth = stats.depth.get(consumer, {})
        mismatch = mismatch_block(s.mismatch)
        return {
            "schema_version": SCHEMA_VERSION,
            "run": {
                "name": info.name, "dir": str(info.dir), "mode": info.mode,
                "host": socket.gethostname(), "pid": os.getpid(), "started_at": self.started_at,
            },
            "state": state,
            "error": error,
            "time": now,
            "interval_s": self.interval_s,
            "trainer": {
                "step": s.step, "total_steps": info.total_steps, "version": s.version,
                "trained_samples": s.trained_samples, "trained_tokens": s.trained_tokens,
                "wait_s": round(s.wait_s, 3), "idle_ratio": round(idle_ratio(s.wait_s, wall), 4),
            },
            "weights": {
                "version": s.version, "publish_every": info.publish_every,
                "last_publish_time": s.last_publish_time, "last_publish_s": round(s.last_publish_s, 4),
                "evicted": dict(s.evicted),
                "parity_max_abs": s.parity_max_abs, "parity_tol": s.parity_tol,
            },
            "rollout": {
                "running_groups": s.running_groups, "accepted_groups": s.accepted_groups,
                "admission_limit": s.admission_limit, "admission": s.admission,
                "generated_tokens": s.generated_tokens, "reward_failures": s.reward_failures,
                "idle_ratio": round(idle_ratio(s.rollout_idle_s, wall), 4),
            },
            "queue": {
                "backend": info.queue_backend, "consumer": consumer, "capacity": stats.capacity,
                "resident": stats.resident, "put": stats.put, "complete_groups": stats.complete_groups,
                "ready": int(depth.get("ready", 0)), "leased": int(depth.get("leased", 0)),
                "waiting": int(depth.get("waiting", 0)), "acked": int(stats.acked.get(consumer, 0)),
                "redelivered": int(stats.redelivered.get(consumer, 0)),
                "drops": {k: int(v) for k, v in sorted(stats.dropped.get(consumer, {}).items())},
                "stats": msgspec.to_builtins(stats, str_keys=True),
            },
            "staleness": {
                "eta": info.eta,
                "queue": hist(stats.staleness.get(consumer, {})),
                "trained": hist(s.staleness_hist),
                "last_batch": self._last_batch,
            },
            "drops": {k: int(v) for k, v in sorted(s.drops.items())},
            "lengths": {k: dict(v) for k, v in s.lengths.items()},
            **({"mismatch": mismatch} if mismatch else {}),
            "fleets": servers,
            "data_plane": data_plane(s.data_plane),
            "rates": {
                "produced_per_s": round(float(stats.rates.get("put_per_s", 0.0)), 4),
                "consumed_per_s": round((s.trained_samples - self._base[0]) / span, 4),
                "generated_tokens_per_s": round(s.generated_tokens / wall, 3),
                "trained_tokens_per_s": round((s.trained_tokens - self._base[1]) / span, 3),
            },
            "heartbeats": dict(self._beats),
        }


def data_plane(bp: Mapping[str, Any]) -> dict[str, Any]:
    """The controller's data-plane back-pressure as JSON: its arena's waits and the frees it could not deliver."""
    return {"arena_waits": int(bp.get("arena_waits", 0)), "arena_wait_s": round(float(bp.get("arena_wait_s", 0.0)), 3),
            "arena_waiting": int(bp.get("arena_waiting", 0)),
            "undelivered_frees": [{"endpoint": str(r["endpoint"]), "producer": str(r["producer"]), "frees": int(r["frees"])}
                                  for r in bp.get("undelivered_frees", ())]}


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
