"""Periodic status snapshots of a running pipeline (heartbeat for `asyncrl status`).

Minimal first version: writes `snapshot(pipeline)` to `<run_dir>/status.json` every
`interval_s` seconds. The controller starts it as a task and cancels it at the end.
"""

from __future__ import annotations

import asyncio
from typing import Any

from asyncrl.run_dir import write_status


def snapshot(pipeline: Any) -> dict[str, Any]:
    return {"state": "running", "step": pipeline.step, "version": pipeline.staleness.version}


class StatusReporter:
    def __init__(self, pipeline: Any, interval_s: float = 1.0) -> None:
        self.pipeline, self.interval_s = pipeline, interval_s

    async def run(self) -> None:
        while True:
            write_status(self.pipeline.run_dir, **snapshot(self.pipeline))
            await asyncio.sleep(self.interval_s)
