"""Router: picks a rollout server per request and is the `LLMClient` the agents call.

Policy: a request of a known session goes to the server that served that session
before (its prefix cache holds the conversation); otherwise to the server with the
fewest requests in flight (ties: lowest index). In-flight counts are the router's own,
so the choice needs no round trip to the servers.

Trace (2 servers): r1 -> s0 (0,0); r2 -> s1 (1,0); r1 ends; r3 -> s0 (0,1);
session "a" first served by s1 -> its next turns go to s1 while it is healthy.
"""

from __future__ import annotations

from collections import OrderedDict

from asyncrl.rollout.base import GenerateOutput, RolloutServer, SamplingParams


class Router:
    def __init__(self, servers: list[RolloutServer], max_sessions: int = 100_000) -> None:
        if not servers:
            raise ValueError("router needs at least one rollout server")
        self.servers = list(servers)
        self.in_flight = [0] * len(servers)
        self._sessions: OrderedDict[str, int] = OrderedDict()
        self._max_sessions = max_sessions

    def pick(self, session_id: str | None) -> int:
        if session_id is not None and session_id in self._sessions:
            self._sessions.move_to_end(session_id)
            return self._sessions[session_id]
        i = min(range(len(self.servers)), key=lambda k: self.in_flight[k])
        if session_id is not None:
            self._sessions[session_id] = i
            if len(self._sessions) > self._max_sessions:
                self._sessions.popitem(last=False)
        return i

    def end_session(self, session_id: str) -> None:
        self._sessions.pop(session_id, None)

    async def generate(
        self, prompt_ids: list[int], sampling: SamplingParams, session_id: str | None = None
    ) -> GenerateOutput:
        i = self.pick(session_id)
        self.in_flight[i] += 1
        try:
            return await self.servers[i].generate(prompt_ids, sampling)
        finally:
            self.in_flight[i] -= 1
