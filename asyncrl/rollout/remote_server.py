"""`RemoteServer`: the client-side proxy of one `ServerActor` (server_actor.py), itself a `RolloutServer`.

Job: forward the verbs to the actor through Ray, keep what the synchronous part of the interface
(`stats()`, `version`) answers from, and turn "the actor is gone or hung" into the router's
`ServerDied` (a control verb unanswered within `rollout.health_timeout_s` is a hung server).
Boundary: never builds or places an actor (server_actor.py's `spawn_server` does and returns one
of these); no routing, no restart policy (fleet_health.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any, Iterable

import ray
from ray.exceptions import RayActorError

from asyncrl.engines.base import GenerateOutput, PauseMode, RolloutServer, SamplingParams, ServerStats
from asyncrl.rollout.router import ServerDied


def startup_split(asked: float, times: dict[str, float], now: float) -> dict[str, float]:
    """A server's start in seconds, from the actor's wall times (`ServerActor.start`): `queued_s` (the
    request to its process: Ray placing it and starting a worker; 0 when a worker Ray had started before
    took it), `imports_s` (that process up to the actor body: the interpreter, Ray's worker, the
    modules), `build_s` (the engine and its host: the model loaded), `total_s` (the request to ready,
    as the controller saw it). The actor's times are moved onto this clock by the offset its reply shows
    (`reply_at`, the actor's time as it answered, against `now`): hosts whose clocks disagree split alike."""
    skew = now - times["reply_at"] if "reply_at" in times else 0.0
    at = {k: v + skew for k, v in times.items() if v}
    process = max(at.get("process_at") or asked, asked)
    init = max(at.get("init_at", process), process)
    built = min(max(at.get("built_at", now), init), now)
    return {"queued_s": round(process - asked, 3), "imports_s": round(init - process, 3),
            "build_s": round(built - init, 3), "total_s": round(now - asked, 3)}


class RemoteServer(RolloutServer):
    """Client-side proxy of a `ServerActor`. `stats()` and `version` are synchronous in the
    interface, so they answer from what this proxy saw last (its own in-flight count, the last
    `refresh()`); `FleetManager.stats()` refreshes first."""

    delivered_record_bytes: int = 0
    """Bytes of the queue records that reached this process from every server actor (`run_sample` replies,
    as they came over the wire): the controller's metadata share of a trajectory (`bench planes`)."""

    def __init__(self, handle: Any, name: str, control_timeout_s: float = 60.0) -> None:
        self.handle = handle
        self.name = name
        self.control_timeout_s = control_timeout_s
        """A control verb (stats, resume, join, close) unanswered this long means a hung server: `ServerDied`."""
        self._closed = False
        self._in_flight = 0
        self._stats = ServerStats(version=0, in_flight=0, paused=False, generated_tokens=0, tokens_per_s=0.0)
        self._dead = False
        self._hung = False
        """A control verb went unanswered: `close` kills it without asking it first."""
        self._pid: int | None = None
        self._node = ""
        """The actor's process and node (`ready`)."""
        self._made_at = time.time()
        """Wall time of this proxy, i.e. of the actor's creation (`spawn_server`)."""
        self.startup: dict[str, float] = {}
        """Where the start's seconds went (`startup_split`), once `ready`."""
        self.record_bytes = 0
        """Bytes of the queue records this proxy received from the actor (`run_sample` replies)."""
        self.snapshots: dict[str, Any] = {}
        """uid -> handle of the latest snapshot of each sample running there (`probe`); what its samples
        continue from on another server if this one dies (`ServerHost.snapshot`)."""

    async def _call(self, verb: str, *args: Any) -> Any:
        """Samples and generation may take as long as they take; a control verb that is not
        answered within `control_timeout_s` is a hung server (the caller kills it via `close`)."""
        ref = getattr(self.handle, verb).remote(*args)
        try:
            if verb in _CONTROL_VERBS:
                async with asyncio.timeout(self.control_timeout_s):  # not wait_for: on 3.11 it can swallow a cancel
                    return await ref
            return await ref
        except asyncio.CancelledError:  # the caller gave the work up (a run that stops): so does the server
            if verb not in _CONTROL_VERBS:
                ray.cancel(ref)
            raise
        except asyncio.TimeoutError:
            self._hung = True
            raise ServerDied(f"rollout server {self.name} is hung: no answer to {verb} in {self.control_timeout_s} s "
                             f"(rollout.health_timeout_s)") from None
        except RayActorError as exc:  # translated: the router fails over on ServerDied
            self._dead = True
            raise ServerDied(f"rollout server {self.name} died during {verb}: {type(exc).__name__}") from exc

    @property
    def node(self) -> str:
        """The node address the actor runs on ('' before `ready`)."""
        return self._node

    async def probe(self) -> None:
        """Raise `ServerDied` if the actor is dead or does not answer within `control_timeout_s`; else
        keep its stats and the handles of its running samples' snapshots (written by this very call)."""
        from asyncrl.rollout.host_spec import decode_handles

        stats, snaps = await self._call("progress")
        self._keep(stats)
        self.snapshots = decode_handles(snaps)

    async def ready(self) -> "RemoteServer":
        """Wait until the engine is built (model loaded); `startup` then splits the wait."""
        version, self._pid, self._node, times = await self._call("start")
        self._stats = dataclasses.replace(self._stats, version=version)
        self.ifname = str(times.pop("ifname", ""))
        """The interface the actor's gloo / NCCL sockets use (`asyncrl.hosts.on_node`)."""
        self.startup = startup_split(self._made_at, times, time.time())
        return self

    async def reattach(self, wipe_plane: bool) -> "RemoteServer":
        """Take back the server of a detached run whose controller died (`ServerActor.reattach`, a control
        verb: a hung one is `ServerDied` after `control_timeout_s`), then as `ready`."""
        await self._call("reattach", wipe_plane)
        return await self.ready()

    async def touch(self) -> None:
        """The controller's keepalive of a detached run's server (`ray.detached`)."""
        await self._call("touch")

    def _kill_stopped(self) -> None:
        """SIGKILL a hung actor's process when it runs on this node: `ray.kill` asks it to exit first and
        waits (about 5 s for a stopped process), while a publish waits on its open connection."""
        import os
        import signal

        import psutil

        if self._pid is None or self._node != ray.util.get_node_ip_address():
            return
        try:
            proc = psutil.Process(self._pid)
            if proc.cmdline()[:1] and proc.cmdline()[0].startswith("ray::ServerActor"):  # still that actor, not a reused pid
                os.kill(self._pid, signal.SIGKILL)
        except (psutil.Error, OSError, IndexError):  # deliberate: already gone
            pass

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams, request_id: str | None = None) -> GenerateOutput:
        self._in_flight += 1
        try:
            return await self._call("generate", list(prompt_ids), sampling, request_id)
        finally:
            self._in_flight -= 1

    async def pause(self, mode: PauseMode = "wait") -> None:
        await self._call("pause", mode)

    async def resume(self) -> None:
        await self._call("resume")

    async def update_weights(self, named_tensors: Iterable[tuple[str, Any]], version: int) -> None:
        """(name, tensor) pairs through Ray's object store: small models and tests only; the
        pipeline loads weights through the weight plane (`join_weights`)."""
        got = await self._call("update_weights_named", list(named_tensors), version)
        self._stats = dataclasses.replace(self._stats, version=got)

    async def run_sample(self, sample: Any, resume: Any = None, resume_from: Any = None) -> Any:
        """The actor's host runs the whole sample (continued from `resume`, an `inflight.SavedSample`,
        or from `resume_from`, a dead server's snapshot handle, when given); returns its queue record
        (`SampleMeta`)."""
        import msgspec

        from asyncrl.rollout.host_spec import decode_record, encode_sample
        from asyncrl.rollout.inflight import encode_saved

        return decode_record(await self._records(1, "run_sample", encode_sample(sample),
                                                 None if resume is None else encode_saved([resume]),
                                                 None if resume_from is None else msgspec.msgpack.encode(resume_from)))

    async def run_samples(self, samples: list[Any]) -> list[Any]:
        """A group's samples (none resumed) in one actor call (`ServerActor.run_samples`); their records in
        order. One Ray call per group: per sample, submitting the call was most of the controller's cost."""
        from asyncrl.rollout.host_spec import decode_records, encode_samples

        return decode_records(await self._records(len(samples), "run_samples", encode_samples(samples)))

    async def _records(self, samples: int, verb: str, *args: Any) -> bytes:
        """A call that runs `samples` whole samples on the actor and answers their records' bytes: the samples
        count in `stats().in_flight` meanwhile (status, a drain's `moved`: not `generate` calls, which a Ray
        fleet does not make), the bytes in `record_bytes` and `delivered_record_bytes`."""
        self._in_flight += samples
        try:
            data = await self._call(verb, *args)
        finally:
            self._in_flight -= samples
        self.record_bytes += len(data)
        RemoteServer.delivered_record_bytes += len(data)
        return data

    async def partial_samples(self) -> list[Any]:
        """What the actor's running samples have generated so far (`list[inflight.SavedSample]`)."""
        from asyncrl.rollout.inflight import decode_saved

        return decode_saved(await self._call("partial_samples"))

    async def live_requests(self) -> list[GenerateOutput]:
        return await self._call("live_requests")

    async def run_eval(self, sample: Any) -> dict[str, Any]:
        from asyncrl.rollout.host_spec import encode_sample

        return await self._call("run_eval", encode_sample(sample))

    async def join_weights(self, cfg: Any, endpoints: list[str] | str, pause_mode: PauseMode = "keep") -> None:
        await self._call("join_weights", dataclasses.asdict(cfg), [endpoints] if isinstance(endpoints, str) else list(endpoints),
                         pause_mode)

    async def offer_weights(self, cfg: Any, receiver_id: str) -> str | None:
        """The actor's host opens a sender of its weights for `receiver_id` (`ServerHost.offer_weights`)."""
        return await self._call("offer_weights", dataclasses.asdict(cfg), receiver_id)

    async def send_offered(self, receiver_id: str, timeout_s: float) -> dict[str, Any]:
        return await self._call("send_offered", receiver_id, timeout_s)

    def loaded(self, version: int) -> None:
        """The weight plane reported that this server loaded `version`."""
        self._stats = dataclasses.replace(self._stats, version=version)

    async def reset_prefix_cache(self) -> None:
        await self._call("reset_prefix_cache")

    async def score(self, token_ids: list[int]) -> list[float] | None:
        """The parity probe, scored by the actor's engine (63 floats back: control data, not bulk)."""
        return await self._call("score", list(token_ids))

    async def refresh(self) -> ServerStats:
        """Fetch the actor's stats (a dead actor reads as unhealthy instead of raising)."""
        if not self._dead:
            try:
                self._keep(await self._call("stats"))
            except ServerDied:  # deliberate: stats report the death, the router acts on it
                pass
        return self.stats()

    def _keep(self, got: ServerStats) -> None:
        """Stats the actor answered. Its version never goes back: a probe that left before a publish and
        answers after it carries the version before, while `loaded` has already recorded the new one (a
        joiner then found no peer at the current version and waited for the next publish)."""
        self._stats = dataclasses.replace(got, version=max(got.version, self._stats.version))

    def stats(self) -> ServerStats:
        return dataclasses.replace(self._stats, in_flight=self._in_flight, healthy=self._stats.healthy and not self._dead)

    @property
    def version(self) -> int:
        return self._stats.version

    async def close(self) -> None:
        """Close the server (one found hung is not asked again; else it is not waited for past
        `control_timeout_s`), then kill the actor: its calls in flight fail at once, so their samples
        move to other servers, and a publish waiting on it sees its connection gone."""
        if self._closed:
            return
        self._closed = True
        if not self._dead and not self._hung:
            try:
                await self._call("close")
            except ServerDied:  # deliberate: already gone (or hung) is closed by the kill below
                pass
        if self._hung:
            self._kill_stopped()
        if not self._dead:
            ray.kill(self.handle, no_restart=True)
        self._dead = True


_CONTROL_VERBS = frozenset({"stats", "progress", "touch", "reattach", "resume", "join_weights", "close", "reset_prefix_cache", "pid", "score", "partial_samples",
                            "live_requests"})
"""Verbs that answer at once on a healthy server (`start` loads the model, `pause` may drain, samples generate: no limit)."""
