"""A group's samples cross to a server in one call (`run_group_moving`, Ray fleets): the records come back
in order, counted as the group's size in flight there; when that server dies under the call, each sample
moves alone as a sample call would (`run_moving`): from the dead server's snapshot of it where there is one
(`continued`, the snapshot freed), else from its prompt (`redone`), and the router counts every sample moved.

Scripted hosts (no model, no Ray): only the routing and the hand-on are under test; the Ray path is run
by the suite's Ray pipeline and fault tests."""

from __future__ import annotations

import asyncio

import pytest

from asyncrl.rollout.resume import run_group_moving
from asyncrl.rollout.router import Router, ServerDied


class Record:
    def __init__(self, uid: str, host: str, resumed: int = 0) -> None:
        self.uid, self.host = uid, host
        self.meta = {"meta": {"resumed_tokens": resumed}}


class Sample:
    def __init__(self, uid: str) -> None:
        self.uid = uid


class Host:
    def __init__(self, name: str) -> None:
        self.name = name
        self.snapshots: dict[str, str] = {}
        self.group_calls: list[list[str]] = []
        self.sample_calls: list[tuple[str, object, object]] = []
        self.gate = asyncio.Event()
        self.dead = False
        self.seen_in_flight: list[int] = []

    async def run_samples(self, samples):
        self.group_calls.append([s.uid for s in samples])
        await self.gate.wait()
        if self.dead:
            raise ServerDied(f"{self.name} died")
        return [Record(s.uid, self.name) for s in samples]

    async def run_sample(self, sample, resume=None, resume_from=None):
        self.sample_calls.append((sample.uid, resume, resume_from))
        return Record(sample.uid, self.name, resumed=7 if resume_from is not None else 0)


def test_a_group_runs_in_one_call_counted_as_its_size_and_returns_its_records_in_order():
    async def go():
        a, b = Host("a"), Host("b")
        router = Router([a, b])
        samples = [Sample(f"g-{i}") for i in range(4)]
        task = asyncio.ensure_future(run_group_moving(router, samples))
        await asyncio.sleep(0)
        assert router.in_flight == [4, 0]  # the group's size: the next group goes to the other server
        assert router.pick().server is b
        a.gate.set()
        out = await task
        assert [r.uid for r, _ in out] == [s.uid for s in samples] and all(f is None for _, f in out)
        assert all(r.host == "a" for r, _ in out) and a.group_calls == [[s.uid for s in samples]]
        assert router.in_flight == [0, 0] and router.failovers == 0

    asyncio.run(go())


def test_a_server_dying_under_a_group_hands_each_sample_on_alone_from_its_snapshot():
    async def go():
        a, b = Host("a"), Host("b")
        dead = []
        router = Router([a, b], on_dead=lambda server, exc: dead.append(server.name))
        samples = [Sample(f"g-{i}") for i in range(3)]
        task = asyncio.ensure_future(run_group_moving(router, samples, free=freed.extend))
        await asyncio.sleep(0)
        a.snapshots = {"g-0": "snap-0", "g-2": "snap-2"}  # the health probe's last snapshots of two of them
        a.dead = True
        a.gate.set()
        out = await task
        assert dead == ["a"] and router.servers == [b] and router.failovers == 3
        assert [r.uid for r, _ in out] == ["g-0", "g-1", "g-2"] and all(r.host == "b" for r, _ in out)
        assert [f for _, f in out] == ["continued", "redone", "continued"]
        assert sorted(b.sample_calls, key=lambda c: c[0]) == [("g-0", None, "snap-0"), ("g-1", None, None), ("g-2", None, "snap-2")]
        assert sorted(freed) == ["snap-0", "snap-2"] and a.snapshots == {}  # the dead server's snapshots, freed once

    freed: list[str] = []
    asyncio.run(go())


def test_a_group_whose_every_server_dies_fails_like_a_sample():
    async def go():
        a = Host("a")
        router = Router([a], max_failovers=1)
        task = asyncio.ensure_future(run_group_moving(router, [Sample("g-0"), Sample("g-1")]))
        await asyncio.sleep(0)
        a.dead = True
        a.gate.set()
        with pytest.raises(Exception):  # no server left: each sample's move finds none
            await task

    asyncio.run(go())
