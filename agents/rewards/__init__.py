"""Reward functions: a registry of pure functions `fn(response_text, ground_truth, **kwargs) -> float | (float, info)`.

Built in: `reverse_digits` (the demo task) and `math_answer` (GSM8K `####` / `\\boxed{}` final
answer match). Custom functions are chosen by registry name or by import path
(`package.module:function`) from config. Running a reward with a timeout and counting
failures is the caller's job (a reward that raises or hangs must never crash a run).
"""

from __future__ import annotations

import importlib
from typing import Callable

from agents.rewards.math import math_answer
from agents.rewards.reverse import reverse_digits

RewardFn = Callable[..., "float | tuple[float, dict]"]

REWARDS: dict[str, RewardFn] = {
    "reverse_digits": reverse_digits,
    "math_answer": math_answer,
}


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator: `@register_reward("my_reward")` makes `my_reward` selectable by name."""

    def deco(fn: RewardFn) -> RewardFn:
        REWARDS[name] = fn
        return fn

    return deco


def get_reward(name: str) -> RewardFn:
    """A registered name, or an import path `module:function`."""
    if name in REWARDS:
        return REWARDS[name]
    if ":" in name:
        mod, _, attr = name.partition(":")
        fn = getattr(importlib.import_module(mod), attr, None)
        if not callable(fn):
            raise ValueError(f"reward {name!r}: {attr!r} is not a callable in module {mod!r}")
        return fn
    raise ValueError(f"unknown reward {name!r}; registered: {sorted(REWARDS)} (or give module:function)")
