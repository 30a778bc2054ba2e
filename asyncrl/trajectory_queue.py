"""Where finished groups wait for the trainer, in the embedded (single-process) pipeline.

`GroupQueue` holds whole groups (GRPO groups are delivered whole) in arrival order and
hands the trainer `n` of them, dropping and counting any that exceed the staleness
bound at the moment they are taken. It is the in-process stand-in for a TransferQueue
consumer: same verbs (`put`, `get`), no tensors, no network.
"""

from __future__ import annotations

import asyncio
from collections import deque

from asyncrl.staleness import StalenessManager
from asyncrl.types import Trajectory


class GroupQueue:
    def __init__(self, staleness: StalenessManager) -> None:
        self._groups: deque[list[Trajectory]] = deque()
        self._staleness = staleness
        self._ready = asyncio.Condition()
        self.put_groups = 0
        self.taken_groups = 0

    def __len__(self) -> int:
        return len(self._groups)

    async def put(self, group: list[Trajectory]) -> None:
        async with self._ready:
            self._groups.append(group)
            self.put_groups += 1
            self._ready.notify_all()

    async def get(self, n: int) -> list[list[Trajectory]]:
        """Wait for `n` groups within the staleness bound; stale ones are dropped and counted."""
        out: list[list[Trajectory]] = []
        while len(out) < n:
            async with self._ready:
                await self._ready.wait_for(lambda: len(self._groups) > 0)
                group = self._groups.popleft()
            if self._staleness.too_stale(min(t.min_version for t in group)):
                await self._staleness.drop_accepted("stale")
                continue
            out.append(group)
        self.taken_groups += len(out)
        return out
