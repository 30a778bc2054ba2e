"""How late the controller's event loop runs what is due: its lag, the first sign of a controller that cannot
keep up (every sample's bookkeeping, publish and health round shares this one thread).

A task sleeps `interval_s` at a time and measures how much later than due it woke; `take()` returns the mean
and the most of those overshoots since the last `take` (the controller logs them per step as
`controller/loop_lag_ms_mean` and `controller/loop_lag_ms_max`; `asyncrl bench controller` reports them).
Its own cost: `1 / interval_s` wake-ups a second (20 by default).
"""

from __future__ import annotations

import asyncio


class LoopLag:
    def __init__(self, interval_s: float = 0.05) -> None:
        if not interval_s > 0:
            raise ValueError(f"LoopLag: interval_s must be > 0, got {interval_s}")
        self.interval_s = interval_s
        self._sum = self._max = 0.0
        self._n = 0

    async def run(self) -> None:
        """Measure until cancelled."""
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + self.interval_s
            await asyncio.sleep(self.interval_s)
            lag = max(0.0, loop.time() - due)
            self._sum += lag
            self._max = max(self._max, lag)
            self._n += 1

    def take(self) -> dict[str, float]:
        """`controller/loop_lag_ms_mean` and `_max` since the last call (empty before a first measurement); resets."""
        if not self._n:
            return {}
        out = {"controller/loop_lag_ms_mean": round(self._sum / self._n * 1000, 3),
               "controller/loop_lag_ms_max": round(self._max * 1000, 3)}
        self._sum = self._max = 0.0
        self._n = 0
        return out
