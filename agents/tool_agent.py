"""Multi-turn tool agent (ReAct style): generate, run the tool calls, append their results, repeat.

Job: turn one `Sample` into one `Trajectory` whose response interleaves model turns and
tool responses, all as tokens:

    prompt | turn 1 (model) | tool turn 1 (tools) | turn 2 (model) | ... | last turn (model)
    mask:     1 1 1 1          0 0 0 0 0             1 1 1             ...
    version:  v v v v         -1 -1 -1 -1 -1         v' v' v'
    logprob:  engine's         0 0 0 0 0             engine's

Each turn generates from the whole token context so far (prompt + every earlier token),
so no text is re-tokenised and the trained tokens are exactly the sampled ones.

The tool turn's markup: when the agent has a tokenizer with a chat template (`tokenizer`,
`chat_template=True`), the template renders it (`ChatTemplateTurns`): what follows the model's
turn in `apply_chat_template([..., assistant, tool, tool], add_generation_prompt=True)`,
i.e. the close of the assistant turn (unless the model generated it), one `tool` message per
call and the next assistant header; those are the only tokens added (mask 0). Without a
template the hard-coded `tool_turn_template` / `tool_response_template` markup is used. The loop
stops when a turn has no tool call (`done`), after `max_turns` model turns (`max_turns`),
when a turn hits `sampling.max_tokens` without a call (`turn_budget`), when the response
(tool tokens included) reaches `max_response_tokens` (`total_budget`), or when the server
aborted the request (`abort`). Then the reward function scores the decoded response
through `agents.scoring.Scorer`: its failures are counted, never raised, until
`max_reward_failures` in a row raise `RewardBroken`, which propagates out of `run`.

Tool failures never end a rollout: malformed calls, unknown tools, bad arguments, tool
exceptions and timeouts all become an `Error: ...` tool response the model can read.
Boundary: no Ray, no queues; the fleet behind `llm` and the tools' processes are not ours.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any, Callable, Literal, Sequence

from agents.base import AgentLoop, LLMClient
from agents.scoring import Scorer
from agents.tool_parsers import ToolCall, ToolParser, get_parser
from agents.tools.base import Tool, build_tools, call_tool
from asyncrl.engines.base import SamplingParams
from asyncrl.engines.sample import Sample
from asyncrl.types import Trajectory

HERMES_RESPONSE = "<tool_response>\n{result}\n</tool_response>"
QWEN_TOOL_TURN = "\n<|im_start|>user\n{responses}<|im_end|>\n<|im_start|>assistant\n"
"""Tool turn for Qwen chat templates (the model's turn ends with <|im_end|>, its stop token)."""


TURN_MARK = "<<asyncrl-assistant-turn>>"
"""Stands for the model's turn when rendering: the tool turn is the template's text after it."""


class ChatTemplateTurns:
    """Tool turns rendered by a HF tokenizer's chat template, as token ids to append after a model turn.

    The conversation before the model's turn does not change what a template renders after it
    (role markers close and open turns), so a one-message stand-in history is rendered:
    `[user ".", assistant TURN_MARK, tool r1, ...]` with the generation prompt, and the text after
    `TURN_MARK` is the tool turn. If the model's last token is a special token that this text
    starts with (ChatML's `<|im_end|>`, the stop token), it is not repeated.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.special = set(getattr(tokenizer, "all_special_ids", []) or [])
        try:
            self.text(["probe"], ["probe"])
        except Exception as e:  # a template that cannot render role `tool` (or drops assistant text): say which key helps
            raise ValueError(f"agent.kwargs.chat_template: the tokenizer's chat template cannot render a tool turn "
                             f"({type(e).__name__}: {e}); set agent.kwargs.chat_template=false to use tool_turn_template") from None

    def text(self, results: Sequence[str], names: Sequence[str]) -> str:
        msgs = [{"role": "user", "content": "."}, {"role": "assistant", "content": TURN_MARK}]
        msgs += [{"role": "tool", "name": n, "content": r} for r, n in zip(results, names)]
        out = self.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        if TURN_MARK not in out:
            raise ValueError("the rendered conversation lost the assistant's content")
        return out.split(TURN_MARK, 1)[1]

    def ids(self, generated: Sequence[int], results: Sequence[str], names: Sequence[str]) -> list[int]:
        text = self.text(results, names)
        if generated and generated[-1] in self.special:
            closing = self.tokenizer.decode([generated[-1]], skip_special_tokens=False)
            if closing and text.startswith(closing):
                text = text[len(closing):]
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])


def chat_turns(tokenizer: Any, enabled: bool) -> ChatTemplateTurns | None:
    """The template renderer when `enabled` and `tokenizer` has a chat template, else None (hard-coded markup)."""
    if not enabled or tokenizer is None or not getattr(tokenizer, "chat_template", None):
        return None
    return ChatTemplateTurns(tokenizer)


class ToolAgent(AgentLoop):
    """ReAct loop over token ids; see the module docstring.

    Args:
        encode: text -> token ids, without special tokens added (tool turns are encoded with it).
        decode: token ids -> text (turns are parsed from it; the reward reads it).
        reward_fn: `fn(response_text, answer) -> float | (float, info)`, sync or async.
        sampling: per-turn sampling; its `max_tokens` is the per-turn token budget.
        tools: `Tool`s, registry names, or `{"name": ..., **kwargs}` mappings.
        parser: a `ToolParser` or a registered parser name (`hermes`).
        max_turns: most model turns (generate calls) per rollout.
        max_response_tokens: total budget for everything after the prompt, tool tokens included.
        max_tool_calls_per_turn: calls beyond this in one turn are answered with an error, not run.
        tool_timeout_s: wall-clock limit per tool call (on top of the tool's own limits).
        reward_timeout_s: limit for the reward function (from when it starts running).
        reward_workers: threads of this process's reward pool (`agent.reward_workers`).
        max_reward_failures: reward failures in a row that raise `RewardBroken`.
        reward_name: names the reward in errors (default: its `module:qualname`).
        tool_response_template: one call's result; `{name}` and `{result}` are filled in.
        tool_turn_template: the tool turn appended after a model turn; `{responses}` is the
            concatenated tool responses (see `QWEN_TOOL_TURN` for Qwen chat markup).
        reward_text: `response` (the whole decoded response) or `last_turn` (the final model turn).
        tokenizer: a HF tokenizer; with a chat template (and `chat_template`), tool turns are
            rendered by it and the two templates above are not used.
        chat_template: false keeps the hard-coded markup even when the tokenizer has a template.
    """

    def __init__(
        self,
        *,
        encode: Callable[[str], list[int]],
        decode: Callable[[list[int]], str],
        reward_fn: Callable[..., Any],
        sampling: SamplingParams,
        tools: Sequence[Tool | str | dict[str, Any]] = (),
        parser: ToolParser | str = "hermes",
        max_turns: int = 4,
        max_response_tokens: int = 1024,
        max_tool_calls_per_turn: int = 4,
        tool_timeout_s: float = 30.0,
        reward_timeout_s: float = 10.0,
        tool_response_template: str = HERMES_RESPONSE,
        tool_turn_template: str = "\n{responses}\n",
        reward_text: Literal["response", "last_turn"] = "response",
        reward_workers: int = 4,
        max_reward_failures: int = 100,
        reward_name: str | None = None,
        tokenizer: Any = None,
        chat_template: bool = True,
    ) -> None:
        if max_turns < 1:
            raise ValueError(f"agent.max_turns must be >= 1, got {max_turns}")
        if max_response_tokens < 1:
            raise ValueError(f"agent.max_response_tokens must be >= 1, got {max_response_tokens}")
        if reward_text not in ("response", "last_turn"):
            raise ValueError(f"agent.reward_text must be 'response' or 'last_turn', got {reward_text!r}")
        self.encode, self.decode, self.reward_fn, self.sampling = encode, decode, reward_fn, sampling
        self.tools = build_tools(list(tools))
        self.parser = get_parser(parser) if isinstance(parser, str) else parser
        self.max_turns, self.max_response_tokens = max_turns, max_response_tokens
        self.max_tool_calls_per_turn, self.tool_timeout_s = max_tool_calls_per_turn, tool_timeout_s
        self.reward_timeout_s, self.reward_text = reward_timeout_s, reward_text
        self.tool_response_template, self.tool_turn_template = tool_response_template, tool_turn_template
        self.chat = chat_turns(tokenizer, chat_template)
        self.scorer = Scorer(reward_fn, name=reward_name, timeout_s=reward_timeout_s, max_failures=max_reward_failures,
                             workers=reward_workers)

    async def run(self, sample: Sample, llm: LLMClient, tools: Sequence[Tool] | None = None) -> Trajectory:
        """One rollout; `tools` replaces the agent's tools for this sample only."""
        toolbox = self.tools if tools is None else build_tools(list(tools))
        t0, clock = time.time(), {"generate": 0.0, "tools": 0.0}
        ids: list[int] = []
        logprobs: list[float] = []
        mask: list[int] = []
        versions: list[int] = []
        turns = n_calls = n_errors = tool_tokens = 0
        last_text, stop, finish = "", "done", "stop"
        while True:
            left = self.max_response_tokens - len(ids)
            sampling = dataclasses.replace(self.sampling, max_tokens=min(self.sampling.max_tokens, left))
            t = time.monotonic()
            out = await llm.generate(list(sample.prompt_ids) + ids, sampling, session_id=sample.uid)
            clock["generate"] += time.monotonic() - t
            turns += 1
            ids += out.token_ids
            logprobs += out.logprobs
            mask += [1] * len(out.token_ids)
            versions += out.versions
            last_text = self.decode(out.token_ids)
            if out.finish_reason == "abort":
                stop, finish = "abort", "abort"
                break
            calls = self.parser.parse(last_text)
            if not calls:
                finish = out.finish_reason
                stop = "done" if finish == "stop" else "total_budget" if len(ids) >= self.max_response_tokens else "turn_budget"
                break
            if turns >= self.max_turns:
                stop, finish = "max_turns", "length"
                break
            if len(ids) >= self.max_response_tokens:  # no room left for the tool turn
                stop, finish = "total_budget", "length"
                break
            t = time.monotonic()
            results = await self._call_tools(calls, toolbox)
            clock["tools"] += time.monotonic() - t
            n_calls += len(calls)
            n_errors += sum(not ok for _, ok in results)
            tool_ids = self._tool_turn(out.token_ids, calls, [r for r, _ in results])[: self.max_response_tokens - len(ids)]
            ids += tool_ids
            logprobs += [0.0] * len(tool_ids)
            mask += [0] * len(tool_ids)
            versions += [-1] * len(tool_ids)
            tool_tokens += len(tool_ids)
            if len(ids) >= self.max_response_tokens:
                stop, finish = "total_budget", "length"
                break
        generated = [v for v, m in zip(versions, mask) if m] or [0]
        traj = Trajectory(
            uid=sample.uid, group_id=sample.group_id, index_in_group=sample.index_in_group,
            group_size=sample.group_size, prompt_ids=list(sample.prompt_ids), response_ids=ids,
            behavior_logprobs=logprobs, loss_mask=mask, token_versions=versions,
            min_version=min(generated), max_version=max(generated), finish_reason=finish,
            meta=dict(sample.meta) | {"agent": "tool", "turns": turns, "tool_calls": n_calls,
                                      "tool_errors": n_errors, "tool_tokens": tool_tokens, "stop": stop},
            timings={"created": t0, **clock},
        )
        t = time.monotonic()
        text = self.decode(ids) if self.reward_text == "response" else last_text
        traj.reward, traj.reward_info = await self.scorer(text, sample.answer)
        traj.timings["reward"] = time.monotonic() - t
        return traj.validate()

    def _tool_turn(self, generated: list[int], calls: list[ToolCall], results: list[str]) -> list[int]:
        """Token ids of the tool turn after the model turn `generated` (mask 0): template-rendered or hard-coded."""
        if self.chat is not None:
            return self.chat.ids(generated, results, [c.name for c in calls])
        text = self.tool_turn_template.format(responses="".join(
            self.tool_response_template.format(name=c.name, result=r) for c, r in zip(calls, results)))
        return list(self.encode(text))

    async def _call_tools(self, calls: list[ToolCall], toolbox: dict[str, Tool]) -> list[tuple[str, bool]]:
        """Run a turn's calls concurrently; each gives (text for the model, ok)."""

        async def one(i: int, c: ToolCall) -> tuple[str, bool]:
            if c.error is not None:
                return f"Error: {c.error}", False
            if i >= self.max_tool_calls_per_turn:
                return f"Error: more than {self.max_tool_calls_per_turn} tool calls in one turn; this one was not run", False
            if c.name not in toolbox:
                return f"Error: unknown tool {c.name!r}; available: {sorted(toolbox)}", False
            return await call_tool(toolbox[c.name], c.name, c.arguments, self.tool_timeout_s)

        return list(await asyncio.gather(*(one(i, c) for i, c in enumerate(calls))))
