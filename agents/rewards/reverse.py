"""Reward of the digit tasks (`increment`, the demo, and `reverse`): registered as `digits`.

It compares the response with the target digit string position by position, so it scores
any digit task; for `increment`, `1239=` -> `2340` scores 1.0.

Shaped so that a tiny randomly initialised model (100-token vocabulary) gets a signal
from the first step, while only the exact answer scores 1.0:
    reward = 0.2 * (share of the first L characters that are digits)
           + 0.8 * (share of the L positions holding the right digit)
    times L / len(answer) when the answer is longer than L (L = len(target)).
A random policy scores about 0.01-0.03; `4321` for `1234=` (reverse) scores 1.0. The demo
generates at most L tokens (`rollout.max_tokens`), so no end-of-sequence token has to
be discovered by chance first.
"""

from __future__ import annotations


def reverse_digits(response: str, ground_truth: str) -> tuple[float, dict]:
    answer = response.strip()
    target = ground_truth.strip()
    if not target:
        raise ValueError("reverse_digits: empty ground truth")
    n = len(target)
    digits = sum(c.isdigit() for c in answer[:n]) / n
    hits = sum(a == b for a, b in zip(answer, target)) / n
    score = 0.2 * digits + 0.8 * hits
    if len(answer) > n:
        score *= n / len(answer)
    return score, {"exact": float(answer == target), "digit_acc": hits}
