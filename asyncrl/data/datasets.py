"""Prompt files: jsonl or parquet rows -> `Prompt` records, and the demo task's generator.

A `Prompt` carries the text, its token ids, the reference answer and its index in the
data set (the data-loader position saved with checkpoints). Rows without the prompt or
answer column, or whose prompt is longer than `max_prompt_tokens`, are skipped and
counted in `PromptSet.skipped` (never silently).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator


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
    """Rows skipped when loading, by cause."""

    def __len__(self) -> int:
        return len(self.prompts)


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a `.jsonl` (one JSON object per line) or `.parquet` file."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"prompt file {str(p)!r} not found")
    if p.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(p).to_pylist()
    rows = []
    with p.open() as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{p}:{n}: not a JSON object ({e.msg})") from None
                if not isinstance(row, dict):
                    raise ValueError(f"{p}:{n}: expected a JSON object, got {type(row).__name__}")
                rows.append(row)
    return rows


def build_prompts(
    rows: list[dict[str, Any]],
    encode: Callable[[str], list[int]],
    *,
    prompt_key: str,
    answer_key: str,
    template: str,
    max_prompt_tokens: int,
) -> PromptSet:
    out, skipped = [], {"missing_field": 0, "too_long": 0}
    for i, row in enumerate(rows):
        if not isinstance(row.get(prompt_key), str) or row.get(answer_key) is None:
            skipped["missing_field"] += 1
            continue
        text = template.format(prompt=row[prompt_key])
        ids = encode(text)
        if len(ids) > max_prompt_tokens:
            skipped["too_long"] += 1
            continue
        out.append(Prompt(index=i, text=text, prompt_ids=ids, answer=str(row[answer_key])))
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
