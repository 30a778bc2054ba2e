"""Test doubles for agent loops: a character tokenizer and a scripted LLM client.

`ScriptedLLM` stands in for a model whose outputs we must control: a randomly initialised
model never writes a valid tool call, and the loop mechanics (masks, versions, budgets,
turn limits) can only be checked exactly against known token sequences.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Callable

from asyncrl.engines.sample import Sample
from asyncrl.engines.base import GenerateOutput, SamplingParams


def encode(text: str) -> list[int]:
    return [ord(c) for c in text]


def decode(ids: list[int]) -> str:
    return "".join(chr(i) for i in ids)


def tool_call(name: str, **arguments: object) -> str:
    return f'<tool_call>{json.dumps({"name": name, "arguments": arguments})}</tool_call>'


@dataclass
class Turn:
    text: str
    version: int = 0
    finish_reason: str = "stop"
    delay_s: float = 0.0


@dataclass
class ScriptedLLM:
    """Answers the i-th `generate` call with `turns[i]` (the last turn repeats), honouring `max_tokens`.

    Log-prob of the j-th token of call i is `-(i + 1) / 100 - j / 10000`, so tests can tell
    exactly which call produced which token. Every call's context and sampling are recorded.
    """

    turns: list[Turn]
    tokenize: Callable[[str], list[int]] = encode
    contexts: list[list[int]] = field(default_factory=list)
    samplings: list[SamplingParams] = field(default_factory=list)

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams, session_id: str | None = None) -> GenerateOutput:
        i = len(self.contexts)
        self.contexts.append(list(prompt_ids))
        self.samplings.append(sampling)
        turn = self.turns[min(i, len(self.turns) - 1)]
        if turn.delay_s:
            await asyncio.sleep(turn.delay_s)
        ids = self.tokenize(turn.text)
        finish = turn.finish_reason
        if len(ids) > sampling.max_tokens:
            ids, finish = ids[: sampling.max_tokens], "length"
        return GenerateOutput(
            request_id=f"r{i}",
            token_ids=ids,
            logprobs=[-(i + 1) / 100 - j / 10000 for j in range(len(ids))],
            versions=[turn.version] * len(ids),
            finish_reason=finish,
        )

    @staticmethod
    def logprobs_of_call(i: int, n: int) -> list[float]:
        return [-(i + 1) / 100 - j / 10000 for j in range(n)]


def make_sample(prompt: str = "Q: 6*7?\n", answer: str = "42", uid: str = "s0", index: int = 0, size: int = 1) -> Sample:
    return Sample(uid=uid, group_id="g", index_in_group=index, group_size=size, prompt_ids=encode(prompt), answer=answer)
