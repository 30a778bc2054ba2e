"""Reward of the demo task: reverse a string of digits.

Partial credit per position so that a tiny randomly initialised model gets a signal
from the first step: `reward = matching positions / len(target)`, minus 0.25 when the
answer's length is wrong (clipped at 0). A random policy scores about 0.0-0.1; the
exact answer scores 1.0.
"""

from __future__ import annotations


def reverse_digits(response: str, ground_truth: str, **_: object) -> tuple[float, dict]:
    answer = response.strip()
    target = ground_truth.strip()
    if not target:
        raise ValueError("reverse_digits: empty ground truth")
    hits = sum(a == b for a, b in zip(answer, target))
    score = hits / len(target) - (0.25 if len(answer) != len(target) else 0.0)
    return max(score, 0.0), {"exact": float(answer == target), "length_ok": float(len(answer) == len(target))}
