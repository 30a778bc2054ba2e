"""Tasks: where train / held-out prompts come from and which reward scores them.

`increment` (the embedded default): add 1 to every digit of a string of `data.num_digits`
digits, mod 10, e.g. prompt `1239=` -> answer `2340`. Chosen because a 0.5M-parameter
model learns it from random initialisation by RL alone on a 2-core CPU in minutes, its
reward is exactly verifiable, partial credit per digit gives signal from step 0, and
responses are short (so rollouts and training steps are cheap). Every output digit
depends on the input digit a fixed distance back (`data.num_digits` + 1 tokens), which a
model with rotary (relative) positions represents with one attention pattern.

`reverse`: reverse the digit string (`1234=` -> `4321`). Each output position needs a
different distance back (1, 3, 5, 7 tokens); under RL alone the tiny model reuses the
distance learned for one position at the next (measured: in stalled runs the third output
digit is right for 6-9% of held-out prompts; in a stand-alone GRPO loop of the same model
it copied the input's last digit for 98% of them, with entropy collapsed there) and the
held-out reward stalls at 0.78-0.82. Kept as a harder task.

`jsonl`: rows of a jsonl/parquet file (`data.prompt_key`, `data.answer_key`), scored by
the GSM8K-style `math_answer` reward. Unusable rows are skipped and counted by reason
(`PromptSet.skipped`, logged once per file); a missing file, an unreadable one, or one
with no usable row is a `ConfigError` naming the key (`data.train_path`, `data.eval_path`).
Without `data.eval_path` the first `data.eval_size` usable prompts of the training file are
held out; the file's skip counts are then on the training set only (counted once).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from asyncrl.config import ConfigError, DataConfig
from asyncrl.data.datasets import DIGIT_TASKS, PromptSet, build_prompts, digit_rows, read_rows

log = logging.getLogger(__name__)


@dataclass
class Task:
    train: PromptSet
    eval: PromptSet
    reward: str
    """Name in the reward registry (agents.rewards)."""


def check_data_paths(cfg: DataConfig) -> None:
    """Fail before anything is built (run directory, model) when a configured data file is missing."""
    if cfg.task in DIGIT_TASKS:
        return
    for key, path in (("data.train_path", cfg.train_path), ("data.eval_path", cfg.eval_path)):
        if path and not Path(path).expanduser().is_file():
            raise ConfigError(f"{key}: file {path!r} not found")


def build_task(cfg: DataConfig, encode: Callable[[str], list[int]]) -> Task:
    kw: dict[str, Any] = dict(prompt_key="question", answer_key="answer", template="{prompt}",
                              max_prompt_tokens=cfg.max_prompt_tokens)
    if cfg.task in DIGIT_TASKS:
        rows = digit_rows(10**cfg.num_digits, cfg.num_digits, cfg.seed, cfg.task)
        # held-out prompts are never trained on
        task = Task(
            train=build_prompts(rows[cfg.eval_size :], encode, **kw),
            eval=build_prompts(rows[: cfg.eval_size], encode, **kw),
            reward="digits",
        )
        if not task.train.prompts:
            raise ConfigError(f"data.eval_size: holding out {cfg.eval_size} of the {len(rows)} prompts of task {cfg.task!r} "
                              f"with data.num_digits={cfg.num_digits} leaves none to train on ({_counts(task.train.skipped)})")
        return task
    kw.update(prompt_key=cfg.prompt_key, answer_key=cfg.answer_key, template=cfg.prompt_template)
    train = load_prompts(cfg.train_path, "data.train_path", encode, **kw)
    if cfg.eval_path:
        held = load_prompts(cfg.eval_path, "data.eval_path", encode, **kw)
        return Task(train, PromptSet(held.prompts[: cfg.eval_size], held.skipped), reward="math_answer")
    if len(train) <= cfg.eval_size:
        raise ConfigError(f"data.eval_size={cfg.eval_size} leaves no training rows in {cfg.train_path!r} "
                          f"({len(train)} usable rows)")
    return Task(PromptSet(train.prompts[cfg.eval_size :], train.skipped), PromptSet(train.prompts[: cfg.eval_size]),
                reward="math_answer")


def load_prompts(path: str, key: str, encode: Callable[[str], list[int]], **kw: Any) -> PromptSet:
    """The usable prompts of the file at config key `key`; skips logged once; none usable is a `ConfigError`."""
    try:
        rows = read_rows(Path(path).expanduser())
    except FileNotFoundError:
        raise ConfigError(f"{key}: file {path!r} not found") from None
    except (ValueError, OSError) as e:
        raise ConfigError(f"{key}: {e}") from None
    ps = build_prompts(rows, encode, **kw)
    if ps.skipped:
        log.warning("%s: skipped %d of %d rows of %s (%s)", key, sum(ps.skipped.values()), len(rows), path, _counts(ps.skipped))
    if not ps.prompts:
        hint = "; see data.max_prompt_tokens" if "too_long" in ps.skipped else ""
        raise ConfigError(f"{key}: no usable row in {path!r} ({_counts(ps.skipped) or 'the file is empty'}){hint}")
    return ps


def _counts(skipped: dict[str, int]) -> str:
    return ", ".join(f"{k}={v}" for k, v in skipped.items())
