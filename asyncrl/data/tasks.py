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

`arith`: arithmetic word problems in GSM8K's flat layout generated from `data.seed`
(`asyncrl.data.arith`): `data.eval_size` of them held out, the rest (895 in all) trained on, none in both;
rendered like `jsonl`'s string prompts (`data.prompt_template`, then the chat template), scored by
GSM8K's strict `####` reward. The task of `configs/smollm2_arith.yaml` (a real pretrained model).

`jsonl`: rows of a jsonl / parquet file or a `datasets` save_to_disk folder, flat
(`question`, `answer`) or in verl's layout (`prompt` as chat messages, `data_source`,
`reward_model.ground_truth`); empty `data.prompt_key` / `data.answer_key` find either. Prompts
are rendered by the chat template (`data.chat_template`, see `chat_renderer`). The reward
follows the rows' `data_source` (`agents.rewards.DATA_SOURCES`: GSM8K strict `####`, MATH
`\\boxed{}`), `math_answer` for rows without one; `agent.reward` overrides it (the caller
passes it as `reward`). Unusable rows are skipped and counted by reason (`PromptSet.skipped`,
logged once per file); a missing file, an unreadable one, a column no row has, or a file with
no usable row is a `ConfigError` naming the key (`data.train_path`, `data.eval_path`,
`data.prompt_key`, `data.chat_template`). Without `data.eval_path` the first `data.eval_size`
usable prompts of the training file are held out; the file's skip counts are then on the
training set only (counted once).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from asyncrl.config import ConfigError, DataConfig
from asyncrl.data.datasets import (
    DIGIT_TASKS,
    MissingColumn,
    NoChatTemplate,
    Prompt,
    PromptSet,
    Render,
    RenderError,
    build_prompts,
    digit_rows,
    read_rows,
    resolve_column,
)

log = logging.getLogger(__name__)

PROMPT_COLUMNS = ("prompt", "question")
"""Looked for in this order when `data.prompt_key` is empty (verl's layout, then GSM8K's)."""
ANSWER_COLUMNS = ("reward_model.ground_truth", "answer")
"""Looked for in this order when `data.answer_key` is empty."""
DEFAULT_REWARD = "math_answer"
"""The reward of prompt files whose rows have no `data_source`."""


@dataclass
class Task:
    train: PromptSet
    eval: PromptSet
    reward: str
    """Name in the reward registry (agents.rewards)."""


def check_data_paths(cfg: DataConfig) -> None:
    """Fail before anything is built (run directory, model) when a configured data path or template file is missing."""
    if cfg.chat_template not in ("auto", "none") and not Path(cfg.chat_template).expanduser().is_file():
        raise ConfigError(f"data.chat_template: file {cfg.chat_template!r} not found (or give `auto` or `none`)")
    if cfg.task in DIGIT_TASKS or cfg.task == "arith":
        return
    for key, path in (("data.train_path", cfg.train_path), ("data.eval_path", cfg.eval_path)):
        if path and not Path(path).expanduser().exists():
            raise ConfigError(f"{key}: file {path!r} not found")


def chat_renderer(setting: str, tokenizer: Any) -> Render | None:
    """The `Render` of `data.chat_template`: `none` -> None; `auto` -> the tokenizer's template if it has one,
    else None; a path -> that jinja file. Renders with `add_generation_prompt=True`; a template that cannot
    render one user message is a `ConfigError`."""
    if setting == "none":
        return None
    template = None
    if setting != "auto":
        path = Path(setting).expanduser()
        if not path.is_file():
            raise ConfigError(f"data.chat_template: file {setting!r} not found (or give `auto` or `none`)")
        if tokenizer is None:
            raise ConfigError("data.chat_template: a template file is rendered with the model's tokenizer, and none was given")
        template = path.read_text()
    elif tokenizer is None or not getattr(tokenizer, "chat_template", None):
        return None
    from jinja2 import TemplateError

    def render(messages: list[dict[str, str]]) -> str:
        try:
            return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, chat_template=template)
        except TemplateError as e:
            raise RenderError(str(e)) from None

    try:
        render([{"role": "user", "content": "1 + 1 = ?"}])
    except RenderError as e:
        raise ConfigError(f"data.chat_template: the chat template ({setting}) cannot render a user message: {e}") from None
    return render


def build_task(cfg: DataConfig, encode: Callable[[str], list[int]], tokenizer: Any = None, reward: str = "") -> Task:
    """The task of `cfg`; `tokenizer` supplies the chat template (`data.chat_template`), `reward` (`agent.reward`)
    overrides the task's own reward."""
    render = chat_renderer(cfg.chat_template, tokenizer)
    kw: dict[str, Any] = dict(prompt_key="question", answer_key="answer", template="{prompt}",
                              max_prompt_tokens=cfg.max_prompt_tokens, render=render)
    if cfg.task in DIGIT_TASKS:
        rows = digit_rows(10**cfg.num_digits, cfg.num_digits, cfg.seed, cfg.task)
        # held-out prompts are never trained on
        task = Task(
            train=build_prompts(rows[cfg.eval_size :], encode, **kw),
            eval=build_prompts(rows[: cfg.eval_size], encode, **kw),
            reward=reward or "digits",
        )
        if not task.train.prompts:
            raise ConfigError(f"data.eval_size: holding out {cfg.eval_size} of the {len(rows)} prompts of task {cfg.task!r} "
                              f"with data.num_digits={cfg.num_digits} leaves none to train on ({_counts(task.train.skipped)})")
        return task
    if cfg.task == "arith":
        from asyncrl.data.arith import arith_rows

        rows = arith_rows(None, cfg.seed)
        if len(rows) <= cfg.eval_size:
            raise ConfigError(f"data.eval_size={cfg.eval_size} leaves none of the {len(rows)} arith problems to train on")
        kw.update(template=cfg.prompt_template)
        held, train = build_prompts(rows[: cfg.eval_size], encode, **kw), build_prompts(rows[cfg.eval_size :], encode, **kw)
        if not train.prompts or not held.prompts:
            raise ConfigError(f"data.max_prompt_tokens={cfg.max_prompt_tokens}: no arith prompt fits ({_counts(train.skipped)})")
        return Task(train, held, reward=reward or "gsm8k")
    kw.update(template=cfg.prompt_template, chat_template=cfg.chat_template)
    train = load_prompts(cfg.train_path, "data.train_path", encode, cfg, **kw)
    if cfg.eval_path:
        held = load_prompts(cfg.eval_path, "data.eval_path", encode, cfg, **kw)
        held = PromptSet(held.prompts[: cfg.eval_size], held.skipped)
    else:
        if len(train) <= cfg.eval_size:
            raise ConfigError(f"data.eval_size={cfg.eval_size} leaves no training rows in {cfg.train_path!r} "
                              f"({len(train)} usable rows)")
        train, held = PromptSet(train.prompts[cfg.eval_size :], train.skipped), PromptSet(train.prompts[: cfg.eval_size])
    return Task(train, held, reward=reward or reward_by_source(train.prompts + held.prompts))


def load_prompts(path: str, key: str, encode: Callable[[str], list[int]], cfg: DataConfig, *, chat_template: str,
                 **kw: Any) -> PromptSet:
    """The usable prompts of the data at config key `key`; skips logged once; none usable is a `ConfigError`."""
    try:
        rows = read_rows(Path(path).expanduser())
    except FileNotFoundError:
        raise ConfigError(f"{key}: file {path!r} not found") from None
    except (ValueError, OSError) as e:
        raise ConfigError(f"{key}: {e}") from None
    try:
        kw["prompt_key"] = resolve_column(rows, "prompt", cfg.prompt_key, PROMPT_COLUMNS)
        kw["answer_key"] = resolve_column(rows, "answer", cfg.answer_key, ANSWER_COLUMNS)
    except MissingColumn as e:
        raise ConfigError(f"{key}: {path!r} has {e} (set data.{e.role}_key)") from None
    try:
        ps = build_prompts(rows, encode, **kw)
    except NoChatTemplate as e:
        why = ("data.chat_template=none" if chat_template == "none" else "the tokenizer has no chat template")
        raise ConfigError(f"data.chat_template: {key} {path!r}, {e}; {why}: set data.chat_template to a jinja "
                          f"template file (or `auto` with a tokenizer that has one)") from None
    if ps.skipped:
        log.warning("%s: skipped %d of %d rows of %s (%s)", key, sum(ps.skipped.values()), len(rows), path, _counts(ps.skipped))
    if not ps.prompts:
        hint = "; see data.max_prompt_tokens" if "too_long" in ps.skipped else ""
        hint += "; see data.chat_template" if "template_error" in ps.skipped else ""
        raise ConfigError(f"{key}: no usable row in {path!r} ({_counts(ps.skipped) or 'the file is empty'}){hint}")
    return ps


def reward_by_source(prompts: list[Prompt]) -> str:
    """The one reward of the prompts' `data_source`s (`agents.rewards.DATA_SOURCES`; none: `DEFAULT_REWARD`).
    A source with no reward, or sources with different rewards, are a `ConfigError` naming `agent.reward`."""
    from agents.rewards import DATA_SOURCES, reward_for_source

    by_source = {s: (reward_for_source(s) if s else DEFAULT_REWARD) for s in sorted({p.data_source for p in prompts})}
    unknown = [s for s, r in by_source.items() if r is None]
    if unknown:
        raise ConfigError(f"agent.reward: no reward is registered for data_source {unknown} (known: {sorted(DATA_SOURCES)}); "
                          f"set agent.reward to a reward name or module:function")
    rewards = set(by_source.values())
    if len(rewards) > 1:
        raise ConfigError(f"agent.reward: the rows' data sources score with different rewards ({by_source}) and a run "
                          f"scores with one: set agent.reward, or keep one kind of data per run")
    return rewards.pop() if rewards else DEFAULT_REWARD


def _counts(skipped: dict[str, int]) -> str:
    return ", ".join(f"{k}={v}" for k, v in skipped.items())
