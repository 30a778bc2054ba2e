"""Partial rollouts: one caller request assembled from the segments that servers returned.

Job: when a server pauses in `abort` mode for a weight update (or dies, see `router.Failover`),
a request comes back unfinished. `PartialRollout` keeps what was generated so far and builds the
next segment's request: prompt + tokens so far, `max_tokens` reduced by what is already there,
and a seed derived from the caller's seed and the cut point, so a rerun with the same cuts samples
the same tokens. The result concatenates token ids, log-probs and per-token versions, so one
`generate` call returns the whole response and every token keeps the version that produced it.
Boundary: pure bookkeeping, no servers, no asyncio; the router drives it.

Example (max_tokens 8, a weight update after 3 tokens):
    acc = PartialRollout([5, 6], SamplingParams(max_tokens=8, seed=7))
    acc.add(GenerateOutput("r", [9, 9, 4], [-.1, -.2, -.3], [0, 0, 0], "abort"))
    acc.request()   # ([5, 6, 9, 9, 4], max_tokens=5, seed=derived(7, 3))
    acc.add(GenerateOutput("r", [8, 2], [-.4, -.5], [1, 1], "stop"))
    acc.done, acc.result().versions   # True, [0, 0, 0, 1, 1]
"""

from __future__ import annotations

import dataclasses
import hashlib

from asyncrl.engines.base import GenerateOutput, SamplingParams

SEED_MASK = (1 << 62) - 1


def segment_seed(seed: int, generated: int) -> int:
    """The seed of the segment that starts after `generated` tokens of a request seeded `seed`
    (the first segment keeps `seed` itself)."""
    if generated == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}:{generated}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & SEED_MASK


class PartialRollout:
    """The segments of one caller request; see the module docstring."""

    def __init__(self, prompt_ids: list[int], sampling: SamplingParams, request_id: str = "") -> None:
        self.prompt_ids = list(prompt_ids)
        self.sampling = sampling
        self.request_id = request_id
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.finish_reason: str | None = None
        self.segments = 0
        """Segments added so far (1 for a request that was never cut)."""

    @property
    def done(self) -> bool:
        """Finished (`stop` / `length`), or out of token budget."""
        return self.finish_reason is not None

    def request(self) -> tuple[list[int], SamplingParams]:
        """Prompt and sampling of the next segment."""
        if self.done:
            raise RuntimeError(f"request {self.request_id}: already finished ({self.finish_reason})")
        n = len(self.token_ids)
        if n == 0:
            return list(self.prompt_ids), self.sampling
        seed = None if self.sampling.seed is None else segment_seed(self.sampling.seed, n)
        sampling = dataclasses.replace(self.sampling, max_tokens=self.sampling.max_tokens - n, seed=seed)
        return self.prompt_ids + self.token_ids, sampling

    def add(self, out: GenerateOutput) -> None:
        """Append one segment. `abort` keeps the request open unless its budget is spent."""
        if self.done:
            raise RuntimeError(f"request {self.request_id}: segment after the end ({self.finish_reason})")
        if not len(out.token_ids) == len(out.logprobs) == len(out.versions):
            raise ValueError(f"request {self.request_id}: segment lists differ in length")
        self.token_ids += out.token_ids
        self.logprobs += out.logprobs
        self.versions += out.versions
        self.segments += 1
        if len(self.token_ids) > self.sampling.max_tokens:
            raise ValueError(f"request {self.request_id}: {len(self.token_ids)} tokens exceed max_tokens {self.sampling.max_tokens}")
        if out.finish_reason != "abort":
            self.finish_reason = out.finish_reason
        elif len(self.token_ids) == self.sampling.max_tokens:
            self.finish_reason = "length"

    def result(self) -> GenerateOutput:
        """The whole response: every segment concatenated."""
        if not self.done:
            raise RuntimeError(f"request {self.request_id}: not finished")
        return GenerateOutput(self.request_id, list(self.token_ids), list(self.logprobs), list(self.versions),
                              self.finish_reason)  # type: ignore[arg-type]
