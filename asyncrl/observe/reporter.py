"""Periodic status snapshots of a running pipeline: the heartbeat that `asyncrl status` reads.

Job: every `interval_s` seconds, build a snapshot (`snapshot.py`) and write it to
`<run_dir>/status.json` (atomically: write then rename), and, when the run's queue is on
Redis (`queue.metadata=redis`), to Redis as well so that `asyncrl status --redis URL`
works from any host:

    asyncrl:status:<run name>        the latest snapshot, expires after `ttl_s` (heartbeat)
    asyncrl:status:<run name>:last   the latest snapshot, kept `LAST_TTL_S` (last-known state)
    asyncrl:status:runs              sorted set: run name -> time of its latest snapshot

At the end of `Pipeline.run` the controller calls `final()`: the snapshot then says
`finished` or `failed` and is also kept as `<run_dir>/status_final.json`, because
`asyncrl train` overwrites `status.json` with its short lifecycle record afterwards.

Boundary: the reporter only reads the run's `RunSource` (`asyncrl/run_state.py`), never the
pipeline; the controller starts it as a task and cancels it. A write error ends the reporter
task (the controller collects it at the end); the run itself goes on, and `asyncrl status`
then reports it as stalled or dead.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

from asyncrl.observe.snapshot import SnapshotBuilder
from asyncrl.run_state import RunSource

KEY_PREFIX = "asyncrl:status:"
RUNS_KEY = KEY_PREFIX + "runs"
LAST_TTL_S = 7 * 24 * 3600
FINAL_FILE = "status_final.json"


def status_key(run_name: str) -> str:
    return KEY_PREFIX + run_name


def write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


class RedisStatus:
    """Publishes snapshots of one run under its name; the heartbeat key expires when it stops."""

    def __init__(self, url: str, run_name: str, ttl_s: float) -> None:
        import redis

        self.client = redis.Redis.from_url(url)
        self.name, self.ttl_s = run_name, max(int(ttl_s + 0.999), 1)

    def write(self, snap: dict[str, Any]) -> None:
        data = json.dumps({**snap, "heartbeat_ttl_s": self.ttl_s})  # a reader ages the heartbeat by the key's TTL
        pipe = self.client.pipeline(transaction=True)
        pipe.set(status_key(self.name), data, ex=self.ttl_s)
        pipe.set(status_key(self.name) + ":last", data, ex=LAST_TTL_S)
        pipe.zadd(RUNS_KEY, {self.name: snap["time"]})
        pipe.execute()

    def close(self) -> None:
        self.client.close()


class StatusReporter:
    """Writes a snapshot every `interval_s`; `ttl_s` (Redis heartbeat) defaults to 5 intervals, at least 10 s."""

    def __init__(self, source: RunSource, interval_s: float = 1.0, ttl_s: float | None = None) -> None:
        self.interval_s = interval_s
        self.run_dir = source.info.dir
        self.builder = SnapshotBuilder(source, interval_s=interval_s)
        self.redis: RedisStatus | None = None
        info = source.info
        if info.queue_backend == "redis":
            self.redis = RedisStatus(info.redis_url, info.name, ttl_s or max(5 * interval_s, 10.0))

    async def write(self, snap: dict[str, Any]) -> None:
        await asyncio.to_thread(write_json, self.run_dir / "status.json", snap)
        if self.redis is not None:
            await asyncio.to_thread(self.redis.write, snap)

    async def tick(self) -> dict[str, Any]:
        snap = await self.builder.build("running")
        await self.write(snap)
        return snap

    async def run(self) -> None:
        while True:
            await self.tick()
            await asyncio.sleep(self.interval_s)

    async def final(self) -> None:
        """The last snapshot, with the end state. Called from the controller's `finally:` the
        exception in flight there, if any, is the run's error; a failure to write the snapshot
        never hides it."""
        error = sys.exc_info()[1]
        state = "finished" if error is None else "failed"
        try:
            snap = await self.builder.build(state, f"{type(error).__name__}: {error}"[:500] if error is not None else None)
            await self.write(snap)
            await asyncio.to_thread(write_json, self.run_dir / FINAL_FILE, snap)
        except Exception:
            if error is None:
                raise
        finally:
            if self.redis is not None:
                self.redis.close()
