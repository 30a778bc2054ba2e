"""Reward functions: a registry of pure functions `fn(response_text, ground_truth, **kwargs) -> float | (float, info)`.

Built in: `digits` (the digit tasks of the demo; also registered as `reverse_digits`), `math_answer` (GSM8K `####` / `\\boxed{}` final
answer match), `code_tests` (unit tests run in the sandbox; async) and `reward_model` (POST
to a reward-model server). Custom functions (sync or async) are chosen by registry name or
by import path (`package.module:function`) from config, with keyword settings bound by
`functools.partial`: `get_reward("reward_model", url="http://rm:8000/score")`. Running a
reward with a timeout and counting failures is the caller's job (`agents.base.score`): a
reward that raises or hangs must never crash a run.
"""

from __future__ import annotations

import functools
import importlib
from typing import Any, Callable

from agents.rewards.code import code_tests
from agents.rewards.math import math_answer
from agents.rewards.reverse import reverse_digits
from agents.rewards.reward_model import reward_model

RewardFn = Callable[..., "float | tuple[float, dict]"]

REWARDS: dict[str, RewardFn] = {
    "digits": reverse_digits,
    "reverse_digits": reverse_digits,
    "math_answer": math_answer,
    "code_tests": code_tests,
    "reward_model": reward_model,
}


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator: `@register_reward("my_reward")` makes `my_reward` selectable by name."""

    def deco(fn: RewardFn) -> RewardFn:
        REWARDS[name] = fn
        return fn

    return deco


def get_reward(name: str, **kwargs: Any) -> RewardFn:
    """A registered name, or an import path `module:function`; `kwargs` are bound to it."""
    fn = _lookup(name)
    return functools.partial(fn, **kwargs) if kwargs else fn


def _lookup(name: str) -> RewardFn:
    if name in REWARDS:
        return REWARDS[name]
    if ":" in name:
        mod, _, attr = name.partition(":")
        fn = getattr(importlib.import_module(mod), attr, None)
        if not callable(fn):
            raise ValueError(f"reward {name!r}: {attr!r} is not a callable in module {mod!r}")
        return fn
    raise ValueError(f"unknown reward {name!r}; registered: {sorted(REWARDS)} (or give module:function)")
