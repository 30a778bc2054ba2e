"""Prompt data: jsonl / parquet files or `datasets` folders -> `Prompt` records, and the demo task's generator.

Rows may be flat (`{"question": "...", "answer": "#### 4"}`) or verl's layout:

    {"data_source": "openai/gsm8k",
     "prompt": [{"role": "user", "content": "What is 2 + 2? ..."}],
     "reward_model": {"style": "rule", "ground_truth": "4"}, "extra_info": {...}}

A key may be dotted (`reward_model.ground_truth`). The prompt is a non-empty string or a list
of chat messages (`role`, `content`). `render` (the chat template, chosen by the caller) turns
messages into the text the model sees; a string prompt is first formatted with `template`
(`{prompt}`) and, when `render` is given, becomes one user message. A `Prompt`'s `text` is that
rendered text exactly. Chat messages with no `render` are a `NoChatTemplate` error.

A key that no row has is a `MissingColumn` error (the columns wanted and the ones found); rows
that cannot be used are skipped and counted by reason in `PromptSet.skipped`, never silently
and never fatally one by one:

    bad_json        a jsonl line that is not valid JSON (or not UTF-8)
    not_object      a row that is valid JSON but not an object (`[1, 2]`, `"text"`)
    missing_field   the prompt or answer is absent or null in this row (other rows have it)
    invalid_field   the prompt is neither a non-empty string nor a list of chat messages, or the
                    answer is not a string or number
    template_error  the chat template raised on this row (`RenderError`)
    too_long        the rendered prompt is longer than `max_prompt_tokens`

Whether a set with no row left is an error (and which config key to name) is the caller's
call (`asyncrl.data.tasks`). This module knows no config.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

SKIP_REASONS = ("bad_json", "not_object", "missing_field", "invalid_field", "template_error", "too_long")

Messages = list[dict[str, str]]
Render = Callable[[Messages], str]
"""Chat messages -> the prompt text the model sees (a chat template with the generation prompt)."""


@dataclass
class Prompt:
    index: int
    """Position in its data set."""
    text: str
    """The prompt exactly as the model sees it (rendered by the chat template when there is one)."""
    prompt_ids: list[int]
    answer: str
    """Reference answer given to the reward function."""
    data_source: str = ""
    """The row's `data_source` (verl's column; picks the reward), empty if it has none."""


@dataclass
class PromptSet:
    prompts: list[Prompt]
    skipped: dict[str, int] = field(default_factory=dict)
    """Rows skipped when loading, by reason (`SKIP_REASONS`); only reasons that occurred."""

    def __len__(self) -> int:
        return len(self.prompts)


@dataclass(frozen=True)
class BadLine:
    """A jsonl line that did not parse; kept in place so row indices stay line positions."""

    line: int
    error: str


class MissingColumn(ValueError):
    """No row has the column: `role` (`prompt` / `answer`), the names `wanted` (any one would do), the columns `found`."""

    def __init__(self, role: str, wanted: list[str], found: list[str]) -> None:
        self.role, self.wanted, self.found = role, wanted, found
        super().__init__(f"no {role} column {' or '.join(map(repr, wanted))}; columns found: {found}")


class NoChatTemplate(ValueError):
    """A row's prompt is a list of chat messages and no chat template was given to render it."""


class RenderError(ValueError):
    """The chat template failed on one row's messages (counted `template_error`)."""


def read_rows(path: str | Path) -> list[Any]:
    """Rows of a `.jsonl` (one JSON value per line; blank lines ignored) or `.parquet` file, or of a
    folder written by `datasets`' `save_to_disk` (one split).

    A jsonl line that does not parse comes back as a `BadLine` (counted `bad_json` by
    `build_prompts`); a missing path is `FileNotFoundError`, an unreadable file or folder `ValueError`.
    """
    p = Path(path)
    if p.is_dir():
        return _read_saved_dataset(p)
    if not p.is_file():
        raise FileNotFoundError(f"prompt file {str(p)!r} not found")
    if p.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            return pq.read_table(p).to_pylist()
        except (pa.ArrowException, OSError) as e:
            raise ValueError(f"{p}: not a readable parquet file ({e})") from None
    rows: list[Any] = []
    with p.open("rb") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
                    rows.append(BadLine(n, getattr(e, "msg", None) or str(e)))
    return rows


def _read_saved_dataset(p: Path) -> list[Any]:
    try:
        import datasets
    except ImportError:
        raise ValueError(f"{p} is a folder: reading a `datasets` save_to_disk folder needs the `datasets` package "
                         f"(not installed); or give a .parquet / .jsonl file") from None
    try:
        ds = datasets.load_from_disk(str(p))
    except (FileNotFoundError, ValueError, OSError) as e:
        raise ValueError(f"{p}: not a folder written by datasets' save_to_disk ({e})") from None
    if isinstance(ds, datasets.DatasetDict):
        raise ValueError(f"{p} holds the splits {sorted(ds)}: give one split's folder (e.g. {p / sorted(ds)[0]})")
    return ds.to_list()


_ABSENT = object()


def get_field(row: dict[str, Any], key: str) -> Any:
    """`row[key]`, where a dotted key walks nested objects (`reward_model.ground_truth`); `_ABSENT` if absent."""
    if key in row:
        return row[key]
    value: Any = row
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return _ABSENT
        value = value[part]
    return value


def columns(rows: list[Any]) -> list[str]:
    """The columns the object rows have, first seen first: top-level keys and, for objects, their dotted keys."""
    seen: dict[str, None] = {}
    for row in rows:
        if isinstance(row, dict):
            for k, v in row.items():
                seen[k] = None
                if isinstance(v, dict):
                    seen.update((f"{k}.{sub}", None) for sub in v)
    return list(seen)


def resolve_column(rows: list[Any], role: str, key: str, candidates: tuple[str, ...]) -> str:
    """`key` if some row has it (or the first of `candidates` some row has, when `key` is empty); else
    `MissingColumn`. Rows with no object at all resolve to the first name (nothing to check)."""
    wanted = [key] if key else list(candidates)
    objects = [r for r in rows if isinstance(r, dict)]
    if not objects:
        return wanted[0]
    for name in wanted:
        if any(get_field(r, name) is not _ABSENT for r in objects):
            return name
    raise MissingColumn(role, wanted, columns(objects))


def as_messages(value: Any) -> Messages | None:
    """A non-empty list of chat messages (`role` and `content` strings) as plain dicts, else None."""
    if not isinstance(value, list) or not value:
        return None
    out = []
    for m in value:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            return None
        out.append({"role": m["role"], "content": m["content"]})
    return out


def _skip_reason(row: Any, prompt_key: str, answer_key: str) -> str | None:
    if isinstance(row, BadLine):
        return "bad_json"
    if not isinstance(row, dict):
        return "not_object"
    prompt, answer = get_field(row, prompt_key), get_field(row, answer_key)
    if prompt in (None, _ABSENT) or answer in (None, _ABSENT):
        return "missing_field"
    if not (isinstance(prompt, str) and prompt.strip()) and as_messages(prompt) is None:
        return "invalid_field"
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        return "invalid_field"
    return None


def _render(prompt: str | list[Any], template: str, render: Render | None, index: int) -> str:
    if isinstance(prompt, str):
        text = template.format(prompt=prompt)
        return render([{"role": "user", "content": text}]) if render else text
    if render is None:
        raise NoChatTemplate(f"row {index}: the prompt is a list of chat messages and there is no chat template to render it")
    return render(as_messages(prompt) or [])


def build_prompts(
    rows: list[Any],
    encode: Callable[[str], list[int]],
    *,
    prompt_key: str,
    answer_key: str,
    template: str,
    max_prompt_tokens: int,
    render: Render | None = None,
    source_key: str = "data_source",
) -> PromptSet:
    """The usable rows as `Prompt`s (index: position in `rows`), the others counted by reason.

    Raises `MissingColumn` when no row has `prompt_key` or `answer_key`, `NoChatTemplate` at the
    first chat-message prompt when `render` is None."""
    resolve_column(rows, "prompt", prompt_key, ())
    resolve_column(rows, "answer", answer_key, ())
    out, skipped = [], dict.fromkeys(SKIP_REASONS, 0)
    for i, row in enumerate(rows):
        reason = _skip_reason(row, prompt_key, answer_key)
        if reason is None:
            try:
                text = _render(get_field(row, prompt_key), template, render, i)
            except RenderError:
                reason = "template_error"
        if reason is None:
            ids = encode(text)
            if len(ids) > max_prompt_tokens:
                reason = "too_long"
            else:
                source = get_field(row, source_key)
                out.append(Prompt(index=i, text=text, prompt_ids=ids, answer=str(get_field(row, answer_key)),
                                  data_source=source if isinstance(source, str) else ""))
        if reason is not None:
            skipped[reason] += 1
    return PromptSet(out, {k: v for k, v in skipped.items() if v})


DIGIT_TASKS = {
    "reverse": lambda d: d[::-1],
    "increment": lambda d: "".join(str((int(c) + 1) % 10) for c in d),
}


def digit_rows(n: int, num_digits: int, seed: int, task: str = "reverse") -> list[dict[str, str]]:
    """`n` distinct rows of a digit task from a seeded generator, e.g. reverse:
    {"question": "1234=", "answer": "4321"}; increment: {"question": "1239=", "answer": "2340"}."""
    transform = DIGIT_TASKS[task]
    rng = random.Random(seed)
    n = min(n, 10**num_digits)
    seen: set[str] = set()
    while len(seen) < n:
        seen.add("".join(rng.choice("0123456789") for _ in range(num_digits)))
    digits = sorted(seen)
    rng.shuffle(digits)
    return [{"question": d + "=", "answer": transform(d)} for d in digits]


class PromptStream:
    """Endless shuffled passes over a prompt set; `position` (prompts handed out) is checkpointed.

    Trace: 3 prompts, seed 0 -> epoch 0 order [2, 0, 1], epoch 1 order [1, 2, 0], ...;
    after `restore(4)` the next prompt is the 5th of that same sequence.
    """

    def __init__(self, prompts: PromptSet, seed: int) -> None:
        if not len(prompts):
            raise ValueError("prompt set is empty: nothing to train on")
        self._prompts, self._seed = prompts.prompts, seed
        self.position = 0
        self._epoch, self._perm = -1, []

    def _order(self, epoch: int) -> list[int]:
        if epoch != self._epoch:  # one shuffle per pass, not per prompt
            self._perm = list(range(len(self._prompts)))
            random.Random(self._seed * 1_000_003 + epoch).shuffle(self._perm)
            self._epoch = epoch
        return self._perm

    def __iter__(self) -> Iterator[Prompt]:
        return self

    def __next__(self) -> Prompt:
        epoch, k = divmod(self.position, len(self._prompts))
        self.position += 1
        return self._prompts[self._order(epoch)[k]]

    def restore(self, position: int) -> None:
        self.position = position
