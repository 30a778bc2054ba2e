"""`LoopLag`: a loop kept busy by a blocking callback shows that block as lag; an idle one shows next to none."""

import asyncio
import time

import pytest

from asyncrl.observe.loop_lag import LoopLag


def test_a_blocked_loop_shows_its_block_and_an_idle_one_none():
    async def go():
        lag = LoopLag(interval_s=0.01)
        task = asyncio.ensure_future(lag.run())
        assert lag.take() == {}  # nothing measured yet
        await asyncio.sleep(0.2)
        idle = lag.take()
        await asyncio.sleep(0.02)
        time.sleep(0.15)  # a callback that holds the loop for 150 ms
        await asyncio.sleep(0.05)
        busy = lag.take()
        task.cancel()
        return idle, busy

    idle, busy = asyncio.run(go())
    assert idle["controller/loop_lag_ms_max"] < 100  # a shared 2-core machine: a margin, not a timing target
    assert busy["controller/loop_lag_ms_max"] >= 120
    assert busy["controller/loop_lag_ms_mean"] <= busy["controller/loop_lag_ms_max"]


def test_the_interval_must_be_positive():
    with pytest.raises(ValueError, match="interval_s"):
        LoopLag(0)
