"""A server that dies while a shrink drains it: the resize finishes and the death is a preemption, not replaced."""

import asyncio

from asyncrl.engines.base import SamplingParams
from asyncrl.rollout.fleet import FleetManager
from asyncrl.rollout.fleet_build import Fleet
from asyncrl.rollout.router import Router
from tests.unit.fleet.fakes import ScriptedServer


def test_a_server_that_dies_while_it_drains_is_a_preemption_and_the_shrink_finishes():
    async def go():
        servers = [ScriptedServer(f"main-{i}") for i in range(3)]
        manager = FleetManager(Router())
        await manager.add_fleet(Fleet("main", servers))
        calls = [asyncio.create_task(manager.router.generate([1, 2], SamplingParams(max_tokens=4))) for _ in range(3)]
        await asyncio.sleep(0)
        assert all(s.open for s in servers)  # one request on each
        shrink = asyncio.create_task(manager.resize("main", 1))
        await asyncio.sleep(0)
        servers[2].die()  # the newest, drained first: preempted mid-drain; its request moves to main-0
        await asyncio.sleep(0.01)
        for s in servers[:2]:
            s.release()
        await asyncio.sleep(0.01)
        servers[0].release()
        out = await asyncio.wait_for(shrink, 5)
        assert out["to"] == 1 and len(await asyncio.gather(*calls)) == 3
        kinds = [(e["kind"], e["server"], e.get("replaced")) for e in manager.events]
        assert ("preempt", "main-2", False) in kinds and manager.size() == {"main": 1}
    asyncio.run(go())


def test_a_shrink_gives_up_a_server_coming_back_before_a_routed_one():
    """A node vanished: its server missed a publish and is being re-synced (out of routing) when the shrink
    to the room left comes. The shrink takes that one, not the routed healthy server (it used to leave the
    ones coming back out of its choice: it drained the healthy one and the fleet had none)."""
    async def go():
        servers = [ScriptedServer(f"main-{i}") for i in range(2)]
        manager = FleetManager(Router())
        await manager.add_fleet(Fleet("main", servers))
        manager.router.remove(servers[0])  # what `_take_out` does before the re-sync
        never = asyncio.Event()
        manager._background(manager._counted(servers[0], never.wait()))  # the re-sync, stuck on the gone node
        await asyncio.sleep(0)
        out = await asyncio.wait_for(manager.resize("main", 1), 5)
        assert out["drained"] == ["main-0"] and manager.router.servers == [servers[1]], out
        never.set()
    asyncio.run(go())
