"""A server's data-plane back-pressure reaches the fleet's stats: its host adds its plane's arena waits."""

import asyncio
import threading
import time

import numpy as np
import pytest

from asyncrl.rollout.fleet import FleetManager
from asyncrl.rollout.fleet_build import Fleet
from asyncrl.rollout.host import ServerHost
from asyncrl.rollout.router import Router
from tests.unit.fleet.fakes import ScriptedServer
from transfer_queue.storage.shm import ShmStorage


@pytest.mark.timeout(20)
def test_a_server_whose_arena_is_full_shows_its_wait_in_the_fleet_stats(tmp_path):
    plane = ShmStorage(shm_dir=str(tmp_path), run_id="fleet-bp", arena_bytes=64 << 10)
    host = ServerHost(ScriptedServer("main-0"), name="main-0", agent=None, eval_agent=None, plane=plane)
    first = plane.write("u0", {"x": np.zeros(48 << 10, dtype=np.uint8)})["x"]
    second = threading.Thread(target=plane.write, args=("u1", {"x": np.ones(48 << 10, dtype=np.uint8)}))
    second.start()

    async def go():
        manager = FleetManager(Router())
        await manager.add_fleet(Fleet("main", [host]))
        deadline = time.monotonic() + 4
        while host.stats().arena_waiting != 1 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        waiting = (await manager.stats())["fleets"]["main"]
        plane.free([first])
        await asyncio.to_thread(second.join, 4)
        done = (await manager.stats())["fleets"]["main"]
        await manager.close()
        return waiting, done

    try:
        waiting, done = asyncio.run(go())
    finally:
        plane.close()
    row = waiting["servers"][0]
    assert (row["arena_waits"], row["arena_waiting"], waiting["arena_waiting"]) == (1, 1, 1)
    row = done["servers"][0]
    assert (row["arena_waits"], row["arena_waiting"], done["arena_waiting"]) == (1, 0, 0) and row["arena_wait_s"] > 0
