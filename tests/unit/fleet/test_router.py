"""Router policy (least in-flight, sticky sessions), failover, partial rollouts and drains, on
scripted servers (no model: the tests must control when each request ends)."""

from __future__ import annotations

import asyncio

import pytest

from checkpoint_engine.membership import DISCONNECTED, STRAGGLER, TIMEOUT

from asyncrl.engines.base import SamplingParams
from asyncrl.rollout.fleet import FleetManager
from asyncrl.rollout.fleet_build import Fleet
from asyncrl.rollout.partial import segment_seed
from asyncrl.rollout.router import NoServerError, Router, ServerDied

from .fakes import ScriptedServer

SP = SamplingParams(max_tokens=6, seed=11)


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_least_in_flight_balance_and_stickiness():
    async def go():
        s = [ScriptedServer(f"s{i}") for i in range(3)]
        r = Router(s)
        tasks = [asyncio.create_task(r.generate([i], SP)) for i in range(6)]
        await settle()
        assert r.in_flight == [2, 2, 2] and [len(x.open) for x in s] == [2, 2, 2]
        s[1].release()
        await asyncio.gather(*tasks[1::3])
        assert r.in_flight == [2, 0, 2]
        t = asyncio.create_task(r.generate([9], SP))  # the idle server gets it
        await settle()
        assert s[1].served[-1][0] == [9]
        # session "a": first turn to the least loaded (s1), later turns stay there although s1 is busiest
        turns = []
        for turn in range(3):
            turns.append(asyncio.create_task(r.generate([100 + turn], SP, session_id="a")))
            await settle()
        assert [p for p, _ in s[1].served if p[0] >= 100] == [[100], [101], [102]]
        for x in s:
            x.release()
        outs = await asyncio.gather(*tasks, t, *turns)
        assert all(o.finish_reason == "length" and len(o.token_ids) == 6 for o in outs)
        assert r.in_flight == [0, 0, 0]

    asyncio.run(go())


def test_dead_server_request_fails_over_once():
    async def go():
        s0, s1 = ScriptedServer("s0", token=1), ScriptedServer("s1", token=2, hold=False)
        dead = []
        r = Router([s0, s1], on_dead=lambda srv, exc: dead.append(srv))
        t = asyncio.create_task(r.generate([5], SP, session_id="x"))  # -> s0
        await settle()
        s0.die()
        out = await t
        assert out.token_ids == [2] * 6 and out.finish_reason == "length"  # one result, from s1
        assert dead == [s0] and r.servers == [s1] and r.failovers == 1
        assert len(s1.served) == 1 and s1.served[0][0] == [5]
        r.take_out(s0, ServerDied("again"))  # a second report of the same death is ignored
        assert dead == [s0]
        assert (await r.generate([6], SP, session_id="x")).token_ids == [2] * 6  # session moved

    asyncio.run(go())


def test_failover_is_bounded():
    async def go():
        s = [ScriptedServer(f"s{i}") for i in range(3)]
        for x in s:
            x.dead = True
        r = Router(s, max_failovers=1)
        with pytest.raises(ServerDied, match="failed over 1 times"):
            await r.generate([1], SP)
        assert len(r.servers) == 1
        with pytest.raises(NoServerError):
            await Router([], max_failovers=1).generate([1], SP)

    asyncio.run(go())


def test_aborted_request_resumes_with_tokens_so_far():
    async def go():
        s0 = ScriptedServer("s0", token=3, k=2)
        r = Router([s0])
        t = asyncio.create_task(r.generate([8, 9], SP))
        await settle()
        s0.abort_all()  # weight update in abort mode: 2 tokens at version 0
        await settle()
        s0.v = 1
        s0.release()
        out = await t
        (p0, sp0), (p1, sp1) = s0.served
        assert p1 == [8, 9, 3, 3] and sp1.max_tokens == 4 and sp1.seed == segment_seed(11, 2) != 11
        assert out.token_ids == [3] * 6 and out.versions == [0, 0, 1, 1, 1, 1] and out.finish_reason == "length"
        assert r.resubmits == 1
        r.partial_rollouts = False
        t = asyncio.create_task(r.generate([8], SP))
        await settle()
        s0.abort_all()
        assert (await t).finish_reason == "abort"

    asyncio.run(go())


def test_drain_finishes_requests_and_takes_no_new_ones():
    async def go():
        s0, s1 = ScriptedServer("s0"), ScriptedServer("s1", hold=False)
        r = Router([s0, s1])
        t = asyncio.create_task(r.generate([1], SP))  # -> s0, held
        await settle()
        drain = asyncio.create_task(r.drain(s0))
        await settle()
        assert not drain.done() and r.servers == [s1]
        await r.generate([2], SP)
        assert len(s0.served) == 1
        s0.release()
        await drain
        assert (await t).token_ids == [7] * 6 and r.slots()[0].server is s1

    asyncio.run(go())


def respawner(make):
    """(the servers a fleet started so far, its `respawn`: `make(index)` for each)."""
    made = []

    async def respawn(i: int):
        made.append(make(i))
        return made[-1]

    return made, respawn


class Weights:
    """Stands in for the trainer's weight plane: a publish 'loads' the version into every named
    server that is alive (`update_weights`); a dead one is left out and reported evicted."""

    endpoint = "inproc://weights"
    endpoints = [endpoint]

    def __init__(self, manager: FleetManager) -> None:
        self.manager, self.version, self.calls = manager, -1, []

    async def _send(self, version, receivers):
        out = {"version": version, "completed": [], "evicted": {}}
        for s in self.manager.servers:
            if s.name in receivers:
                try:
                    await s.update_weights([], version)
                    out["completed"].append(s.name)
                except ServerDied:
                    out["evicted"][s.name] = "timeout"
        return out

    async def publish(self, version, receivers, probe=None):
        self.version = version
        self.calls.append(("publish", version, sorted(receivers)))
        return await self._send(version, receivers)

    async def sync(self, receivers, resend=False, probe=None):
        self.calls.append(("sync", self.version, sorted(receivers)))
        return await self._send(self.version, receivers)


def test_manager_restarts_dead_server_at_current_version():
    async def go():
        made, respawn = respawner(lambda i: ScriptedServer(f"s{i}", hold=False))

        s0, s1 = ScriptedServer("s0"), ScriptedServer("s1", hold=False)
        manager = FleetManager(Router())
        await manager.add_fleet(Fleet("main", [s0, s1], respawn))
        weights = Weights(manager)
        await manager.attach_weights(weights, cfg=None)
        await manager.publish(4)
        assert (s0.v, s1.v, manager.version) == (4, 4, 4)
        late = ScriptedServer("late", hold=False)
        await manager.add_fleet(Fleet("extra", [late]))  # joins at the current version
        assert late.v == 4 and weights.calls[-1] == ("sync", 4, ["late"])
        t = asyncio.create_task(manager.router.generate([1], SP, fleet="main"))
        await settle()
        assert len(s0.open) == 1
        s0.die()
        assert len((await t).token_ids) == 6
        await manager.wait_restarts()
        assert made[0].v == 4 and made[0] in manager.router.servers and s0 not in manager.router.servers
        assert weights.calls[-1] == ("sync", 4, ["s0"])  # only the fresh server was sent the weights
        stats = await manager.stats()
        assert stats["restarts"] == 1 and stats["failovers"] == 1
        assert [row["version"] for row in stats["fleets"]["main"]["servers"]] == [4, 4]
        await manager.remove_fleet("extra")
        assert late not in manager.router.servers

    asyncio.run(go())


def test_publish_reaches_routed_servers_only_and_a_missed_one_is_resynced_or_restarted():
    async def go():
        made, respawn = respawner(lambda i: ScriptedServer(f"s{i}", hold=False))

        s0, s1, s2 = ScriptedServer("s0"), ScriptedServer("s1"), ScriptedServer("s2")
        manager = FleetManager(Router())
        await manager.add_fleet(Fleet("main", [s0, s1, s2], respawn))
        weights = Weights(manager)
        await manager.attach_weights(weights, cfg=None)
        manager.router.remove(s2)  # e.g. drained: not taking requests
        s1.dead = True
        m = await manager.publish(2)  # s1's death does not fail the publish
        assert weights.calls[0] == ("publish", 2, ["s0", "s1"]) and m["weights/evicted"] == 1.0
        await manager.wait_restarts()  # s1: re-sync fails (dead) -> restarted, synced, routed
        assert s0.v == 2 and made[0].v == 2 and manager.router.servers == [s0, made[0]]
        assert s2.v == 0 and manager.evicted == {"s1": "timeout"}

    asyncio.run(go())


class Plane(ScriptedServer):
    """A server on the weight plane: it joins it and answers the health probe."""

    def __init__(self, name: str, **kw) -> None:
        super().__init__(name, **kw)
        self.joins = 0

    async def join_weights(self, cfg, endpoints, pause_mode="keep") -> None:
        self._alive()
        self.joins += 1

    async def probe(self) -> None:
        self._alive()


class LostConnections(Weights):
    """A publish hears nothing from `lost` (evicted as `reason`: `disconnected` by default); a sync to a
    dead server waits for its connection, as the trainer's does (`SYNC_JOIN_S`), counted in `waited`."""

    def __init__(self, manager: FleetManager, lost: set[str], reason: str = DISCONNECTED) -> None:
        super().__init__(manager)
        self.lost, self.waited, self.reason = lost, [], reason

    async def publish(self, version, receivers, probe=None):
        out = await super().publish(version, [r for r in receivers if r not in self.lost])
        out["evicted"].update({r: self.reason for r in receivers if r in self.lost})
        self.lost = set()
        return out

    async def sync(self, receivers, resend=False, probe=None):
        dead = [s.name for s in self.manager.servers if s.name in receivers and s.dead]
        self.waited += dead
        out = await super().sync(receivers, resend, probe)
        out["evicted"].update({r: "not joined" for r in dead})
        return out


@pytest.mark.parametrize("dead", [True, False])
def test_a_server_the_weight_plane_lost_is_probed_first_dead_restarted_live_joined_again(dead):
    async def go():
        made, respawn = respawner(lambda i: Plane(f"s{i}", hold=False))

        s0, s1 = Plane("s0", hold=False), Plane("s1", hold=False)
        manager = FleetManager(Router())
        await manager.add_fleet(Fleet("main", [s0, s1], respawn))
        weights = LostConnections(manager, lost={"s1"})
        await manager.attach_weights(weights, cfg=None)
        assert s1.joins == 1
        s1.dead = dead  # its process died (the plane saw its connection go), or only the connection did
        await manager.publish(3)
        await manager.wait_restarts()
        assert manager.evicted == {"s1": DISCONNECTED}
        assert weights.waited == []  # nothing was sent to the dead one: the trainer never waited for it
        if dead:
            assert [s.name for s in made] == ["s1"] and manager.router.servers == [s0, made[0]] and made[0].v == 3
        else:
            assert made == [] and s1.joins == 2 and s1.v == 3 and s1 in manager.router.servers
        assert weights.calls[-1] == ("sync", 3, ["s1"])

    asyncio.run(go())


@pytest.mark.parametrize("reason", [STRAGGLER, TIMEOUT])
@pytest.mark.parametrize("dead", [True, False])
def test_a_server_the_weight_plane_did_not_hear_is_probed_before_its_sync(reason, dead):
    """The chaos run found it: a hung server was evicted from a publish as a straggler, and its re-sync
    held the trainer (and the next step behind it) 5 s waiting for a receiver that would never join
    again. Now a silent one is probed first: dead (or hung: the probe times out) -> restarted without a
    sync; alive -> re-synced as before (no new join: its connection held)."""
    async def go():
        made, respawn = respawner(lambda i: Plane(f"s{i}", hold=False))
        s0, s1 = Plane("s0", hold=False), Plane("s1", hold=False)
        manager = FleetManager(Router())
        await manager.add_fleet(Fleet("main", [s0, s1], respawn))
        weights = LostConnections(manager, lost={"s1"}, reason=reason)
        await manager.attach_weights(weights, cfg=None)
        s1.dead = dead
        await manager.publish(3)
        await manager.wait_restarts()
        assert manager.evicted == {"s1": reason} and weights.waited == []
        if dead:
            assert [s.name for s in made] == ["s1"] and manager.router.servers == [s0, made[0]] and made[0].v == 3
            assert ("sync", 3, ["s1"]) not in weights.calls[:-1]  # only the replacement's sync
        else:
            assert made == [] and s1.joins == 1 and s1.v == 3 and s1 in manager.router.servers
            assert weights.calls[-1] == ("sync", 3, ["s1"]) and manager.answering() == [s0, s1]

    asyncio.run(go())


def test_a_checkpoint_does_not_ask_a_server_that_is_silent_until_its_probe_answers():
    """The chaos run found it: a checkpoint just after a hung server's eviction asked every server for its
    partial samples and waited `rollout.health_timeout_s` for the hung one, the trainer's loop with it."""
    class Hung(Plane):
        def __init__(self, name: str, **kw) -> None:
            super().__init__(name, **kw)
            self.release = asyncio.Event()

        async def probe(self) -> None:
            await self.release.wait()  # no answer until the probe's timeout, which says: hung
            raise ServerDied(f"{self.name} is hung")

    async def go():
        made, respawn = respawner(lambda i: Plane(f"s{i}", hold=False))
        s0, s1 = Plane("s0", hold=False), Hung("s1", hold=False)
        manager = FleetManager(Router())
        await manager.add_fleet(Fleet("main", [s0, s1], respawn))
        await manager.attach_weights(LostConnections(manager, lost={"s1"}, reason=STRAGGLER), cfg=None)
        assert manager.answering() == [s0, s1]
        await manager.publish(3)
        await asyncio.sleep(0.05)
        assert manager.answering() == [s0]  # evicted as silent, its probe pending
        s1.release.set()
        await manager.wait_restarts()
        assert manager.servers == [s0, made[0]] and manager.answering() == [s0, made[0]]

    asyncio.run(go())


def test_a_trainer_that_dies_during_a_restarts_sync_is_the_trainers_death_not_the_servers():
    """The chaos run found it: a server was restarted, the trainer rank died during the fresh server's
    sync, and the fleet took that for the server's failure (it started another server, and the run
    failed with the next train step's IndexError instead of restarting). Now the fleet stops at once
    and raises `TrainerDied` (the run restarts its processes), and the group stays dead for every verb."""
    from asyncrl.trainer.actor import TrainerGroup
    from asyncrl.trainer.rank import TrainerDied

    class DyingWeights(Weights):
        async def sync(self, receivers, resend=False, probe=None):
            self.calls.append(("sync", self.version, sorted(receivers)))
            raise TrainerDied("trainer rank 0 died during sync: ActorDiedError")

    async def go():
        made, respawn = respawner(lambda i: ScriptedServer(f"s{i}", hold=False))

        s0, s1 = ScriptedServer("s0", hold=False), ScriptedServer("s1", hold=False)
        manager = FleetManager(Router())
        await manager.add_fleet(Fleet("main", [s0, s1], respawn))
        weights = DyingWeights(manager)
        await manager.attach_weights(weights, cfg=None)
        await manager.publish(1)
        s0.die()
        await manager.router.generate([1], SP)  # fails over to s1; s0 is restarted in the background
        with pytest.raises(TrainerDied, match="rank 0 died during sync"):
            await manager.wait_restarts()
        assert len(made) == 1  # one replacement, not START_ATTEMPTS of them
        with pytest.raises(TrainerDied):
            await manager.publish(2)

    asyncio.run(go())
    group = object.__new__(TrainerGroup)  # a group whose rank died in an earlier verb (no Ray needed)
    group.ranks, group._died = [], "trainer rank 1 died during sync: ActorDiedError"
    with pytest.raises(TrainerDied, match="rank 1 died during sync"):
        group.train(b"")


def test_requests_waiting_for_a_restart_that_fails_on_the_trainers_death_stop_with_it_at_once():
    """The chaos quick run hung here: every server was dead, a request waited for the restart
    (`SERVER_WAIT_S`, 600 s), the restart's sync met the trainer's death, and nothing woke the
    request; the status reporter died on the fleet's error and the health loop slept on. Now the
    waiting request and the health loop both raise `TrainerDied` as soon as the restart fails, and
    the fleet's stats (an observer's verb) still answer."""
    from asyncrl.trainer.rank import TrainerDied

    class DyingWeights(Weights):
        async def sync(self, receivers, resend=False, probe=None):
            await asyncio.sleep(0.2)  # the request is waiting by then
            raise TrainerDied("trainer rank 1 died: ActorDiedError")

    async def go():
        async def respawn(i: int) -> ScriptedServer:
            return ScriptedServer(f"s{i}-new", hold=False)

        s0 = ScriptedServer("s0", hold=False)
        manager = FleetManager(Router())
        await manager.add_fleet(Fleet("main", [s0], respawn))
        await manager.attach_weights(DyingWeights(manager), cfg=None)
        await manager.publish(1)
        s0.die()
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        with pytest.raises(TrainerDied, match="rank 1 died"):
            await manager.router.generate([1], SP)  # s0 dies, its restart begins, the request waits for it
        assert loop.time() - t0 < 5.0
        assert (await manager.stats())["restarts"] == 0
        with pytest.raises(TrainerDied):
            await asyncio.wait_for(manager.watch(0.01), 5.0)

    asyncio.run(go())


def test_a_server_slow_to_join_is_left_out_of_routing_not_waited_for():
    """`attach_weights` (after a trainer restart, a hung server among them) waits for the first server's
    join and `JOIN_GRACE_S` more: a server still joining then is taken out of routing and joins in the
    background, so the publish that follows does not wait on it; once it joins it is synced and routed."""
    from asyncrl.rollout import fleet_weights

    class Joining(ScriptedServer):
        def __init__(self, name: str, gate: asyncio.Event | None) -> None:
            super().__init__(name, hold=False)
            self.gate, self.joins = gate, 0

        async def join_weights(self, cfg, endpoints, pause_mode="keep") -> None:
            self.joins += 1
            if self.gate is not None:
                await self.gate.wait()

    async def go():
        gate = asyncio.Event()
        fast, slow = Joining("s0", None), Joining("s1", gate)
        manager = FleetManager(Router())
        await manager.add_fleet(Fleet("main", [fast, slow]))  # no weight source yet: nobody joins
        weights = Weights(manager)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await manager.attach_weights(weights, cfg=None)
        assert loop.time() - t0 < fleet_weights.JOIN_GRACE_S + 1.0
        assert manager.router.servers == [fast]
        await manager.publish(1)
        assert weights.calls == [("publish", 1, ["s0"])]
        gate.set()  # it answers now: joined, synced to version 1, routed
        await manager.wait_restarts()
        assert manager.router.servers == [fast, slow] and slow.v == 1 and slow.joins == 2
        assert weights.calls[-1] == ("sync", 1, ["s1"])
        await manager.close()

    asyncio.run(go())


def test_a_restart_in_flight_when_the_trainer_dies_finishes_with_the_next_trainer():
    """A trainer restart no longer waits for the fleet's restarts in flight (a server's restart takes a
    model load): `detach_weights` forgets the dead source at once, and a restart whose sync then meets
    that source's death joins the new source and is synced by it, instead of failing the run."""
    from asyncrl.trainer.rank import TrainerDied

    class DyingWeights(Weights):
        def __init__(self, manager):
            super().__init__(manager)
            self.gate = asyncio.Event()

        async def sync(self, receivers, resend=False, probe=None):
            await self.gate.wait()
            raise TrainerDied("trainer rank 1 died: ActorDiedError")

    class Joining(ScriptedServer):
        def __init__(self, name: str) -> None:
            super().__init__(name, hold=False)
            self.endpoints: list = []

        async def join_weights(self, cfg, endpoints, pause_mode="keep") -> None:
            self.endpoints.append(list(endpoints))

    async def go():
        made, respawn = respawner(lambda i: Joining(f"s{i}-new"))

        s0, s1 = Joining("s0"), Joining("s1")
        manager = FleetManager(Router())
        await manager.add_fleet(Fleet("main", [s0, s1], respawn))
        old = DyingWeights(manager)
        old.endpoints = ["tcp://old"]
        await manager.attach_weights(old, cfg=None)
        await manager.publish(1)
        s0.die()
        await manager.router.generate([1], SP)  # moves to s1; s0's restart begins and waits in the old source's sync
        await asyncio.sleep(0.05)
        await manager.detach_weights()  # the trainer died; a new one starts
        new = Weights(manager)
        new.endpoints = ["tcp://new"]
        await manager.attach_weights(new, cfg=None)
        old.gate.set()  # the restart's sync meets the old source's death: it joins the new one
        await manager.wait_restarts()
        await manager.publish(2)
        (fresh,) = made
        assert manager.router.servers == [s1, fresh] and fresh.v == 2 and fresh.endpoints[-1] == ["tcp://new"]
        assert new.calls == [("publish", 2, ["s0-new", "s1"])] and manager.restarts == 1
        await manager.close()

    asyncio.run(go())


def test_a_server_that_cannot_be_brought_back_leaves_the_fleet_degraded_not_the_run_stopped(monkeypatch):
    """Its replacement dies at every start (a node that kills what starts on it): after START_ATTEMPTS the
    run goes on with the servers it has, trying again with a back-off, and takes the server back when a
    start succeeds; with no server left, the same failures stop the run."""
    from asyncrl.rollout import fleet_health

    monkeypatch.setattr(fleet_health, "RESTART_BACKOFF_S", 0.01)

    async def go():
        starts = []

        doomed = [False]

        async def respawn(i: int) -> ScriptedServer:
            starts.append(i)
            if len(starts) <= 7 or doomed[0]:
                raise ServerDied(f"s{i} died during start")
            return ScriptedServer(f"s{i}", hold=False)

        s0, s1 = ScriptedServer("s0", hold=False), ScriptedServer("s1", hold=False)
        manager = FleetManager(Router())
        await manager.add_fleet(Fleet("main", [s0, s1], respawn))
        weights = Weights(manager)
        await manager.attach_weights(weights, cfg=None)
        await manager.publish(1)
        s0.die()
        with pytest.raises(ServerDied):
            await s0.generate([1], SP)
        manager.router.take_out(s0, ServerDied("s0 died"))
        for _ in range(200):  # the run is served meanwhile
            assert len((await manager.router.generate([1], SP)).token_ids) == 6
            if len(manager.router.servers) == 2:
                break
            await asyncio.sleep(0.01)
        await manager.wait_restarts()  # no error: the run was never stopped
        assert len(starts) == 8 and len(manager.router.servers) == 2
        kinds = [e["kind"] for e in manager.events]
        assert kinds.count("restart_failed") >= 3 and kinds[-1] == "restart"

        # every server dies and none can come back: the run stops on it
        doomed[0] = True
        for s in list(manager.router.servers):
            s.die()
            manager.router.take_out(s, ServerDied("gone"))
        with pytest.raises(RuntimeError, match="could not be brought back"):
            for _ in range(500):
                await asyncio.sleep(0.01)
                manager._check()

    asyncio.run(go())
