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
the GSM8K-style `math_answer` reward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from asyncrl.config import DataConfig
from asyncrl.data.datasets import DIGIT_TASKS, PromptSet, build_prompts, digit_rows, read_rows


@dataclass
class Task:
    train: PromptSet
    eval: PromptSet
    reward: str
    """Name in the reward registry (agents.rewards)."""


def build_task(cfg: DataConfig, encode: Callable[[str], list[int]]) -> Task:
    kw = dict(prompt_key="question", answer_key="answer", template="{prompt}", max_prompt_tokens=cfg.max_prompt_tokens)
    if cfg.task in DIGIT_TASKS:
        rows = digit_rows(10**cfg.num_digits, cfg.num_digits, cfg.seed, cfg.task)
        # held-out prompts are never trained on
        return Task(
            train=build_prompts(rows[cfg.eval_size :], encode, **kw),
            eval=build_prompts(rows[: cfg.eval_size], encode, **kw),
            reward="digits",
        )
    kw.update(prompt_key=cfg.prompt_key, answer_key=cfg.answer_key, template=cfg.prompt_template)
    rows = read_rows(cfg.train_path)
    if cfg.eval_path:
        train_rows, eval_rows = rows, read_rows(cfg.eval_path)[: cfg.eval_size]
    else:
        if len(rows) <= cfg.eval_size:
            raise ValueError(f"data.eval_size={cfg.eval_size} leaves no training rows in {cfg.train_path} ({len(rows)} rows)")
        train_rows, eval_rows = rows[cfg.eval_size :], rows[: cfg.eval_size]
    return Task(build_prompts(train_rows, encode, **kw), build_prompts(eval_rows, encode, **kw), reward="math_answer")
