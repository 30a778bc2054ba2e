"""`rollout.backend=cost_model`: a simulated rollout server whose costs are wall time, not compute.

Job: stand in for GPUs so that the real pipeline (Rollouter, admission, Router, TrajectoryQueue,
CheckpointEngine publish, trainer loop) can be measured on orchestration alone (`asyncrl bench
pipeline`, `asyncrl bench planes`). A server "generates" one token per `token_cost_s` for each
of up to `max_concurrency` running requests at once (continuous batching: every running request
advances together, more requests wait for a slot), so a fleet's rollout capacity is
`servers * max_concurrency / token_cost_s` tokens/s. Its outputs are real arrays (token ids,
log-probs, per-token versions) of the drawn lengths, so everything downstream moves real bytes.
Time is `asyncio.sleep`, so the CPU stays free for the pipeline itself and the measurement is of
the schedule, not of CPU contention. The trainer's counterpart is `trainer.engine=cost_model`
(`asyncrl/trainer/cost_model.py`).

What the cost model does not know: a real engine's per-token latency falls when few requests
run (decoding is memory-bound), so a real long tail costs less than here; prefill, KV-cache
limits and preemption are not modelled either.

Response lengths come from `LongTail` (by default 95% short, 5% ten times longer), drawn
per request from a seeded generator. Generated token ids encode the request's target length
(`TOKEN_BASE + length`), so a request cut by an `abort` pause and resubmitted as
prompt + partial tokens (router, partial rollouts) finishes at the same total length.

Per-token versions follow a virtual clock that stops while the server is paused in `keep` or
`abort` mode: token i of a request is produced at virtual time start + (i + 1) * token_cost_s
and carries the version loaded at that virtual time.
"""

from __future__ import annotations

import asyncio
import bisect
import random
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable

from asyncrl.engines.base import GenerateOutput, PauseMode, RolloutServer, SamplingParams, ServerStats

if TYPE_CHECKING:
    from asyncrl.config import RolloutConfig

TOKEN_BASE = 1000
"""Generated token ids are `TOKEN_BASE + target length`; prompt token ids stay below it."""


@dataclass
class LongTail:
    """Response lengths: `short_tokens * U(1 - jitter, 1 + jitter)`, times `long_factor` with
    probability `long_fraction`."""

    short_tokens: int = 100
    long_fraction: float = 0.05
    long_factor: float = 10.0
    jitter: float = 0.25

    def draw(self, rng: random.Random) -> int:
        base = self.short_tokens * rng.uniform(1 - self.jitter, 1 + self.jitter)
        return max(1, round(base * (self.long_factor if rng.random() < self.long_fraction else 1.0)))

    @property
    def mean(self) -> float:
        return self.short_tokens * (1 - self.long_fraction + self.long_fraction * self.long_factor)

    @property
    def max(self) -> int:
        return round(self.short_tokens * (1 + self.jitter) * self.long_factor) + 1


class CostModelServer(RolloutServer):
    """A rollout server whose only cost is `token_cost_s` per token per running request."""

    @classmethod
    def from_config(cls, cfg: RolloutConfig, model_path: str, *, dtype: str, seed: int, index: int = 0,
                    log_dir: str | None = None) -> CostModelServer:
        """`rollout.cost_model.*` sets the costs; `model_path` and `dtype` are not read (no model)."""
        c = cfg.cost_model
        return cls(token_cost_s=c.token_cost_s, max_concurrency=c.max_concurrency, seed=seed + index,
                   lengths=LongTail(c.short_tokens, c.long_fraction, c.long_factor, c.jitter),
                   update_cost_s=c.update_cost_s)

    def __init__(self, *, token_cost_s: float, max_concurrency: int, lengths: LongTail, seed: int, update_cost_s: float = 0.005) -> None:
        self.token_cost_s, self.max_concurrency, self.lengths = token_cost_s, max_concurrency, lengths
        self.seed, self.update_cost_s = seed, update_cost_s
        self._slots = asyncio.Semaphore(max_concurrency)
        self._open = asyncio.Event()
        self._open.set()
        self._wake: asyncio.Future | None = None
        self._frozen_at: float | None = None
        self._frozen_s = 0.0
        self._history: list[tuple[float, int]] = [(float("-inf"), 0)]
        """(virtual time, version loaded then), in time order."""
        self._abort_epoch = 0
        self._requests = 0
        self.running = 0
        self.generated_tokens = 0
        self.late_s = 0.0
        """Summed delay between a request's due time and its return (event-loop lag: CPU load)."""
        self.completions: list[tuple[float, int]] = []
        self._weights: dict[str, Any] = {}
        """What weight-plane updates land in (allocated at the first one)."""
        """(monotonic time, tokens) of every returned segment, for the bench's windows."""
        self._t0 = time.monotonic()

    # -- virtual clock ---------------------------------------------------------------------
    def vclock(self) -> float:
        now = time.monotonic() if self._frozen_at is None else self._frozen_at
        return now - self._frozen_s

    def _freeze(self) -> None:
        if self._frozen_at is None:
            self._frozen_at = time.monotonic()

    def _wake_all(self) -> None:
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)
        self._wake = None

    def _wait_future(self) -> asyncio.Future:
        if self._wake is None:
            self._wake = asyncio.get_running_loop().create_future()
        return self._wake

    # -- RolloutServer -------------------------------------------------------------------------
    def _target(self, prompt_ids: list[int], sampling: SamplingParams) -> tuple[int, int]:
        """(target length of the whole response, tokens of it already in the prompt)."""
        done = 0
        while done < len(prompt_ids) and prompt_ids[-1 - done] >= TOKEN_BASE:
            done += 1
        if done:
            return prompt_ids[-1] - TOKEN_BASE, done
        self._requests += 1
        seed = sampling.seed if sampling.seed is not None else self.seed * 1_000_003 + self._requests
        return self.lengths.draw(random.Random(seed)), 0

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams, request_id: str | None = None) -> GenerateOutput:
        target, done = self._target(prompt_ids, sampling)
        n = min(target - done, sampling.max_tokens)
        async with self._slots:
            while not self._open.is_set():
                await self._open.wait()
            self.running += 1
            epoch, start = self._abort_epoch, self.vclock()
            end = start + n * self.token_cost_s
            try:
                while epoch == self._abort_epoch:
                    remaining = end - self.vclock()
                    if remaining <= 0:
                        break
                    await asyncio.wait({self._wait_future()}, timeout=None if self._frozen_at is not None else remaining)
            finally:
                self.running -= 1
                if self.running == 0:
                    self._wake_all()  # a `wait` pause drains on this
            if epoch == self._abort_epoch:
                k = n
                self.late_s += self.vclock() - end
            else:
                k = min(n, int((self.vclock() - start) / self.token_cost_s))
        reason = "abort" if k < n else ("stop" if done + n == target else "length")
        self.generated_tokens += k
        self.completions.append((time.monotonic(), k))
        return GenerateOutput(request_id or "", [TOKEN_BASE + target] * k, [-1.0] * k, self._versions(start, k), reason)

    def _versions(self, start: float, k: int) -> list[int]:
        times = [h[0] for h in self._history]
        out: list[int] = []
        for i in range(k):
            t = start + (i + 1) * self.token_cost_s
            out.append(self._history[bisect.bisect_left(times, t) - 1][1])
        return out

    async def pause(self, mode: PauseMode = "wait") -> None:
        self._open.clear()
        if mode == "wait":
            while self.running:
                await asyncio.wait({self._wait_future()})
        self._freeze()
        if mode == "abort":
            self._abort_epoch += 1
            self._wake_all()

    async def resume(self) -> None:
        if self._frozen_at is not None:
            self._frozen_s += time.monotonic() - self._frozen_at
            self._frozen_at = None
        self._open.set()
        self._wake_all()

    async def update_weights(self, named_tensors: Iterable[tuple[str, Any]], version: int) -> None:
        for _ in named_tensors:
            pass
        await asyncio.sleep(self.update_cost_s)
        self._history.append((self.vclock(), int(version)))

    def export_weights(self) -> Iterable[tuple[str, Any]] | None:
        """The copy the last update landed in (None before one: nothing to hand out)."""
        return list(self._weights.items()) if self._weights else None

    async def load_update(self, update: Any) -> None:
        """A weight-plane update lands in this server's own copy of the weights, as an engine's load
        does (copied into buffers allocated at the first update), so the bytes really move."""
        from checkpoint_engine.receiver import land_into
        from checkpoint_engine.server_loop import blocking

        await blocking(land_into, update, self._weights, strict=False)
        await self.update_weights((), update.version)

    async def reset_prefix_cache(self) -> None:
        return None

    def stats(self) -> ServerStats:
        wall = max(time.monotonic() - self._t0, 1e-9)
        return ServerStats(self.version, self.running, not self._open.is_set(), self.generated_tokens, self.generated_tokens / wall)

    @property
    def version(self) -> int:
        return self._history[-1][1]
