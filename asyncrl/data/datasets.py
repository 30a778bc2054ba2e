"""Prompt files: jsonl or parquet rows -> `Prompt` records, and the demo task's generator.

A `Prompt` carries the text, its token ids, the reference answer and its index in the
data set (its row in the file). Rows that cannot be used are skipped and counted by
reason in `PromptSet.skipped`, never silently and never fatally one by one:

    bad_json       a jsonl line that is not valid JSON (or not UTF-8)
    not_object     a row that is valid JSON but not an object (`[1, 2]`, `"text"`)
    missing_field  the prompt or answer column is absent or null
    invalid_field  the prompt is not a non-empty string, or the answer not a string or number
    too_long       the templated prompt is longer than `max_prompt_tokens`

Whether a set with no row left is an error (and which config key to name) is the caller's
call (`asyncrl.data.tasks`). This module knows no config.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

SKIP_REASONS = ("bad_json", "not_object", "missing_field", "invalid_field", "too_long")


@dataclass
class Prompt:
    index: int
    """Position in its data set."""
    text: str
    prompt_ids: list[int]
    answer: str
    """Reference answer given to the reward function."""


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


def read_rows(path: str | Path) -> list[Any]:
    """Rows of a `.jsonl` (one JSON value per line; blank lines ignored) or `.parquet` file.

    A jsonl line that does not parse comes back as a `BadLine` (counted `bad_json` by
    `build_prompts`); a missing file is `FileNotFoundError`, an unreadable parquet file `ValueError`.
    """
    p = Path(path)
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


def _skip_reason(row: Any, prompt_key: str, answer_key: str) -> str | None:
    if isinstance(row, BadLine):
        return "bad_json"
    if not isinstance(row, dict):
        return "not_object"
    prompt, answer = row.get(prompt_key), row.get(answer_key)
    if prompt is None or answer is None:
        return "missing_field"
    if not isinstance(prompt, str) or not prompt.strip():
        return "invalid_field"
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        return "invalid_field"
    return None


def build_prompts(
    rows: list[Any],
    encode: Callable[[str], list[int]],
    *,
    prompt_key: str,
    answer_key: str,
    template: str,
    max_prompt_tokens: int,
) -> PromptSet:
    """The usable rows as `Prompt`s (index: position in `rows`), the others counted by reason."""
    out, skipped = [], dict.fromkeys(SKIP_REASONS, 0)
    for i, row in enumerate(rows):
        reason = _skip_reason(row, prompt_key, answer_key)
        if reason is None:
            text = template.format(prompt=row[prompt_key])
            ids = encode(text)
            if len(ids) > max_prompt_tokens:
                reason = "too_long"
            else:
                out.append(Prompt(index=i, text=text, prompt_ids=ids, answer=str(row[answer_key])))
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
