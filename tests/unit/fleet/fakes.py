"""`ScriptedServer`: a stand-in for a model server whose timing (and death) a test must control."""

from __future__ import annotations

import asyncio

from asyncrl.engines.base import GenerateOutput, RolloutServer, SamplingParams, ServerStats
from asyncrl.rollout.router import ServerDied


class ScriptedServer(RolloutServer):
    """Stands in for a model server whose timing we must control: each request holds until the
    test releases it (`release()`), or the server is killed (`die()`: every open and later call
    raises `ServerDied`) or paused in abort mode (`abort_all()`: open calls return what they
    have, `k` tokens each). Tokens are `token` repeated; log-prob -0.5; version `self.v`."""

    def __init__(self, name: str, token: int = 7, k: int = 2, hold: bool = True) -> None:
        self.name, self.token, self.k, self.hold = name, token, k, hold
        self.v = 0
        self.served: list[tuple[list[int], SamplingParams]] = []
        self.open: list[tuple[asyncio.Future, SamplingParams]] = []
        self.dead = False

    async def generate(self, prompt_ids, sampling, request_id=None) -> GenerateOutput:
        if self.dead:
            raise ServerDied(f"{self.name} is dead")
        self.served.append((list(prompt_ids), sampling))
        fut = asyncio.get_running_loop().create_future()
        self.open.append((fut, sampling))
        if not self.hold:
            self._finish(fut, sampling, sampling.max_tokens, "length")
        try:
            return await fut
        finally:
            self.open = [(f, s) for f, s in self.open if f is not fut]

    def _finish(self, fut, sampling: SamplingParams, n: int, reason: str) -> None:
        n = min(n, sampling.max_tokens)
        if not fut.done():
            fut.set_result(GenerateOutput(self.name, [self.token] * n, [-0.5] * n, [self.v] * n, reason))

    def release(self) -> None:
        for fut, sp in list(self.open):
            self._finish(fut, sp, sp.max_tokens, "length")

    def abort_all(self) -> None:
        for fut, sp in list(self.open):
            self._finish(fut, sp, self.k, "abort")

    def die(self) -> None:
        self.dead = True
        for fut, _ in list(self.open):
            if not fut.done():
                fut.set_exception(ServerDied(f"{self.name} died"))

    def _alive(self) -> None:
        if self.dead:
            raise ServerDied(f"{self.name} is dead")

    async def pause(self, mode="wait") -> None:
        self._alive()

    async def resume(self) -> None:
        self._alive()

    async def update_weights(self, named_tensors, version: int) -> None:
        self._alive()
        self.v = version

    async def reset_prefix_cache(self) -> None: ...

    def stats(self) -> ServerStats:
        return ServerStats(self.v, len(self.open), False, 0, 0.0, healthy=not self.dead)

    @property
    def version(self) -> int:
        return self.v
