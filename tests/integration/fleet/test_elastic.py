"""Servers joining and leaving a live fleet (`FleetManager.resize`), on real parts: a real `TrainerRank`
publishing through a real `Sender` (shm buckets; the state spans several), real `ServerHost`s whose
cost-model engines land every update in their own copy of the weights, and the peer's hand-out on a
`Sender` of the peer's own. What is checked is where the joiner's weights came from (the trainer
sent nothing while it joined) and that they arrived whole (bitwise the current version's).
"""

from __future__ import annotations

import asyncio

import torch

from asyncrl.engines.base import PEER_LOADED_MEANWHILE, SamplingParams
from asyncrl.engines.cost_model import CostModelServer, LongTail
from asyncrl.rollout.fleet import FleetManager
from asyncrl.rollout.fleet_build import Fleet
from asyncrl.rollout.host import ServerHost
from asyncrl.rollout.router import Router
from tests.integration.fleet.weights import weight_source


def state(seed: int) -> list[tuple[str, torch.Tensor]]:
    """About 10 MB in three tensors: three buckets of 4 MB."""
    g = torch.Generator().manual_seed(seed)
    return [(f"layer{i}.weight", torch.randn(640, 1365, generator=g)) for i in range(3)]


class Counting:
    """The trainer's weight source, counting every receiver it was asked to send to."""

    def __init__(self, inner) -> None:
        self.inner, self.endpoints, self.sent_to = inner, inner.endpoints, []

    async def publish(self, version, receivers, probe=None):
        self.sent_to += list(receivers)
        return await self.inner.publish(version, receivers, probe)

    async def sync(self, receivers, resend=False, probe=None):
        self.sent_to += list(receivers)
        return await self.inner.sync(receivers, resend, probe)


class Opaque(CostModelServer):
    """An engine that cannot hand out its weights (as vLLM): its joiners wait for the next publish."""

    def export_weights(self):
        return None


def host(i: int, cls=CostModelServer) -> ServerHost:
    engine = cls(token_cost_s=0.002, max_concurrency=4, lengths=LongTail(short_tokens=20, long_fraction=0.0), seed=i)
    return ServerHost(engine, name=f"main-{i}", agent=None, eval_agent=None, plane=None)


def held(server: ServerHost) -> dict[str, torch.Tensor]:
    return dict(server.server._weights)


async def settle(manager: FleetManager) -> None:
    await manager.wait_restarts()


def test_joiners_take_the_current_weights_from_a_peer_and_a_drain_finishes_requests():
    async def go():
        handle, engine, cfg = weight_source(state(0))
        source = Counting(handle)
        made: list[int] = []

        async def make(i: int) -> ServerHost:
            made.append(i)
            return host(i)

        manager = FleetManager(Router(), restart_dead=False)
        await manager.add_fleet(Fleet("main", [host(0), host(1)], make=make))
        await manager.attach_weights(source, cfg)
        await manager.publish(0)
        engine.state = state(1)
        await manager.publish(1)
        source.sent_to.clear()

        out = await manager.resize("main", 4)
        await settle(manager)
        assert out["to"] == 4 and made == [2, 3]
        assert source.sent_to == []  # the trainer sent the joiners nothing: their peers did
        assert manager.joins["peer"] == 2 and manager.joins["publish"] == 0
        routed = manager.router.servers
        assert len(routed) == 4
        want = dict(state(1))
        for s in routed:
            assert s.version == 1
            got = held(s)
            assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)

        # a publish after the join reaches every server, the joiners through the trainer's plane
        engine.state = state(2)
        await manager.publish(2)
        want = dict(state(2))
        assert all(torch.equal(held(s)[k], want[k]) for s in manager.router.servers for k in want)

        # shrink while a request runs on every server: it finishes (no request is lost), then 2 are closed
        reqs = [asyncio.create_task(manager.router.generate([1, 2, 3], SamplingParams(max_tokens=30))) for _ in range(8)]
        await asyncio.sleep(0.05)
        out = await manager.resize("main", 2, drain_timeout_s=30)
        done = await asyncio.gather(*reqs)
        assert all(r.token_ids for r in done)
        assert out["to"] == 2 and sorted(out["drained"]) == ["main-2", "main-3"]
        assert len(manager.router.servers) == 2
        kinds = [e["kind"] for e in manager.events]
        assert kinds.count("join") == 2 and kinds.count("drain") == 2
        assert manager.size() == {"main": 2}
        assert [n for _, n in manager.history["main"]][-2:] == [4, 2]  # both drained together
        await manager.close()

    asyncio.run(go())


def test_a_joiner_no_peer_can_serve_is_routed_by_the_next_publish():
    async def go():
        handle, engine, cfg = weight_source(state(0))
        source = Counting(handle)

        async def make(i: int) -> ServerHost:
            return host(i, Opaque)

        manager = FleetManager(Router(), restart_dead=False)
        await manager.add_fleet(Fleet("main", [host(0, Opaque)], make=make))
        await manager.attach_weights(source, cfg)
        await manager.publish(0)
        source.sent_to.clear()
        await manager.resize("main", 2)
        await settle(manager)
        assert len(manager.router.servers) == 1  # not routed: it holds no weights of the current version
        assert [e["why"] for e in manager.events if e["kind"] == "join_pending"] == ["no peer: no peer can export its weights"]
        assert source.sent_to == []  # and the trainer was not asked for a sync
        engine.state = state(1)
        await manager.publish(1)
        assert source.sent_to == ["main-0", "main-1"]
        assert len(manager.router.servers) == 2 and manager.joins["publish"] == 1
        assert all(s.version == 1 for s in manager.router.servers)
        await manager.close()

    asyncio.run(go())


def test_a_hand_out_a_publish_overlapped_is_tried_again_after_it():
    """A publish reached the peer while it handed its weights out (on a busy machine, with steps a
    fraction of a second apart): the hand-out does not count, and the joiner asks again once that
    publish is done, instead of waiting for the next one."""
    async def go():
        handle, engine, cfg = weight_source(state(0))
        manager = FleetManager(Router(), restart_dead=False)

        class Busy(ServerHost):
            overlapped = 0

            async def send_offered(self, receiver_id, timeout_s):
                if Busy.overlapped == 0:  # the trainer publishes during the first hand-out
                    Busy.overlapped += 1
                    self._close_offer(receiver_id)
                    engine.state = state(2)
                    await manager.publish(2)
                    return {"version": 1, "loaded": False, "why": PEER_LOADED_MEANWHILE}
                return await super().send_offered(receiver_id, timeout_s)

        peer = Busy(CostModelServer(token_cost_s=0.002, max_concurrency=4, lengths=LongTail(short_tokens=20, long_fraction=0.0), seed=0),
                    name="main-0", agent=None, eval_agent=None, plane=None)

        async def make(i: int) -> ServerHost:
            return host(i)

        await manager.add_fleet(Fleet("main", [peer], make=make))
        await manager.attach_weights(Counting(handle), cfg)
        engine.state = state(1)
        await manager.publish(1)
        await manager.resize("main", 2)
        await settle(manager)
        assert Busy.overlapped == 1
        assert manager.joins["peer"] == 1 and manager.joins["publish"] == 0, manager.events
        assert [e["kind"] for e in manager.events if e["server"] == "main-1"] == ["start", "join"]
        joiner = next(s for s in manager.router.servers if s is not peer)
        want = dict(state(2))
        assert joiner.version == 2 and all(torch.equal(held(joiner)[k], want[k]) for k in want)
        await manager.close()

    asyncio.run(go())


def test_refused_sizes_name_the_problem():
    async def go():
        manager = FleetManager(Router(), restart_dead=False)
        await manager.add_fleet(Fleet("main", [host(0)]))
        for fleet, n, words in [("main", 0, "at least 1"), ("other", 2, "no fleet 'other'")]:
            try:
                await manager.resize(fleet, n)
            except ValueError as e:
                assert words in str(e)
            else:
                raise AssertionError("accepted")
        try:  # a fleet built without a way to start servers says so
            await manager.resize("main", 2)
        except RuntimeError as e:
            assert "cannot start more servers" in str(e)
        else:
            raise AssertionError("grew")
        await manager.close()

    asyncio.run(go())
