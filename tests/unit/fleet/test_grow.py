"""`Fleet.grow` tells each new server as it is up (a slow start does not hold a fast one back), and
`startup_split` says where a server's start went."""

import asyncio

from asyncrl.rollout.fleet_build import Fleet
from asyncrl.rollout.remote_server import startup_split


def test_grow_tells_each_server_as_it_is_up_and_reports_those_that_failed():
    delays = {1: 0.3, 2: 0.0, 3: 0.1}
    told: list[tuple[str, float]] = []

    servers = {i: f"server-{i}" for i in range(4)}

    async def make(i: int) -> str:
        await asyncio.sleep(delays[i])
        if i == 3:
            raise RuntimeError("no room")
        return servers[i]

    released: list[int] = []

    async def go():
        fleet = Fleet("main", [servers[0]], make=make, release_one=released.append)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        new, errors = await fleet.grow(3, on_up=lambda s: told.append((s, loop.time() - t0)))
        return fleet, new, errors

    fleet, new, errors = asyncio.run(go())
    assert [s for s, _ in told] == ["server-2", "server-1"] == new  # in the order they came up
    assert told[0][1] < 0.2 <= told[1][1]  # the fast one was told before the slow one was up
    assert [str(e) for e in errors] == ["no room"] and released == [3]
    assert sorted(zip(fleet.indices, fleet.servers)) == [(0, "server-0"), (1, "server-1"), (2, "server-2")]
    assert fleet.index_of(servers[1]) == 1


def test_startup_split_adds_up_and_counts_a_prestarted_worker_from_the_request():
    split = startup_split(100.0, {"process_at": 101.0, "init_at": 104.5, "built_at": 106.0}, 106.25)
    assert split == {"queued_s": 1.0, "imports_s": 3.5, "build_s": 1.5, "total_s": 6.25}
    # a worker Ray had started before the request: nothing queued, its imports counted from the request
    split = startup_split(100.0, {"process_at": 90.0, "init_at": 100.5, "built_at": 101.0}, 101.5)
    assert split == {"queued_s": 0.0, "imports_s": 0.5, "build_s": 0.5, "total_s": 1.5}
    # an OS that does not say when the process started (0.0)
    assert startup_split(100.0, {"process_at": 0.0, "init_at": 102.0, "built_at": 103.0}, 103.0)["imports_s"] == 2.0


def test_a_resume_goes_on_with_the_servers_it_took_back_and_starts_the_gone_ones_meanwhile(monkeypatch):
    """A resumed detached run whose server 0 died while no controller ran: `FleetManager.spawn` returns with
    the server it took back routed, before the new server 0 is up (a resume used to wait for that start,
    seconds of a new process, with the fleet idle); the new one starts in its own index and, once up, joins
    at the current version and is routed."""
    from asyncrl.config import RolloutConfig
    from asyncrl.rollout.fleet import FleetManager

    from .fakes import ScriptedServer
    from .test_router import Weights

    kept = ScriptedServer("main-1", hold=False)
    up = asyncio.Event()
    started: list[int] = []

    async def make(i: int) -> ScriptedServer:
        started.append(i)
        await up.wait()
        return ScriptedServer(f"main-{i}", hold=False)

    async def spawn(cls, name, cfg, model_path, **kw):
        return Fleet(name, [kept], make=make, indices=[1])

    monkeypatch.setattr(Fleet, "spawn", classmethod(spawn))

    async def go():
        manager = await asyncio.wait_for(FleetManager.spawn(RolloutConfig(num_servers=2), "unused", dtype="float32", seed=0), 2)
        assert manager.router.servers == [kept]  # taken back and routed: the run goes on with it
        await asyncio.sleep(0.05)
        assert started == [0]  # the gone server's index, starting meanwhile
        weights = Weights(manager)
        await manager.attach_weights(weights, cfg=None)
        await manager.publish(7)
        up.set()
        for _ in range(100):  # up: it joins (these fakes cannot hand out weights, so the next publish routes it)
            if any(e["kind"] == "join_pending" for e in manager.events):
                break
            await asyncio.sleep(0.02)
        await manager.publish(8)
        fleet = manager.fleets["main"]
        assert sorted(fleet.indices) == [0, 1] and sorted(s.name for s in manager.router.servers) == ["main-0", "main-1"]
        assert [s.v for s in manager.router.servers] == [8, 8]
        assert [e["kind"] for e in manager.events if e["server"] == "main-0"][:2] == ["start", "join_pending"]

    asyncio.run(go())
