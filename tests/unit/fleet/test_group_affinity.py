"""`rollout.group_affinity`: the samples of one group run on one server, move on together when it dies,
and a hung server holds up only its own groups. Real `Router`, `run_moving` and `Rollouter`; the hosts are
stand-ins whose timing (and death) the test controls."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from agents.single_turn import SingleTurnAgent
from asyncrl.data.datasets import Prompt, PromptSet, PromptStream
from asyncrl.engines.base import GenerateOutput, SamplingParams
from asyncrl.rollout.resume import run_moving
from asyncrl.rollout.rollouter import Rollouter
from asyncrl.rollout.router import Router, ServerDied
from asyncrl.engines.sample import Sample
from asyncrl.staleness import StalenessManager
from asyncrl.trajectory_queue import trajectory_sample
from transfer_queue.storage.local import LocalStorage


class Host:
    """A server's host: `run_sample` records where each sample ran and waits until released (or raises
    `ServerDied` once `die()` is called; `hang()`: it never answers)."""

    def __init__(self, name: str) -> None:
        self.name, self.ran, self.dead, self.hung = name, [], False, False
        self.gate = asyncio.Event()
        self.gate.set()

    async def run_sample(self, sample: Sample, resume=None, resume_from=None):
        if self.dead:
            raise ServerDied(f"{self.name} is dead")
        self.ran.append(sample.uid)
        while not self.gate.is_set() or self.hung:
            if self.dead:
                raise ServerDied(f"{self.name} died")
            await asyncio.sleep(0.005)
        return SimpleNamespace(meta={}, server=self.name)

    def die(self) -> None:
        self.dead = True


def samples(groups: int, size: int = 4) -> list[Sample]:
    return [Sample(f"g{g}-{i}", f"g{g}", i, size, [1, 2], "0") for g in range(groups) for i in range(size)]


def test_a_group_runs_on_one_server_and_moves_on_together():
    async def go(affinity: bool):
        h0, h1 = Host("h0"), Host("h1")
        router = Router([h0, h1])
        h0.gate.clear(), h1.gate.clear()
        work = samples(4)
        tasks = [asyncio.create_task(run_moving(router, s, session_id=s.group_id if affinity else None)) for s in work]
        await asyncio.sleep(0.05)
        placed = {g: {h.name for h in (h0, h1) for uid in h.ran if uid.startswith(g + "-")} for g in ("g0", "g1", "g2", "g3")}
        h0.die()
        h1.gate.set()
        out = await asyncio.gather(*tasks)
        return placed, out, router

    placed, out, router = asyncio.run(go(True))
    assert all(len(where) == 1 for where in placed.values()), placed  # each group on one server
    assert sorted(next(iter(w)) for w in placed.values()) == ["h0", "h0", "h1", "h1"]  # and the groups spread
    moved = [fate for (_, fate) in out if fate is not None]
    assert len(moved) == 8 and all(rec.server == "h1" for rec, _ in out)  # h0's two groups, all 8 samples, moved to h1
    assert router.failovers == 8
    for g in ("g0", "g1", "g2", "g3"):
        router.end_session(g)
    assert router._sessions == {}

    placed, _, _ = asyncio.run(go(False))
    assert all(where == {"h0", "h1"} for where in placed.values()), placed  # without: every group on both


def test_a_hung_server_holds_up_only_its_own_groups():
    async def go(affinity: bool) -> tuple[int, int]:
        h0, h1 = Host("h0"), Host("h1")
        router = Router([h0, h1])
        h0.hung = True
        h1.gate.clear()  # both busy while the groups start
        done: dict[str, int] = {}

        async def one(s: Sample) -> None:
            await run_moving(router, s, session_id=s.group_id if affinity else None)
            done[s.group_id] = done.get(s.group_id, 0) + 1

        tasks = [asyncio.create_task(one(s)) for s in samples(4)]
        await asyncio.sleep(0.02)
        h1.gate.set()
        await asyncio.sleep(0.1)
        whole = sum(1 for n in done.values() if n == 4)
        on_h0 = {uid.split("-")[0] for uid in h0.ran}
        h0.die()  # the health probe finds it: its samples move on
        await asyncio.gather(*tasks)
        assert all(n == 4 for n in done.values()) and len(done) == 4
        return whole, len(on_h0)

    whole, on_h0 = asyncio.run(go(True))
    assert on_h0 == 2 and whole == 2  # the groups on h1 finished while h0 hung
    whole, on_h0 = asyncio.run(go(False))
    assert on_h0 == 4 and whole == 0  # spread: every group waited for its member on h0


def test_the_rollouter_ends_each_groups_session():
    plane = LocalStorage(inline_max_bytes=0)

    class LLM:
        async def generate(self, prompt_ids, sampling, session_id=None):
            await asyncio.sleep(0.001)
            return GenerateOutput("r", [7, 8], [-0.5, -0.25], [0, 0], "stop")

    async def go():
        router = Router([Host("h0"), Host("h1")])
        agent = SingleTurnAgent(decode=lambda ids: "x", reward_fn=lambda r, a: 1.0, sampling=SamplingParams())
        seen: set[str] = set()
        ended: list[str] = []

        async def run(sample):
            await run_moving(router, sample, session_id=sample.group_id)
            seen.update(router._sessions)
            return trajectory_sample(plane, await agent.run(sample, LLM()))

        queued = []

        async def sink(group):
            queued.append(group)

        async def discard(group):
            return None

        prompts = PromptSet([Prompt(i, "q", [1, 2], "1") for i in range(8)])
        r = Rollouter(run_sample=run, prompts=PromptStream(prompts, seed=0), staleness=StalenessManager(batch_groups=4, eta=0),
                      sink=sink, discard=discard, group_size=3, on_group_end=lambda g: (ended.append(g), router.end_session(g)))
        task = asyncio.create_task(r.run())
        while len(queued) < 4:
            await asyncio.sleep(0.01)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return seen, ended, set(router._sessions)

    seen, ended, left = asyncio.run(go())
    assert len(ended) >= 4 and set(ended) <= seen  # each group had its session while it ran, under its group id
    assert not set(ended) & left  # a group that ended left no session behind
