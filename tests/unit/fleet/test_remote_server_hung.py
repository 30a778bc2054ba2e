"""`RemoteServer.close` of a server found hung kills it at once: asking a hung process to close
first would cost another `rollout.health_timeout_s`, during which a publish still waits on it.

The Ray actor handle is a stand-in (an object whose verbs return awaitables), since only the
proxy's own bookkeeping is under test; `ray.kill` is recorded instead of run."""

import asyncio

import pytest

ray = pytest.importorskip("ray")

from asyncrl.rollout import remote_server  # noqa: E402
from asyncrl.rollout.remote_server import RemoteServer  # noqa: E402
from asyncrl.rollout.router import ServerDied  # noqa: E402


class _Verb:
    def __init__(self, calls: list[str], name: str, answer: bool) -> None:
        self.calls, self.name, self.answer = calls, name, answer

    def remote(self, *args):
        self.calls.append(self.name)
        return asyncio.sleep(0) if self.answer else asyncio.sleep(3600)


class _Handle:
    def __init__(self, answer: bool) -> None:
        self.calls: list[str] = []
        self.answer = answer

    def __getattr__(self, name: str) -> _Verb:
        return _Verb(self.calls, name, self.answer)


@pytest.mark.parametrize("hung", [True, False])
def test_close_asks_a_live_server_and_kills_a_hung_one_at_once(hung, monkeypatch):
    killed = []
    monkeypatch.setattr(remote_server.ray, "kill", lambda handle, no_restart=True: killed.append(handle))
    handle = _Handle(answer=not hung)
    server = RemoteServer(handle, "main-0", control_timeout_s=0.2)

    async def go() -> None:
        if hung:
            with pytest.raises(ServerDied, match="hung"):
                await server.probe()
        await server.close()

    asyncio.run(go())
    assert killed == [handle]
    assert handle.calls == (["progress"] if hung else ["close"])  # a hung one is not asked to close: killed at once


def test_a_hung_server_on_this_node_is_sigkilled_not_left_to_ray_kill(monkeypatch):
    """`ray.kill` asks the actor to exit and waits about 5 s before it kills a stopped process, while a
    publish waits on that process's connection: the proxy SIGKILLs it itself when it runs on this node
    (its pid and node come with `ready`), and only if the pid is still a server actor's."""
    import signal
    import subprocess
    import time

    monkeypatch.setattr(remote_server.ray, "kill", lambda handle, no_restart=True: None)
    actor = subprocess.Popen(["bash", "-c", "exec -a ray::ServerActor.fake sleep 60"])
    other = subprocess.Popen(["sleep", "60"])  # a reused pid: never killed
    try:
        time.sleep(0.2)
        actor.send_signal(signal.SIGSTOP)
        server = RemoteServer(_Handle(answer=False), "main-0", control_timeout_s=0.2)
        server._pid, server._node = actor.pid, remote_server.ray.util.get_node_ip_address()

        async def go() -> None:
            with pytest.raises(ServerDied, match="hung"):
                await server.probe()
            await server.close()

        t0 = time.monotonic()
        asyncio.run(go())
        assert actor.wait(timeout=2) == -signal.SIGKILL and time.monotonic() - t0 < 2
        stranger = RemoteServer(_Handle(answer=False), "main-1", control_timeout_s=0.2)
        stranger._pid, stranger._node = other.pid, server._node
        stranger._hung = True
        asyncio.run(stranger.close())
        assert other.poll() is None
    finally:
        for p in (actor, other):
            p.kill()
            p.wait()


def test_a_probe_answered_after_a_publish_does_not_take_the_version_back():
    """The probe left before the publish and answers after it: the version it carries is the one before.
    The proxy kept it, so for a moment a server at the current version read as one behind, and a joiner
    found no peer to take its weights from (tests/deploy/test_follow_cluster.py, under load)."""
    from asyncrl.engines.base import ServerStats

    class _Answers:
        def __init__(self) -> None:
            self.gate = asyncio.Event()

        def __getattr__(self, name: str):
            gate = self.gate

            class V:
                @staticmethod
                def remote(*args):
                    async def answer():
                        await gate.wait()
                        stats = ServerStats(version=3, in_flight=0, paused=False, generated_tokens=0, tokens_per_s=0.0)
                        return (stats, b"\x80") if name == "progress" else stats
                    return answer()
            return V()

    handle = _Answers()
    server = RemoteServer(handle, "main-0", control_timeout_s=5.0)

    async def go() -> None:
        for verb in (server.probe, server.refresh):
            task = asyncio.ensure_future(verb())
            await asyncio.sleep(0.01)
            server.loaded(4)  # the publish completed while the answer was on its way
            handle.gate.set()
            await task
            assert server.version == 4
            handle.gate.clear()
        server.loaded(5)
        handle.gate.set()
        await server.refresh()
        assert server.version == 5

    asyncio.run(go())


def test_a_whole_sample_running_on_an_actor_counts_in_flight(monkeypatch):
    """`stats().in_flight` (the status view's per-server figure, a drain's `moved`) counts the samples an actor
    runs: a Ray fleet runs whole samples there, so counting `generate` calls alone read 0 (`bench controller`)."""
    from asyncrl.rollout import host_spec
    from transfer_queue.records import SampleMeta

    monkeypatch.setattr(host_spec, "encode_sample", lambda sample: b"sample")  # the stand-in handle reads no sample

    record = SampleMeta(uid="u0", group_id="g0", group_size=1, version=0, meta={}, handles={})
    answers: list[asyncio.Future] = []

    class Verb:
        def remote(self, *args):
            answers.append(asyncio.get_running_loop().create_future())
            return answers[-1]

    class Handle:
        def __getattr__(self, name: str) -> Verb:
            return Verb()

    server = RemoteServer(Handle(), "main-0")

    async def go() -> list[int]:
        runs = [asyncio.ensure_future(server.run_sample(object())) for _ in range(3)]
        await asyncio.sleep(0)
        seen = [server.stats().in_flight]
        answers[0].set_result(host_spec.encode_record(record))
        await runs[0]
        seen.append(server.stats().in_flight)
        for a in answers[1:]:
            a.set_exception(RuntimeError("the sample's own error"))
        await asyncio.gather(*runs[1:], return_exceptions=True)
        seen.append(server.stats().in_flight)
        return seen

    assert asyncio.run(go()) == [3, 2, 0]
