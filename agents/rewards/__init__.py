"""Reward functions: a registry of pure functions `fn(response_text, ground_truth, **kwargs) -> float | (float, info)`.

Built in: `digits` (the digit tasks of the demo; also registered as `reverse_digits`), `gsm8k`
(strict `#### <number>`), `math` (last `\\boxed{}`, LaTeX-normalised: `\\frac{1}{2}` == `0.5`),
`math_answer` (`####` else `\\boxed{}`: prompt files without a `data_source`), `code_tests`
(unit tests run in the sandbox; async) and `reward_model` (POST to a reward-model server).
Custom functions (sync or async) are chosen by registry name or by import path
(`package.module:function`) from config, with keyword settings bound by `functools.partial`:
`get_reward("reward_model", url="http://rm:8000/score")`. A keyword the function does not take
is a `RewardArgumentError` (a `TypeError`) naming the reward, raised here, not swallowed.
`REWARDS` is an `asyncrl.registry.Registry` (the import-path lookup and the unknown-name error naming
`agent.reward` live there).

`DATA_SOURCES` maps a row's `data_source` (verl's column) to a reward name:
`reward_for_source("openai/gsm8k") == "gsm8k"`; `register_data_source` adds one.
Running a reward with a timeout and counting failures is the caller's job (`agents.scoring.score`):
a reward that raises or hangs must never crash a run.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

from agents.rewards.code import code_tests
from agents.rewards.gsm8k import gsm8k
from agents.rewards.math import math_answer, math_boxed
from agents.rewards.reverse import reverse_digits
from agents.rewards.reward_model import reward_model
from asyncrl.registry import Registry

RewardFn = Callable[..., "float | tuple[float, dict]"]

REWARDS: Registry[RewardFn] = Registry("reward", "agent.reward")
REWARDS.add("digits", reverse_digits)
REWARDS.add("reverse_digits", reverse_digits)
REWARDS.add("gsm8k", gsm8k)
REWARDS.add("math", math_boxed)
REWARDS.add("math_answer", math_answer)
REWARDS.add("code_tests", code_tests)
REWARDS.add("reward_model", reward_model)

DATA_SOURCES: dict[str, str] = {
    "openai/gsm8k": "gsm8k",
    "gsm8k": "gsm8k",
    "lighteval/MATH": "math",
    "DigitalLearningGmbH/MATH-lighteval": "math",
    "HuggingFaceH4/MATH-500": "math",
    "math": "math",
    "math_dapo": "math",
    "numina_aops_forum": "math",
    "numina_synthetic_math": "math",
    "numina_amc_aime": "math",
    "numina_olympiads": "math",
    "numina_cn_k12": "math",
}
"""`data_source` -> reward name (verl's `data_source` values of its math and GSM8K sets)."""


class RewardArgumentError(TypeError, ValueError):
    """A keyword argument the reward function does not take (a `ValueError` too, so config checks catch it)."""


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator: `@register_reward("my_reward")` makes `my_reward` selectable by name (a name is taken once)."""
    return REWARDS.register(name)


def register_data_source(data_source: str, reward: str) -> None:
    """Rows whose `data_source` is `data_source` are scored by the registered reward `reward`."""
    REWARDS.get(reward)
    DATA_SOURCES[data_source] = reward


def reward_for_source(data_source: str) -> str | None:
    """The reward name for a `data_source` value, or None if none is registered."""
    return DATA_SOURCES.get(data_source)


def get_reward(name: str, **kwargs: Any) -> RewardFn:
    """A registered name, or an import path `module:function`; `kwargs` are bound to it (checked against its signature)."""
    fn = REWARDS.get(name)
    if not kwargs:
        return fn
    try:
        inspect.signature(fn).bind_partial("response", "ground_truth", **kwargs)
    except TypeError as e:
        raise RewardArgumentError(f"reward {name!r}: {e}") from None
    except ValueError:  # no signature to inspect (a builtin): the call will tell
        pass
    return functools.partial(fn, **kwargs)
