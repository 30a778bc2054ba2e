"""The engine thread of the torch rollout server: one loop that owns the model and decode state.

Job: repeat { take commands and admissible requests from the inbox; apply commands (weight
copy, cache reset, abort, pause barriers); admit requests (prefix cache or one batched
prefill, then their first token); one decode step for every running row; finish rows and
resolve their futures on their event loop }.
Boundary: talks to the asyncio side only through `Inbox` (under its condition variable) and
the futures it resolves; knows nothing of asyncio beyond `call_soon_threadsafe`.
Why one thread and commands: weights, KV and the prefix cache change only between steps, in
the thread that computes with them, so no step ever sees half-loaded weights.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Container

import torch

from asyncrl.engines.base import GenerateOutput, PauseMode, SamplingParams
from asyncrl.engines.torch_kv import DecodeBatch, PrefixCache, prefill
from asyncrl.engines.torch_sampling import sample

PREFILL_CHUNK = 64
"""Most sequences in one prefill forward (bounds the padded activation memory)."""


def resolve(loop: asyncio.AbstractEventLoop, future: asyncio.Future, result: Any = None,
            error: BaseException | None = None) -> None:
    """Settle `future` on its own event loop (thread-safe); a cancelled or closed one is skipped."""
    def settle() -> None:
        if future.done():  # the caller was cancelled
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    if not loop.is_closed():
        loop.call_soon_threadsafe(settle)


@dataclass(eq=False)
class Request:
    """One generate call. Per-token lists grow in the engine thread only."""

    rid: str
    prompt: list[int]
    sampling: SamplingParams
    stop_ids: Container[int]
    """`token in stop_ids` ends the request: a set of ids, or a `torch_sampling.StopRule` (ids and stop strings)."""
    uniforms: list[float]
    """One uniform per token this request may generate (from its own seeded generator)."""
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    cancelled: bool = False

    def output(self, finish_reason: str) -> GenerateOutput:
        return GenerateOutput(self.rid, list(self.tokens), list(self.logprobs), list(self.versions), finish_reason)


@dataclass(eq=False)
class Command:
    """Work for the engine thread between steps: `update`, `reset_prefix_cache`, `abort_all`,
    `drain` (resolved once no request runs), `barrier` (resolved at the next step boundary),
    `score` (resolved with the log-probs of the payload's token ids), `live` (resolved with what
    every running request has so far)."""

    kind: str
    payload: Any
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future


@dataclass
class Inbox:
    """What the asyncio side and the engine thread share; every field is guarded by `cv`."""

    cv: threading.Condition = field(default_factory=threading.Condition)
    pending: deque[Request] = field(default_factory=deque)
    commands: list[Command] = field(default_factory=list)
    paused: PauseMode | None = None
    closed: bool = False
    error: BaseException | None = None
    in_flight: int = 0
    counter: int = 0
    generated_tokens: int = 0
    recent: deque[tuple[float, int]] = field(default_factory=deque)
    first_step_at: float = 0.0
    rate_window_s: float = 10.0

    def raise_if_unusable(self) -> None:
        if self.error is not None:
            raise RuntimeError("torch rollout engine thread died") from self.error
        if self.closed:
            raise RuntimeError("torch rollout server is closed")


class EngineWorker:
    """Runs in the engine thread (`run`); every other method is called from that thread only."""

    def __init__(self, model: Any, inbox: Inbox, device: torch.device, *, max_batch_size: int,
                 prefix_cache: PrefixCache, max_model_len: int) -> None:
        self.model = model
        self.inbox = inbox
        self.device = device
        self.max_batch_size = max_batch_size
        self.prefix_cache = prefix_cache
        self.max_model_len = max_model_len
        self.version = 0
        self.batch = DecodeBatch(device)
        self._drain_waiters: list[Command] = []

    def run(self) -> None:
        try:
            with torch.inference_mode():  # grad mode is per thread
                while self._iterate():
                    pass
        except BaseException as exc:  # a dead engine fails every caller loudly, with the cause
            self._fail(exc)
            raise

    def _iterate(self) -> bool:
        inbox = self.inbox
        with inbox.cv:
            while not (inbox.closed or inbox.commands or (inbox.paused is None and inbox.pending)
                       or (self.batch.rows and inbox.paused in (None, "wait"))):
                inbox.cv.wait()
            if inbox.closed:
                self._shutdown()
                return False
            commands, inbox.commands = inbox.commands, []
            admit: list[Request] = []
            while inbox.paused is None and inbox.pending and len(self.batch) + len(admit) < self.max_batch_size:
                admit.append(inbox.pending.popleft())
            decode = inbox.paused in (None, "wait")
        for cmd in commands:
            self._apply(cmd)
        self._drop_cancelled()
        if admit:
            self._admit(admit)
        if decode and self.batch.rows:
            self._decode()
        if not self.batch.rows:
            for cmd in self._drain_waiters:
                resolve(cmd.loop, cmd.future)
            self._drain_waiters.clear()
        return True

    # -- commands ------------------------------------------------------------------------

    def _apply(self, cmd: Command) -> None:
        if cmd.kind == "update":
            updates, version = cmd.payload
            with torch.no_grad():
                for param, tensor in updates:
                    param.copy_(tensor)
            self.prefix_cache.clear()
            self.version = version
            self._recompute_running()
        elif cmd.kind == "reset_prefix_cache":
            self.prefix_cache.clear()
        elif cmd.kind == "abort_all":  # queued requests were returned by `pause` itself
            for req in self.batch.rows:
                self._finish(req, "abort")
            self.batch.clear()
        elif cmd.kind == "drain":
            self._drain_waiters.append(cmd)
            return
        elif cmd.kind == "score":
            resolve(cmd.loop, cmd.future, self._score(cmd.payload))
            return
        elif cmd.kind == "live":  # between steps: every row's lists have the same length
            resolve(cmd.loop, cmd.future, [r.output("running") for r in self.batch.rows if not r.cancelled])
            return
        elif cmd.kind != "barrier":
            raise ValueError(f"unknown engine command {cmd.kind!r}")
        resolve(cmd.loop, cmd.future)

    def _score(self, ids: list[int]) -> list[float]:
        """Teacher-forced log-probs at temperature 1 of `ids[1:]` under the current weights."""
        x = torch.tensor([ids], device=self.device)
        logits = self.model(input_ids=x, use_cache=False).logits[0, :-1].float()
        return torch.log_softmax(logits, dim=-1).gather(-1, x[0, 1:, None])[:, 0].tolist()

    def _recompute_running(self) -> None:
        """Rebuild the KV of running rows with the current weights (context minus the next input)."""
        rows = list(self.batch.rows)
        self.batch.clear()
        for start in range(0, len(rows), PREFILL_CHUNK):
            chunk = rows[start : start + PREFILL_CHUNK]
            kvs, _ = prefill(self.model, [r.prompt + r.tokens[:-1] for r in chunk], self.device)
            self.batch.add(chunk, kvs, [r.tokens[-1] for r in chunk])

    # -- admission and decoding ----------------------------------------------------------

    def _admit(self, reqs: list[Request]) -> None:
        """Prefill (or fetch from the prefix cache) each distinct prompt once, sample first tokens."""
        groups: dict[tuple[int, ...], list[Request]] = {}
        for req in reqs:
            groups.setdefault(tuple(req.prompt), []).append(req)
        entries = {}
        misses = []
        for key, members in groups.items():
            entry = self.prefix_cache.get(key)
            self.prefix_cache.hits += len(members) - 1  # copies of a prompt in one admission reuse its KV
            if entry is None:
                misses.append(key)
            else:
                entries[key] = entry
        for start in range(0, len(misses), PREFILL_CHUNK):
            chunk = misses[start : start + PREFILL_CHUNK]
            kvs, logits = prefill(self.model, [list(k) for k in chunk], self.device)
            for key, kv, row_logits in zip(chunk, kvs, logits):
                entries[key] = (kv, row_logits)
                self.prefix_cache.put(key, kv, row_logits)
        ordered = [req for members in groups.values() for req in members]
        logits = torch.stack([entries[tuple(req.prompt)][1] for req in ordered])
        alive, _ = self._sample_and_record(ordered, logits)
        self.batch.add([ordered[i] for i in alive], [entries[tuple(ordered[i].prompt)][0] for i in alive],
                       [ordered[i].tokens[-1] for i in alive])

    def _decode(self) -> None:
        logits = self.batch.forward(self.model)
        alive, tokens = self._sample_and_record(self.batch.rows, logits)
        self.batch.set_inputs(tokens)
        self.batch.keep(alive)

    def _sample_and_record(self, reqs: list[Request], logits: torch.Tensor) -> tuple[list[int], torch.Tensor]:
        """Sample one token for each of `reqs`, append it, finish those that are done.

        Returns the indices of the requests that continue, and the sampled tokens.
        """
        dev = logits.device
        temperature = torch.tensor([r.sampling.temperature for r in reqs], dtype=torch.float32, device=dev)
        top_k = torch.tensor([r.sampling.top_k for r in reqs], dtype=torch.long, device=dev)
        top_p = torch.tensor([r.sampling.top_p for r in reqs], dtype=torch.float32, device=dev)
        uniforms = torch.tensor([r.uniforms[len(r.tokens)] for r in reqs], dtype=torch.float64, device=dev)
        tokens, logprobs = sample(logits, temperature, top_k, top_p, uniforms)
        self._count(len(reqs))  # before any future resolves, so stats agree with returned outputs
        alive = []
        for i, (req, token, logprob) in enumerate(zip(reqs, tokens.tolist(), logprobs.tolist())):
            req.tokens.append(token)
            req.logprobs.append(logprob)
            req.versions.append(self.version)
            if token in req.stop_ids:
                self._finish(req, "stop")
            elif len(req.tokens) >= req.sampling.max_tokens or len(req.prompt) + len(req.tokens) >= self.max_model_len:
                self._finish(req, "length")
            else:
                alive.append(i)
        return alive, tokens

    def _drop_cancelled(self) -> None:
        if any(r.cancelled for r in self.batch.rows):
            keep = [i for i, r in enumerate(self.batch.rows) if not r.cancelled]
            for r in self.batch.rows:
                if r.cancelled:
                    self._finish(r, "abort")
            self.batch.keep(keep)

    # -- bookkeeping ---------------------------------------------------------------------

    def _count(self, n: int) -> None:
        now = time.monotonic()
        with self.inbox.cv:
            self.inbox.generated_tokens += n
            self.inbox.recent.append((now, n))
            if not self.inbox.first_step_at:
                self.inbox.first_step_at = now

    def _finish(self, req: Request, reason: str) -> None:
        with self.inbox.cv:
            self.inbox.in_flight -= 1
        resolve(req.loop, req.future, req.output(reason))

    def _shutdown(self) -> None:
        """Called under the inbox lock when closing: return what is in flight as aborted."""
        for req in list(self.batch.rows) + list(self.inbox.pending):
            self.inbox.in_flight -= 1
            resolve(req.loop, req.future, req.output("abort"))
        self.batch.clear()
        self.inbox.pending.clear()
        closed = RuntimeError("torch rollout server is closed")
        for cmd in self.inbox.commands + self._drain_waiters:
            resolve(cmd.loop, cmd.future, error=closed)
        self.inbox.commands.clear()

    def _fail(self, exc: BaseException) -> None:
        with self.inbox.cv:
            self.inbox.error = exc
            reqs = list(self.batch.rows) + list(self.inbox.pending)
            self.inbox.pending.clear()
            cmds = self.inbox.commands + self._drain_waiters
            self.inbox.commands = []
        error = RuntimeError(f"torch rollout engine thread died: {exc!r}")
        for item in reqs + cmds:
            resolve(item.loop, item.future, error=error)
