"""GSM8K-style math reward: extract the final answer and compare it with the reference.

The reference is the text after the last `####` (GSM8K's format) or the whole string.
From the response, in order of preference: the text after the last `####`, the content
of the last `\\boxed{...}`, else the last number in the text. Numbers are compared as
values (`1,000` == `1000.0`); anything else (`inf` and `nan` included) as normalised text.
Reward 1.0 or 0.0.
"""

from __future__ import annotations

import math
import re

_NUM = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def _normalize(s: str) -> str:
    s = s.strip().strip(".").replace("$", "").replace(",", "").strip()
    try:
        v = float(s)
    except ValueError:
        v = math.nan
    if not math.isfinite(v):  # text, or "inf"/"nan" that float() reads but int() cannot take
        return " ".join(s.lower().split())
    return str(int(v)) if v == int(v) else repr(v)


def _last_boxed(text: str) -> str | None:
    i = text.rfind("\\boxed{")
    if i < 0:
        return None
    depth, j = 0, i + len("\\boxed{")
    for k in range(j, len(text)):
        if text[k] == "{":
            depth += 1
        elif text[k] == "}":
            if depth == 0:
                return text[j:k]
            depth -= 1
    return None


def extract_answer(text: str) -> str | None:
    """The final answer of a response, or None if it gives none."""
    if "####" in text:
        tail = text.rsplit("####", 1)[1].strip()
        m = _NUM.search(tail)
        return m.group(0) if m else (tail.splitlines()[0] if tail else None)
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed
    nums = _NUM.findall(text)
    return nums[-1] if nums else None


def reference_answer(ground_truth: str) -> str:
    return ground_truth.rsplit("####", 1)[1].strip() if "####" in ground_truth else ground_truth.strip()


def math_answer(response: str, ground_truth: str, **_: object) -> tuple[float, dict]:
    pred = extract_answer(response)
    ok = pred is not None and _normalize(pred) == _normalize(reference_answer(ground_truth))
    return float(ok), {"extracted": pred is not None}
