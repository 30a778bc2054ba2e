"""Samples in flight across a checkpoint: the engine reports what a running request has, the host
saves a running sample's state from it, and a new host continues the sample from those tokens."""

from __future__ import annotations

import asyncio

import pytest

from agents.single_turn import SingleTurnAgent
from asyncrl.engines.base import GenerateOutput, SamplingParams
from asyncrl.rollout.host import ServerHost
from asyncrl.rollout.inflight import SampleClient, SavedCall, SavedSample, decode_saved, encode_saved, prompt_digest
from asyncrl.engines.sample import Sample
from asyncrl.trajectory_queue import from_record
from transfer_queue.storage.local import LocalStorage

from tests.unit.engines.helpers import make_server

LONG = 200


def _server(path):
    server = make_server(path)
    server.eos_token_ids = frozenset()  # lengths are then set by max_tokens only
    return server


def _host(server, plane):
    agent = SingleTurnAgent(decode=lambda ids: "", reward_fn=lambda r, a: 0.0, sampling=SamplingParams(max_tokens=LONG, seed=3))
    return ServerHost(server, name="h", agent=agent, eval_agent=agent, plane=plane)


def test_a_sample_saved_mid_generation_continues_on_a_new_host_from_its_saved_tokens(tiny_model):
    plane = LocalStorage(inline_max_bytes=0)
    sample = Sample(uid="g-0", group_id="g", index_in_group=0, group_size=1, prompt_ids=[5, 6, 7], answer="")

    async def first():
        server = _server(tiny_model)
        host = _host(server, plane)
        run = asyncio.create_task(host.run_sample(sample))
        while server.stats().generated_tokens < 20:
            await asyncio.sleep(0.005)
        live = await server.live_requests()
        saved = await host.partial_samples()
        run.cancel()  # the process dies here
        await asyncio.gather(run, return_exceptions=True)
        await server.close()
        return live, saved

    async def second(saved):
        server = _server(tiny_model)
        await server.update_weights([], version=7)  # the resumed run's weights carry a newer version
        host = _host(server, plane)
        record = await host.run_sample(sample, decode_saved(encode_saved(saved))[0])  # through the actor's wire form
        await server.close()
        return record

    live, saved = asyncio.run(first())
    assert [o.request_id for o in live] == ["g-0/0.0"] and live[0].finish_reason == "running"
    assert len(live[0].token_ids) == len(live[0].logprobs) == len(live[0].versions) >= 20
    [s] = saved
    k = s.tokens
    assert s.uid == "g-0" and len(s.calls) == 1 and not s.calls[0].done and k >= 20
    assert s.calls[0].prompt_digest == prompt_digest([5, 6, 7]) and s.calls[0].versions == [0] * k

    record = asyncio.run(second(saved))
    fields = ("prompt_ids", "response_ids", "behavior_logprobs", "loss_mask", "token_versions")
    traj = from_record(record.meta, dict(zip(fields, plane.read([record.handles[f] for f in fields]))))
    assert record.meta["meta"]["resumed_tokens"] == k and record.meta["meta"]["resumed_max_version"] == 0
    assert len(traj.response_ids) == LONG and traj.response_ids[:k] == s.calls[0].token_ids
    assert traj.token_versions == [0] * k + [7] * (LONG - k)  # the saved tokens keep the version that made them
    assert traj.behavior_logprobs[:k] == pytest.approx(s.calls[0].logprobs)


class _FakeRouter:
    """The host's router as `SampleClient` sees it: records each call, answers `max_tokens` 9s."""

    def __init__(self) -> None:
        self.live: dict = {}
        self.calls: list[tuple[list[int], int, GenerateOutput | None]] = []

    async def generate(self, prompt_ids, sampling, session_id=None, *, request_id=None, prefix=None):
        self.calls.append((list(prompt_ids), sampling.max_tokens, prefix))
        have = list(prefix.token_ids) if prefix else []
        n = sampling.max_tokens - len(have)
        return GenerateOutput(request_id, have + [9] * n, [-1.0] * (len(have) + n), (list(prefix.versions) if prefix else []) + [5] * n, "length")


def test_a_multi_turn_sample_replays_its_finished_calls_and_continues_the_cut_one():
    sp = SamplingParams(max_tokens=4)
    done = SavedCall(prompt_digest([1]), [3, 3], [-0.1, -0.1], [2, 2], done=True, finish_reason="stop")
    cut = SavedCall(prompt_digest([1, 3, 3, 0]), [4], [-0.2], [2])
    llm = _FakeRouter()
    client = SampleClient(llm, "u", SavedSample("u", [done, cut]))

    async def go():
        a = await client.generate([1], sp)
        b = await client.generate([1, 3, 3, 0], sp)
        c = await client.generate([1, 3, 3, 0, 4, 9, 9, 9, 0], sp)
        return a, b, c

    a, b, c = asyncio.run(go())
    assert a.token_ids == [3, 3] and a.finish_reason == "stop"  # from the saved call: nothing generated
    assert b.token_ids == [4, 9, 9, 9] and b.versions == [2, 5, 5, 5]
    assert [(p, pre.token_ids if pre else None) for p, _, pre in llm.calls] == [([1, 3, 3, 0], [4]), ([1, 3, 3, 0, 4, 9, 9, 9, 0], None)]
    assert client.resumed_tokens == 3 and client.resumed_max_version == 2
    assert [x.done for x in client.calls] == [True, True, True]


def test_a_saved_call_the_agent_does_not_make_again_is_dropped():
    llm = _FakeRouter()
    client = SampleClient(llm, "u", SavedSample("u", [SavedCall(prompt_digest([1]), [3], [-0.1], [2])]))
    out = asyncio.run(client.generate([2], SamplingParams(max_tokens=2)))  # another prompt: generated anew
    assert out.token_ids == [9, 9] and llm.calls[0][2] is None and client.resumed_tokens == 0


class _Handle:
    """A Ray actor handle stand-in: `handle.verb.remote(*args)` calls the actor body in this process
    (the proxy's and the actor's msgpack wire forms are exercised, Ray's transport is not)."""

    def __init__(self, actor) -> None:
        self.actor = actor

    def __getattr__(self, verb):
        fn = getattr(self.actor, verb)
        return type("Method", (), {"remote": staticmethod(lambda *args: fn(*args))})


def test_a_server_actor_reports_and_continues_a_sample_through_its_proxy(tiny_model):
    import dataclasses

    from asyncrl.config import AgentConfig, RolloutConfig
    from asyncrl.rollout.host_spec import HostSpec
    from asyncrl.rollout.remote_server import RemoteServer
    from asyncrl.rollout.server_actor import ServerActor

    spec = HostSpec(agent=dataclasses.asdict(AgentConfig()), reward="digits", sampling=dataclasses.asdict(SamplingParams(max_tokens=LONG, seed=1)),
                    eval_sampling=dataclasses.asdict(SamplingParams(max_tokens=4)), queue={"storage": "local", "inline_max_bytes": 1 << 20})
    sample = Sample(uid="a-0", group_id="a", index_in_group=0, group_size=1, prompt_ids=[5, 6], answer="1234")

    async def go():
        actor = ServerActor(dataclasses.asdict(RolloutConfig(torch_threads=1)), str(tiny_model), "float32", 0, 0, "s", dataclasses.asdict(spec))
        proxy = RemoteServer(_Handle(actor), "s")
        await proxy.ready()
        actor.server.eos_token_ids = frozenset()
        run = asyncio.create_task(proxy.run_sample(sample))
        while actor.server.stats().generated_tokens < 10:
            await asyncio.sleep(0.005)
        live = await proxy.live_requests()
        [saved] = await proxy.partial_samples()
        run.cancel()
        await asyncio.gather(run, return_exceptions=True)
        record = await proxy.run_sample(sample, saved)
        await actor.close()
        return live, saved, record

    live, saved, record = asyncio.run(go())
    assert [o.request_id for o in live] == ["a-0/0.0"] and saved.uid == "a-0" and saved.tokens >= 10
    assert record.meta["meta"]["resumed_tokens"] == saved.tokens and record.handles["response_ids"].shape == [LONG]
