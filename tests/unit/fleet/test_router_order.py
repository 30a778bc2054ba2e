"""The router's least-loaded pick without a scan (`_LoadOrder`, a heap) picks exactly what a scan picks:
fewest requests in flight among the active servers of the fleet asked for, ties to the one added first,
through random starts and ends of requests, servers added, removed, drained and taken out, over two fleets;
and its heap stays O(servers) however many requests come and go."""

from __future__ import annotations

import asyncio
import random

import pytest

from asyncrl.rollout.router import NoServerError, Router, ServerDied

from .fakes import ScriptedServer


def scan(router: Router, fleet: str | None):
    """The pick as a scan over the slots in added order (the router's rule before the heap)."""
    live = [s for s in router.slots() if s.state == "active" and fleet in (None, s.fleet)]
    return min(live, key=lambda s: s.in_flight) if live else None


@pytest.mark.parametrize("seed", range(6))
def test_the_heap_pick_is_the_scan_pick_through_random_load_and_membership(seed):
    async def go():
        rng = random.Random(seed)
        router = Router()
        servers: list[ScriptedServer] = []
        running: list = []  # (slot, future): a request in flight on slot, ended when the future is set
        drains: list[asyncio.Task] = []

        def add():
            s = ScriptedServer(f"s{len(servers)}")
            servers.append(s)
            router.add(s, rng.choice(["main", "math"]))

        for _ in range(5):
            add()
        checked = 0
        for _ in range(3000):
            op = rng.random()
            if op < 0.45:  # a request starts on the pick of a random fleet (or none)
                fleet = rng.choice([None, "main", "math"])
                expected = scan(router, fleet)
                if expected is None:
                    with pytest.raises(NoServerError):
                        router.pick(fleet=fleet)
                    continue
                slot = router.pick(fleet=fleet)
                assert slot is expected, (slot.server.name, expected.server.name)
                checked += 1
                done = asyncio.get_running_loop().create_future()
                running.append((slot, asyncio.ensure_future(router._run(slot, done)), done))
            elif op < 0.85 and running:  # one ends
                slot, task, done = running.pop(rng.randrange(len(running)))
                done.set_result(None)
                await task
            elif op < 0.90:
                add()
            elif op < 0.94 and router.servers:
                router.remove(rng.choice(router.servers))
            elif op < 0.97 and router.servers:
                router.take_out(rng.choice(router.servers), ServerDied("gone"))
            elif router.servers:
                drains.append(asyncio.ensure_future(router.drain(rng.choice(router.servers))))
                await asyncio.sleep(0)
            for order in router._order.values():
                assert len(order.heap) <= 4 * len(order.slots) + 17
        for _, task, done in running:
            done.set_result(None)
            await task
        await asyncio.gather(*drains)
        assert checked > 800
        assert all(s.in_flight == 0 for s in router.slots())

    asyncio.run(go())


def test_ties_go_to_the_server_added_first_and_a_readded_server_comes_last():
    async def go():
        s = [ScriptedServer(f"s{i}") for i in range(3)]
        router = Router(s)
        assert router.pick().server is s[0]
        router.remove(s[0])
        router.add(s[0])  # back, behind the others
        assert [router.pick().server for _ in range(1)] == [s[1]]
        busy = asyncio.get_running_loop().create_future()
        task = asyncio.ensure_future(router._run(router.pick(), busy))
        await asyncio.sleep(0)
        assert router.pick().server is s[2]
        busy.set_result(None)
        await task
        assert router.pick().server is s[1]

    asyncio.run(go())
