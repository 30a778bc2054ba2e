"""The parity probe runs after its publish returns: no train step waits for the servers' side of it.

A publish hands the check to the background: the servers score the probe (here: held on purpose until
the test lets them answer), the trainer scores its reference as a verb of its own that keeps the
trainer's lock from the publish (so the next step comes after it, on unchanged weights), and the two are
compared once both are in. A failed check still acts as `weights.parity_action` says: `stop` ends the
run (`watch_parity`, and every later verb), `resync` re-sends the version to the server and routes it
again once it passes. Assertions are on the order of events, never on durations.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from asyncrl.rollout.fleet import FleetManager
from asyncrl.rollout.fleet_build import Fleet
from asyncrl.rollout.parity import ParityCheck, WeightParityError
from asyncrl.rollout.router import Router
from asyncrl.trainer.calls import AsyncTrainer

from .fakes import ScriptedServer

PROBE = [3, 1, 4, 1, 5]
GOOD = [-1.0, -2.0, -0.5, -1.5]
BAD = [-1.0, -2.0, -0.5, -9.0]


class ProbedServer(ScriptedServer):
    """Scores the probe only once the test opens its gate; `answers` are what it gives, in turn."""

    def __init__(self, name: str, events: list[str], answers: list[list[float]]) -> None:
        super().__init__(name, hold=False)
        self.events, self.answers = events, list(answers)
        self.gate = asyncio.Event()

    async def score(self, token_ids: list[int]) -> list[float]:
        self.events.append(f"{self.name} scoring")
        await self.gate.wait()
        self.events.append(f"{self.name} scored")
        return self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]


class Rank:
    """The trainer's blocking verbs (run on worker threads by `AsyncTrainer`), each recorded; its reference
    forward holds until `forward` is set."""

    endpoints = ["inproc://weights"]

    def __init__(self, events: list[str]) -> None:
        self.events, self.forward = events, threading.Event()

    def publish(self, version: int, receivers: list[str], probe: list[int] | None = None) -> dict:
        assert probe is None  # scored as a verb of its own, after the publish
        self.events.append(f"publish {version}")
        return {"version": version, "completed": list(receivers), "evicted": {}, "bytes": 0, "seconds": 0.0}

    def sync(self, receivers: list[str], resend: bool = False, probe: list[int] | None = None) -> dict:
        self.events.append(f"sync {receivers}")
        return {"version": 0, "completed": list(receivers), "evicted": {}, "probe": GOOD if probe else None}

    def score(self, token_ids: list[int]) -> list[float]:
        self.events.append("trainer scoring")
        assert self.forward.wait(30)
        self.events.append("trainer scored")
        return GOOD

    def train(self, plan: bytes) -> dict:
        self.events.append("train")
        return {"loss": 0.0}


async def _fleet(action: str, bad: bool = False) -> tuple[FleetManager, AsyncTrainer, Rank, list[ProbedServer], list[str]]:
    events: list[str] = []
    rank = Rank(events)
    trainer = AsyncTrainer(rank)
    servers = [ProbedServer("main-0", events, [GOOD]), ProbedServer("main-1", events, [BAD, GOOD] if bad else [GOOD])]
    manager = FleetManager(Router(), restart_dead=False)
    await manager.add_fleet(Fleet("main", servers))
    await manager.attach_weights(trainer, cfg=None, parity=ParityCheck(every=1, tol=0.01, action=action, ids=PROBE))
    return manager, trainer, rank, servers, events


async def _until(cond) -> None:
    while not cond():
        await asyncio.sleep(0.01)


@pytest.mark.timeout(60)
def test_a_train_step_goes_on_while_the_servers_score_the_probe():
    async def go():
        manager, trainer, rank, servers, events = await _fleet("stop")
        metrics = await manager.publish(0)
        assert "weights/parity_max_abs" not in metrics  # returned before its check ended
        step = asyncio.create_task(trainer.train(b"plan"))
        await _until(lambda: "trainer scoring" in events)
        assert "train" not in events  # the step waits for the trainer's own forward (the weights it scores)...
        rank.forward.set()
        stats = await step
        assert "main-0 scored" not in events and "main-1 scored" not in events  # ...and for nothing on the servers' side
        assert events.index("trainer scored") < events.index("train")
        assert stats["lock_s"] >= 0.0 and manager.parity.gaps == {}
        for s in servers:
            s.gate.set()
        await manager.parity_settled()
        assert {name: v for name, (v, _) in manager.parity.gaps.items()} == {"main-0": 0, "main-1": 0}
        after = await manager.publish(1)  # the next publish reports the check that ended
        assert after["weights/parity_max_abs"] == 0.0 and after["weights/parity_version"] == 0.0
        assert manager.version == 1
        await manager.close()

    asyncio.run(go())


@pytest.mark.timeout(60)
def test_a_failed_check_still_stops_the_run_after_the_step_went_on():
    async def go():
        manager, trainer, rank, servers, events = await _fleet("stop", bad=True)
        watch = asyncio.create_task(manager.watch_parity())
        await manager.publish(3)
        rank.forward.set()
        await trainer.train(b"plan")
        assert not watch.done() and "main-1 scored" not in events
        for s in servers:
            s.gate.set()
        with pytest.raises(WeightParityError) as err:
            await watch  # the run's loop: stops the run as soon as the check is in
        assert "server main-1 serves version 3" in str(err.value)
        with pytest.raises(WeightParityError):
            await manager.publish(4)  # and every later verb
        assert manager.version == 3 and manager.parity.failures == 1
        await manager.close()

    asyncio.run(go())


@pytest.mark.timeout(60)
def test_a_failed_check_with_resync_sends_the_version_again_and_routes_the_server_once_it_passes():
    async def go():
        manager, trainer, rank, servers, events = await _fleet("resync", bad=True)
        await manager.publish(0)
        rank.forward.set()
        await trainer.train(b"plan")
        assert len(manager.router.servers) == 2  # not judged yet: still routed
        for s in servers:
            s.gate.set()
        await manager.parity_settled()
        await manager.wait_restarts()
        out = (len(manager.router.servers), manager.resyncs, manager.parity.failures, dict(manager.evicted),
               [e for e in events if e.startswith("sync")], manager.parity.gaps["main-1"])
        await manager.close()
        return out

    routed, resyncs, failures, evicted, syncs, gap = asyncio.run(go())
    assert evicted == {"main-1": "parity"} and syncs == ["sync ['main-1']"]  # the version was sent again
    assert routed == 2 and resyncs == 1 and failures == 1 and gap == (0, 0.0)  # checked again, passed, routed
