"""GSM8K reward, strict: the response must end its reasoning with `#### <number>`.

Only the number after the last `####` counts (`#### 1,000`, `#### $72`, `#### -3.5`); a
`\\boxed{}` or a bare number elsewhere in the text scores 0, as in verl's strict GSM8K score.
The reference is the text after the last `####` of the ground truth (GSM8K's solutions) or
the whole string (verl's `reward_model.ground_truth`, already the number). Values compare
exactly (`72.0` == `72`, `1,000` == `1000`). Reward `score` (1.0) when right, `format_score` (0.0) when a
`####` number is there but wrong, 0.0 without one: verl's `gsm8k.compute_score` settings, bound by
`agent.reward_kwargs`. Info `{"extracted": bool, "exact": bool}`: `exact` is the accuracy whatever the
two scores are (held-out evaluations log it as `eval/exact`).
"""

from __future__ import annotations

import re

from agents.rewards.latex import equivalent
from agents.rewards.math import reference_answer

_STRICT = re.compile(r"####\s*\$?\s*(-?[\d,]*\.?\d+)")


def extract_gsm8k(text: str) -> str | None:
    """The number after the last `#### ` marker, or None."""
    found = _STRICT.findall(text)
    return found[-1] if found else None


def gsm8k(response: str, ground_truth: str, format_score: float = 0.0, score: float = 1.0) -> tuple[float, dict]:
    pred = extract_gsm8k(response)
    ok = pred is not None and equivalent(pred, reference_answer(str(ground_truth)))
    return (score if ok else format_score if pred is not None else 0.0), {"extracted": pred is not None, "exact": ok}
