"""Samples in flight across a checkpoint: what each had generated, and how a resume continues it.

Server side (in the host's process): `SampleClient` is the LLM client that one sample's AgentLoop
calls. It forwards to the host's router, names each call after the sample (`<uid>/<call>`, so the
engine's `live_requests` can be matched to it), keeps the calls that finished, and, for a sample
resumed from a checkpoint, answers from the saved calls first: a call that had finished returns its
saved output, the call that was cut continues from its saved tokens (the router's `prefix`: prompt +
tokens so far, a partial rollout with per-token versions), and the sample generates on from there.
`SampleClient.saved` is what a checkpoint keeps of it (`SavedSample`).

The controller side (what a checkpoint file holds, how a resume puts it back) is `resume.py`.

A saved call is used only when the agent makes the same call again: the same prompt (a digest of its
ids) and a budget that holds the saved tokens. Otherwise the saved state is dropped from that call on
and the sample generates anew (counted `redone` when none of its saved tokens was used). Multi-turn
agents are replayed call by call: their tools run again on the same model turns, and a turn whose
prompt differs from the saved one (a tool that answered otherwise) and every later turn are generated
again. Boundary: no engines, queues or files; msgspec Structs only (no pickle).

Trace (single turn, max_tokens 48; the checkpoint found uid g-0 with 30 tokens of version 4):
    save:   host.partial_samples() -> [SavedSample("g-0", [SavedCall(digest, 30 tokens, done=False)])]
    resume: host.run_sample(sample, resume=that) -> agent -> client.generate(prompt)
            -> router.generate(prompt, prefix=30 tokens) -> engine: prompt + 30 tokens, max_tokens 18
            -> 48 tokens, versions [4] * 30 + [9] * 18; the record's meta: resumed_tokens 30
"""

from __future__ import annotations

import hashlib
from typing import Any

import msgspec

from asyncrl.engines.base import GenerateOutput, SamplingParams
from asyncrl.rollout.partial import PartialRollout

def prompt_digest(ids: list[int]) -> str:
    return hashlib.blake2b(msgspec.msgpack.encode(list(ids)), digest_size=12).hexdigest()


class SavedCall(msgspec.Struct, forbid_unknown_fields=True):
    """One `generate` call of a sample as far as it got. Invariant: the three lists share a length."""

    prompt_digest: str
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    """Policy version of each token (the weights that generated it, before the resume)."""
    done: bool = False
    """The call had returned (`finish_reason` set); False: it was cut mid-way."""
    finish_reason: str = ""


class SavedSample(msgspec.Struct, forbid_unknown_fields=True):
    """A running sample's calls, in order; only the last may be cut."""

    uid: str
    calls: list[SavedCall]

    @property
    def tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.calls)


def encode_saved(samples: list[SavedSample]) -> bytes:
    return msgspec.msgpack.encode(samples)


def decode_saved(data: bytes) -> list[SavedSample]:
    return msgspec.msgpack.decode(data, type=list[SavedSample])


class SampleClient:
    """The LLM client of one sample on a host; see the module docstring.

    `llm`: the host's router (its `generate` takes `request_id` and `prefix`, and keeps `live`)."""

    def __init__(self, llm: Any, uid: str, resume: SavedSample | None = None) -> None:
        self.llm, self.uid = llm, uid
        self.calls: list[SavedCall] = []
        """Calls that returned, in order."""
        self.current: tuple[str, str] | None = None
        """(prompt digest, request id) of the call running now."""
        self._replay = list(resume.calls) if resume is not None else []
        self.resumed_tokens = 0
        """Tokens this sample took from its saved state instead of generating them."""
        self.resumed_max_version = -1
        """The newest version among those tokens (-1: none)."""

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams, session_id: str | None = None) -> GenerateOutput:
        digest = prompt_digest(prompt_ids)
        rid = f"{self.uid}/{len(self.calls)}"
        saved = self._replay.pop(0) if self._replay else None
        if saved is not None and (saved.prompt_digest != digest or len(saved.token_ids) > sampling.max_tokens):
            saved = None  # the agent went another way: generate from here on
            self._replay.clear()
        prefix = None
        if saved is not None:
            self._reused(saved)
            if saved.done:  # it had returned before the checkpoint: its output as it was
                out = GenerateOutput(rid, list(saved.token_ids), list(saved.logprobs), list(saved.versions), saved.finish_reason)
                self.calls.append(saved)
                return out
            prefix = GenerateOutput(rid, list(saved.token_ids), list(saved.logprobs), list(saved.versions), "abort")
        self.current = (digest, rid)
        try:
            out = await self.llm.generate(prompt_ids, sampling, session_id=session_id, request_id=rid, prefix=prefix)
        finally:
            self.current = None
        self.calls.append(SavedCall(digest, list(out.token_ids), list(out.logprobs), list(out.versions), True, out.finish_reason))
        return out

    def _reused(self, saved: SavedCall) -> None:
        if saved.token_ids:
            self.resumed_tokens += len(saved.token_ids)
            self.resumed_max_version = max(self.resumed_max_version, max(saved.versions))

    def saved(self, engine: dict[str, GenerateOutput]) -> SavedSample:
        """This sample now: its returned calls and, for the one running, the router's segments so far
        plus what the engine has of the current segment (`engine`: `live_requests` by request id)."""
        calls = list(self.calls)
        if self.current is not None:
            digest, rid = self.current
            acc: PartialRollout | None = self.llm.live.get(rid)
            tokens, logprobs, versions = [], [], []
            if acc is not None:
                tokens, logprobs, versions = list(acc.token_ids), list(acc.logprobs), list(acc.versions)
                seg = engine.get(f"{rid}.{acc.segments}")
                if seg is not None:
                    tokens += seg.token_ids
                    logprobs += seg.logprobs
                    versions += seg.versions
            n = min(len(tokens), len(logprobs), len(versions))
            calls.append(SavedCall(digest, tokens[:n], logprobs[:n], versions[:n]))
        return SavedSample(self.uid, calls)
