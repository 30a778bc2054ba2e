"""A user's own advantage estimators, as a user's package would hold them (imported by `test_registry.py`).

`sign_of_centred` is registered by decorator when this module is imported; `doubled_centred` is not
registered at all: config names it by import path (`tests.unit.core.user_advantage:doubled_centred`).
"""

from __future__ import annotations

from torch import Tensor

from asyncrl.trainer.advantages import grpo, register_advantage


@register_advantage("test_sign_of_centred")
def sign_of_centred(rewards: Tensor, group_index: Tensor, *, norm_by_std: bool = True, eps: float = 1e-6) -> Tensor:
    """+1 above the group mean, -1 below, 0 at it."""
    return grpo(rewards, group_index, norm_by_std=False).sign()


def doubled_centred(rewards: Tensor, group_index: Tensor, *, norm_by_std: bool = True, eps: float = 1e-6) -> Tensor:
    """Twice the reward minus its group mean."""
    return 2 * grpo(rewards, group_index, norm_by_std=False)


NOT_CALLABLE = 3
