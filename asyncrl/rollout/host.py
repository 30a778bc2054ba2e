"""ServerHost: one rollout server as the pipeline uses it, in the server's own process.

Job: run whole samples next to the engine: an AgentLoop against this server (partial
rollouts across weight updates included), the reward, and the write of the finished
trajectory's arrays into this process's data plane (`trajectory_sample`). What leaves the
host is the queue record: metadata and handles, about 1 KiB whatever the response length.
It also runs the server's end of the weight plane: a `Receiver` that joins the trainer's
`Sender`, and a loop that pauses the server, loads each update as its buckets land,
confirms the load and resumes (`checkpoint_engine.server_loop`).

The same class serves the embedded default (hosts in the controller's process, the `local`
planes) and Ray (`server_actor.ServerActor` holds one in each actor). It is itself a
`RolloutServer` (it forwards the interface's verbs to the engine: the one place they are forwarded;
the actor passes its calls of them to the host unchanged), so the `Router` and the `FleetManager`
treat local hosts and actor proxies alike. A weight load goes `server_loop.apply_update` ->
`ServerHost.load_update` (which counts it) -> the engine's `load_update`, where the one decision of how
an update is loaded is made (`RolloutServer.load_update`).

Checkpoints: each sample's agent talks to the engine through its own `inflight.SampleClient`,
so `partial_samples()` can say what every running sample has generated so far (its finished calls,
the router's segments and the engine's `live_requests`); a resumed sample is run with that state
(`run_sample(sample, resume=...)`) and continues from its saved tokens, the agent unchanged.

Snapshots (what a dead server's samples keep): `snapshot()` writes that same state of each running
sample into this process's data plane, where the plane outlives the process (`outlives_writer`:
shm, a separate zmq storage unit), replacing the sample's previous snapshot, and returns the
handles. The fleet's health probe collects them (`RemoteServer.probe`); when this process dies, the
sample moves to another server, whose host reads the snapshot (`run_sample(sample,
resume_from=handle)`) and continues from its tokens instead of the prompt. A snapshot is freed by
its host when the sample ends, or by the controller once another host continued from it.

    host = ServerHost(server, name="main-0", agent=agent, eval_agent=eval_agent, plane=plane)
    meta = await host.run_sample(sample)             # SampleMeta: into the queue, by the controller
    await host.join_weights(cfg.weights, trainer.endpoints, pause_mode="keep")
    saved = await host.partial_samples()             # at a checkpoint: list[SavedSample]
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any, Iterable

import msgspec
import numpy as np

from agents.base import AgentLoop
from asyncrl.engines.base import (PEER_LOADED_MEANWHILE, PEER_WAS_LOADING, GenerateOutput, PauseMode, RolloutServer,
                                  SamplingParams, ServerStats)
from asyncrl.engines.sample import Sample
from asyncrl.rollout.inflight import SampleClient, SavedSample, decode_saved, encode_saved
from asyncrl.rollout.router import Router
from asyncrl.trajectory_queue import trajectory_sample


log = logging.getLogger(__name__)
EVAL_TEXT_CHARS = 600
"""Most characters of prompt or response text an evaluated sample carries back (the controller holds metadata only)."""


def clip_text(text: str, limit: int = EVAL_TEXT_CHARS) -> str:
    """`text` if short, else its head and tail around ` … ` (a rendered prompt's system part and its question both show).

    >>> clip_text("abcdefghij", 7)
    'ab … ij'
    """
    if len(text) <= limit:
        return text
    keep = max(limit - 3, 2)
    return f"{text[: keep // 2]} … {text[len(text) - (keep - keep // 2):]}"


class ServerHost(RolloutServer):
    def __init__(self, server: RolloutServer, *, name: str, agent: AgentLoop | None, eval_agent: AgentLoop | None,
                 plane: Any, partial_rollouts: bool = True) -> None:
        self.server, self.name = server, name
        self.agent, self.eval_agent, self.plane = agent, eval_agent, plane
        self.llm = Router([server], partial_rollouts=partial_rollouts)
        """The agents' client: this server alone (aborted segments are resubmitted to it)."""
        self.loads_in_place = server.loads_in_place
        """The engine's (the weight plane reads it off the host: `checkpoint_engine.server_loop`)."""
        self._receiver: Any = None
        self._weights: asyncio.Task | None = None
        self._stop: asyncio.Event | None = None
        self.load_errors: list[str] = []
        """Updates this server could not load (refused to the sender, which re-syncs it)."""
        self._running: dict[int, SampleClient] = {}
        """The training samples generating here, by their client's id."""
        self._snapshots: dict[str, tuple[Any, int]] = {}
        """uid -> (handle of the running sample's latest snapshot in `plane`, the tokens it holds)."""
        self.snapshot_reads = {"continued": 0, "unreadable": 0}
        """Samples begun here from another server's snapshot, and snapshots that could not be read."""
        self._loads = 0
        """Weight loads begun here (odd while one runs): a peer hand-out that overlapped one is void."""
        self._offers: dict[str, Any] = {}
        """Receiver id -> the `Sender` this server offers its weights to it on (`offer_weights`)."""

    # ---- samples ------------------------------------------------------------------------
    async def run_sample(self, sample: Sample, resume: SavedSample | None = None, resume_from: Any = None) -> Any:
        """One training sample end to end; returns its queue record (`SampleMeta`). `resume`: the
        sample's state at a checkpoint; it continues from there (the record's `meta` then says
        `resumed_tokens`, the tokens taken from it, and `resumed_max_version`, their newest version).
        `resume_from`: the handle of a dead server's snapshot of it, read from the plane (one that
        cannot be read, or is not this sample's, is counted and the sample starts from its prompt)."""
        if self.agent is None:
            raise RuntimeError(f"server {self.name} was started without a host spec: it runs no samples")
        if resume is None and resume_from is not None:
            resume = self._read_snapshot(sample.uid, resume_from)
        client = SampleClient(self.llm, sample.uid, resume)
        self._running[id(client)] = client
        try:
            traj = await self.agent.run(sample, client)
        finally:
            del self._running[id(client)]
            self._drop_snapshot(sample.uid)
        if resume is not None:
            traj.meta.update(resumed_tokens=client.resumed_tokens, resumed_max_version=client.resumed_max_version)
        return await asyncio.to_thread(trajectory_sample, self.plane, traj)  # may wait for arena space

    async def run_samples(self, samples: list[Sample]) -> list[Any]:
        """A group's samples (none resumed), run together; their records in order (`run_sample` each)."""
        return list(await asyncio.gather(*(self.run_sample(s) for s in samples)))

    async def partial_samples(self) -> list[SavedSample]:
        """What every training sample running here has generated so far (see the module docstring)."""
        engine = {o.request_id: o for o in await self.server.live_requests()}
        return [c.saved(engine) for c in list(self._running.values())]

    async def snapshot(self) -> dict[str, Any]:
        """Write each running training sample's state into the data plane (see the module docstring);
        {uid: handle} of every running sample that has one. Nothing where the plane dies with this
        process. A sample whose tokens did not grow keeps its snapshot."""
        if self.plane is None or not getattr(self.plane, "outlives_writer", False) or not self._running:
            return {}
        engine = {o.request_id: o for o in await self.server.live_requests()}
        out = {}
        for c in list(self._running.values()):  # no await from here: a sample cannot end meanwhile
            saved = c.saved(engine)
            old = self._snapshots.get(c.uid)
            if old is None and saved.tokens == 0:
                continue
            if old is None or old[1] != saved.tokens:
                data = np.frombuffer(encode_saved([saved]), dtype=np.uint8)
                h = self.plane.write(f"{c.uid}.snapshot", {"saved": data}, inline=False)["saved"]
                self._drop_snapshot(c.uid)
                self._snapshots[c.uid] = old = (h, saved.tokens)
            out[c.uid] = old[0]
        return out

    def _drop_snapshot(self, uid: str) -> None:
        old = self._snapshots.pop(uid, None)
        if old is not None:
            self.plane.free([old[0]])

    def _read_snapshot(self, uid: str, handle: Any) -> SavedSample | None:
        """The saved state behind a dead server's snapshot handle; None (counted) where it cannot be read."""
        try:
            arr = self.plane.read([handle])[0]
            saved = decode_saved(bytes(arr))[0]
        except (OSError, ValueError, TimeoutError, IndexError, msgspec.DecodeError) as exc:  # deliberate: start from the prompt
            self.snapshot_reads["unreadable"] += 1
            log.warning("server %s: snapshot of %s unreadable (%s): generated again from its prompt", self.name, uid, exc)
            return None
        if saved.uid != uid:
            self.snapshot_reads["unreadable"] += 1
            log.warning("server %s: a snapshot of %s was given for %s: ignored", self.name, saved.uid, uid)
            return None
        self.snapshot_reads["continued"] += 1
        return saved

    async def run_eval(self, sample: Sample) -> dict[str, Any]:
        """One held-out sample: its reward and reward info, and for `generations.jsonl` the response as
        text (at most `EVAL_TEXT_CHARS`, the middle elided; the controller renders the prompt from the
        sample's own ids), the finish reason and the response length. Nothing is stored."""
        traj = await self.eval_agent.run(sample, self.llm)
        decode = getattr(self.eval_agent, "decode", None)  # the built-in agents keep theirs; others show token ids
        text = decode(list(traj.response_ids)) if callable(decode) else " ".join(map(str, traj.response_ids))
        return {"reward": float(traj.reward), "reward_info": dict(traj.reward_info), "response": clip_text(text),
                "finish_reason": str(traj.finish_reason), "response_length": len(traj.response_ids)}

    # ---- weights ------------------------------------------------------------------------
    async def join_weights(self, cfg: Any, endpoints: list[str] | str, pause_mode: PauseMode = "keep") -> None:
        """Join the trainer's weight plane (its sender's endpoint, or every rank's when each publishes
        its own shards) and load every update it publishes from now on (a second call joins anew,
        e.g. after the trainer moved)."""
        from checkpoint_engine import Receiver, ShardedReceiver
        from checkpoint_engine.server_loop import serve_updates

        await self._leave_weights()
        endpoints = [endpoints] if isinstance(endpoints, str) else list(endpoints)
        if len(endpoints) == 1:  # the engine's own transport when it has one (vLLM: into its workers)
            self._receiver = Receiver(cfg, self.name, endpoint=endpoints[0], version=-1,
                                      transport=self.server.receiver_transport(cfg), confirm_loads=True)
        else:  # pieces from every rank, assembled here
            self._receiver = ShardedReceiver(cfg, self.name, endpoints, confirm_loads=True)
        self._stop = asyncio.Event()
        self._weights = asyncio.get_running_loop().create_task(
            serve_updates(self, self._receiver, pause_mode, stop=self._stop, on_error=self._failed))

    def _failed(self, exc: BaseException) -> None:
        self.load_errors.append(f"{type(exc).__name__}: {exc}"[:300])

    async def _leave_weights(self) -> None:
        if self._weights is not None:
            self._stop.set()  # type: ignore[union-attr]  # the receiver leaves: a wait on a dead sender ends now
            await asyncio.gather(self._weights, return_exceptions=True)
            self._weights = None
        if self._receiver is not None:
            self._receiver.close()
            self._receiver = None

    async def load_update(self, update: Any) -> None:
        """The engine's `load_update` (`RolloutServer.load_update`: its own, or the default that reads
        the pairs on a worker thread), counted: a hand-out to a peer that overlapped it is void
        (`send_offered`)."""
        self._loads += 1
        try:
            await self.server.load_update(update)
        finally:
            self._loads += 1

    # ---- weights to a peer (a server joining a live run) --------------------------------------
    async def offer_weights(self, cfg: Any, receiver_id: str) -> str | None:
        """Open a weight-plane sender of this server's own weights for `receiver_id` (a server that
        joins the run) and return its endpoint, which the joiner joins (`join_weights`); then
        `send_offered` sends them. None: this engine cannot hand its weights out, or holds none yet.
        The sender takes the run's weight config with ports of its own (0: any free one)."""
        from checkpoint_engine import Sender

        if self.server.export_weights() is None or self.version < 0:
            return None
        self._close_offer(receiver_id)
        sender = Sender(dataclasses.replace(cfg, port=0, store_port=0))
        self._offers[receiver_id] = sender
        return sender.endpoint

    async def send_offered(self, receiver_id: str, timeout_s: float) -> dict[str, Any]:
        """Send the joiner of `offer_weights` this server's weights, labelled with the version they are,
        once it joined (within `timeout_s`); then close that sender. `{"version", "loaded", "why"}`:
        loaded False when the joiner did not join or load in time, or when a load of new weights here
        overlapped the hand-out (what was read may mix two versions: it does not count)."""
        sender = self._offers.get(receiver_id)
        if sender is None:
            return {"version": -1, "loaded": False, "why": "no offer open"}
        try:
            if await asyncio.to_thread(sender.wait_for_ids, [receiver_id], timeout_s):  # still missing
                return {"version": -1, "loaded": False, "why": "the joiner did not join in time"}
            epoch, version = self._loads, self.version
            named = self.server.export_weights()
            if epoch % 2 or named is None:
                return {"version": version, "loaded": False, "why": PEER_WAS_LOADING}
            out = await asyncio.to_thread(sender.publish, named, version, [receiver_id])
            if self._loads != epoch:
                return {"version": version, "loaded": False, "why": PEER_LOADED_MEANWHILE}
            if receiver_id not in out.completed:
                return {"version": version, "loaded": False, "why": str(out.evicted.get(receiver_id, "not loaded"))}
            return {"version": version, "loaded": True, "why": "", "bytes": out.bytes, "seconds": out.seconds}
        finally:
            self._close_offer(receiver_id)

    def _close_offer(self, receiver_id: str) -> None:
        sender = self._offers.pop(receiver_id, None)
        if sender is not None:
            sender.close()

    # ---- the RolloutServer interface, forwarded ---------------------------------------------
    async def generate(self, prompt_ids: list[int], sampling: SamplingParams, request_id: str | None = None) -> GenerateOutput:
        return await self.server.generate(prompt_ids, sampling, request_id)

    async def pause(self, mode: PauseMode = "wait") -> None:
        await self.server.pause(mode)

    async def resume(self) -> None:
        await self.server.resume()

    async def update_weights(self, named_tensors: Iterable[tuple[str, Any]], version: int) -> None:
        await self.server.update_weights(named_tensors, version)

    async def reset_prefix_cache(self) -> None:
        await self.server.reset_prefix_cache()

    async def score(self, token_ids: list[int]) -> list[float] | None:
        return await self.server.score(token_ids)

    async def live_requests(self) -> list[GenerateOutput]:
        return await self.server.live_requests()

    def export_weights(self) -> Iterable[tuple[str, Any]] | None:
        return self.server.export_weights()

    def receiver_transport(self, cfg: Any) -> Any:
        return self.server.receiver_transport(cfg)

    def stats(self) -> ServerStats:
        """The engine's stats, with the back-pressure of the data plane this host writes samples into
        (`StoragePlane.backpressure`: its arena's waits)."""
        st = self.server.stats()
        if self.plane is None:
            return st
        bp = self.plane.backpressure()
        return dataclasses.replace(st, arena_waits=bp["arena_waits"], arena_wait_s=bp["arena_wait_s"],
                                   arena_waiting=bp["arena_waiting"])

    @property
    def version(self) -> int:
        return self.server.version

    async def close(self) -> None:
        for rid in list(self._offers):
            self._close_offer(rid)
        await self._leave_weights()
        await self.server.close()
