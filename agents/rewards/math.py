"""Math rewards: extract the final answer of a response and compare it with the reference.

`math_boxed` (registered as `math`; MATH-style data): the content of the last `\\boxed{...}` (or `\\fbox{...}`, `\\boxed 5`),
compared by `agents.rewards.latex.equivalent` (`\\frac{1}{2}` == `0.5`, `\\left( \\right)`,
`\\text{}`, `^\\circ`, `$`, spaces, trailing `.0`). A reference that holds a `\\boxed{}` (a
full solution) is reduced to it first.

`math_answer` (the default of prompt files without a `data_source`): the text after the last
`####` (GSM8K's marker), else the last `\\boxed{...}`, compared the same way; the reference is
the text after its last `####`, or the whole string.

Neither falls back to "the last number in the text": a response that gives no marked final
answer scores 0 (`"42 43 44 ... 99"` against `99` is 0). Rewards take no keyword arguments:
an unknown one is a `TypeError` naming the function. Reward 1.0 or 0.0; info `{"extracted": bool}`.
The strict GSM8K reward is `agents.rewards.gsm8k`.
"""

from __future__ import annotations

import re

from agents.rewards.latex import equivalent

_AFTER_MARKER = re.compile(r"-?[\d,]*\.?\d+")


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` / `\\fbox{...}` (braces balanced) or `\\boxed X`; None if none."""
    i = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if i < 0:
        return None
    j = i + (len("\\boxed") if text.startswith("\\boxed", i) else len("\\fbox"))
    if text[j : j + 1] == " ":  # "\boxed 5": up to the next space or "$"
        m = re.match(r" +([^\s$]+)", text[j:])
        return m.group(1) if m else None
    if text[j : j + 1] != "{":
        return None
    depth = 0
    for k in range(j + 1, len(text)):
        if text[k] == "{":
            depth += 1
        elif text[k] == "}":
            if depth == 0:
                return text[j + 1 : k]
            depth -= 1
    return None


def extract_answer(text: str) -> str | None:
    """The final answer of a response for `math_answer`: after the last `####`, else the last `\\boxed{}`; else None."""
    if "####" in text:
        tail = text.rsplit("####", 1)[1].strip()
        m = _AFTER_MARKER.search(tail)
        return m.group(0) if m else (tail.splitlines()[0] if tail else None)
    return last_boxed(text)


def reference_answer(ground_truth: str) -> str:
    """GSM8K's reference: the text after the last `####`, or the whole string."""
    return ground_truth.rsplit("####", 1)[1].strip() if "####" in ground_truth else ground_truth.strip()


def math_answer(response: str, ground_truth: str) -> tuple[float, dict]:
    pred = extract_answer(response)
    ok = pred is not None and equivalent(pred, reference_answer(str(ground_truth)))
    return float(ok), {"extracted": pred is not None}


def math_boxed(response: str, ground_truth: str) -> tuple[float, dict]:
    pred = last_boxed(response)
    ref = str(ground_truth)
    ref = last_boxed(ref) or ref
    ok = pred is not None and equivalent(pred, ref)
    return float(ok), {"extracted": pred is not None}
