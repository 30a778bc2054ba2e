"""GSM8K reward, strict: the response must end its reasoning with `#### <number>`.

Only the number after the last `####` counts (`#### 1,000`, `#### $72`, `#### -3.5`); a
`\\boxed{}` or a bare number elsewhere in the text scores 0, as in verl's strict GSM8K score.
The reference is the text after the last `####` of the ground truth (GSM8K's solutions) or
the whole string (verl's `reward_model.ground_truth`, already the number). Values compare
exactly (`72.0` == `72`, `1,000` == `1000`). Reward 1.0 or 0.0; info `{"extracted": bool}`.
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


def gsm8k(response: str, ground_truth: str) -> tuple[float, dict]:
    pred = extract_gsm8k(response)
    ok = pred is not None and equivalent(pred, reference_answer(str(ground_truth)))
    return float(ok), {"extracted": pred is not None}
