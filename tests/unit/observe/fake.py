"""A stand-in pipeline with the attributes `SnapshotBuilder` reads (real staleness manager, real QueueStats)."""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

from asyncrl.config import Config
from asyncrl.engines.base import ServerStats
from asyncrl.lengths import LengthBias
from asyncrl.rollout.parity import ParityCheck
from asyncrl.staleness import StalenessManager
from transfer_queue.records import QueueStats


class FakeClient:
    def __init__(self) -> None:
        self.stats_value = QueueStats(
            capacity=64, resident=12, put=40, complete_groups=3,
            depth={"trainer": {"ready": 8, "waiting": 2, "leased": 2}}, acked={"trainer": 24},
            dropped={"trainer": {"stale": 4}}, redelivered={"trainer": 1},
            staleness={"trainer": {0: 8, 2: 4, 1: 12}}, rates={"put_per_s": 4.0, "ack_per_s": 2.4},
        )

    async def stats(self) -> QueueStats:
        return self.stats_value


class FakeServer:
    def __init__(self, version: int, healthy: bool = True, arena_waits: int = 0) -> None:
        self.version, self.healthy, self.arena_waits = version, healthy, arena_waits

    def stats(self) -> ServerStats:
        return ServerStats(version=self.version, in_flight=3, paused=False, generated_tokens=500, tokens_per_s=41.5, healthy=self.healthy,
                           arena_waits=self.arena_waits, arena_wait_s=2.5 * self.arena_waits, arena_waiting=min(self.arena_waits, 1))


class FakePlane:
    """The controller's data plane as the run state reads it: one arena wait, frees one producer did not get."""

    def backpressure(self) -> dict:
        return {"arena_waits": 1, "arena_wait_s": 0.75, "arena_waiting": 0,
                "undelivered_frees": [{"endpoint": "tcp://10.0.0.7:41000", "producer": "shm producer pid 42", "frees": 17}]}


def fake_pipeline(run_dir: Path) -> SimpleNamespace:
    staleness = StalenessManager(batch_groups=2, eta=2)
    staleness.version, staleness.accepted = 3, 9
    staleness.running_by_version.update({2: 1, 3: 1})
    staleness.dropped = Counter({"stale": 1})
    parity = ParityCheck(every=1, tol=0.01, ids=[1, 2, 3])
    parity.judge("server-0", 3, [-1.0, -2.0], [-1.0, -2.00002])
    lengths = LengthBias()
    lengths.add("trained", [4, 4, 5])
    lengths.add("dropped_stale", [30])
    return SimpleNamespace(parity=parity, lengths=lengths,
        cfg=Config(), run_dir=run_dir, step=3, staleness=staleness, publish_every=1,
        queue=SimpleNamespace(client=FakeClient(), consumer="trainer", storage=FakePlane()),
        rollouter=SimpleNamespace(generated_tokens=1000, reward_failures=0, idle_seconds=lambda: 1.0),
        parts=SimpleNamespace(servers=[FakeServer(3), FakeServer(2, healthy=False, arena_waits=4)],
                              fleets=SimpleNamespace(last_publish_s=0.25, last_publish_time=time.time() - 2,
                                                 evicted={"server-1": "timeout"})),
        staleness_hist=Counter({0: 8, 1: 12, 2: 4}), wait_s=0.5, trained_samples=24, trained_tokens=300,
        t_start=time.time() - 10, mismatch={},  # no trainer step reported yet: no `mismatch` block
    )
