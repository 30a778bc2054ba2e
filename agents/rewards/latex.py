"""Final answers as a grader compares them: LaTeX / plain-text normalisation and equivalence.

`equivalent(pred, ref)` is True when two final answers (already extracted: the content of a
`\\boxed{}`, the text after `####`) say the same thing:

    equivalent("\\dfrac{1}{2}", "0.5")                      -> True   (values: fractions, a/b, decimals)
    equivalent("1,000", "1000.0")                           -> True   (thousands separators, trailing .0)
    equivalent("\\left( 1, \\frac{1}{2} \\right)", "(1,0.5)") -> True   (tuples / intervals element by element)
    equivalent("90^\\circ", "90"), equivalent("\\$5", "5")    -> True
    equivalent("5\\text{ cm}", "5"), equivalent("x = 3", "3") -> True   (a unit after a number, a short "x =")
    equivalent("12", "13"), equivalent("", "")              -> False

It knows nothing of where the answer came from (no extraction here) and never evaluates
expressions: `2+3` is not `5`. Pure functions, no state.
"""

from __future__ import annotations

import re
from fractions import Fraction

_UNWRAP = re.compile(r"\\(?:text|textbf|textrm|mathrm|mbox|mathbf)\{([^{}]*)\}")
_UNIT = re.compile(r"^(.*\d)\s*\\(?:text|mbox|mathrm)\{\s*[a-zA-Z][a-zA-Z ]*\}$")
_DROP = ("\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "\\displaystyle", "^{\\circ}", "^\\circ", "\\circ", "\\%", "%", "\\$", "$")
_NUM = re.compile(r"-?(?:\d+(?:\.\d+)?|\.\d+)")
_THOUSANDS = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_FRAC = re.compile(r"(-?)\\frac\{(-?[\d.]+)\}\{(-?[\d.]+)\}")
_SLASH = re.compile(r"(-?[\d.]+)/(-?[\d.]+)")
_BRACKETS = ("()", "[]", "(]", "[)")


def normalize(s: str) -> str:
    """The canonical text of a final answer (spaces, `$`, `\\left`, `\\text{}`, `^\\circ`, `\\dfrac`, `.0`, ...)."""
    s = s.strip().replace("\n", " ").rstrip(".").strip()
    m = _UNIT.match(s)
    if m:  # "5\text{ cm}": the unit goes
        s = m.group(1)
    for token in _DROP:
        s = s.replace(token, "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    while True:
        unwrapped = _UNWRAP.sub(r"\1", s)
        if unwrapped == s:
            break
        s = unwrapped
    s = "".join(s.split())
    s = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", s)  # \frac12
    s = re.sub(r"(\d)\.0+(?![\d])", r"\1", s)  # 7.0 -> 7
    s = re.sub(r"(?<![\d])\.(\d)", r"0.\1", s)  # .5 -> 0.5
    if re.fullmatch(r"[a-zA-Z]\w{0,2}=[^=]+", s):  # "x=3" -> "3"
        s = s.split("=", 1)[1]
    return s.rstrip(".")


def to_number(s: str) -> Fraction | None:
    """The exact value of a normalised answer that is a number, a `\\frac{a}{b}` or an `a/b`; else None."""
    try:
        if _NUM.fullmatch(s):
            return Fraction(s)
        if _THOUSANDS.fullmatch(s):
            return Fraction(s.replace(",", ""))
        m = _FRAC.fullmatch(s)
        if m:
            v = Fraction(m.group(2)) / Fraction(m.group(3))
            return -v if m.group(1) else v
        m = _SLASH.fullmatch(s)
        if m:
            return Fraction(m.group(1)) / Fraction(m.group(2))
    except (ValueError, ZeroDivisionError):
        return None
    return None


def _elements(s: str) -> list[str] | None:
    """The top-level comma-separated elements of a bracketed answer `(a, b)` / `[a, b)`; else None."""
    if len(s) < 2 or s[0] + s[-1] not in _BRACKETS:
        return None
    out, depth, cur = [], 0, ""
    for c in s[1:-1]:
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        if c == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += c
    out.append(cur)
    return out if len(out) > 1 else None


def _same(a: str, b: str) -> bool:
    if not a or not b:
        return False
    if a == b:
        return True
    na, nb = to_number(a), to_number(b)
    if na is not None and nb is not None:
        return na == nb
    ea, eb = _elements(a), _elements(b)
    if ea is not None and eb is not None and a[0] + a[-1] == b[0] + b[-1] and len(ea) == len(eb):
        return all(_same(x, y) for x, y in zip(ea, eb))
    return False


def equivalent(pred: str, ref: str) -> bool:
    """Whether two extracted final answers are the same answer (see the module docstring)."""
    return _same(normalize(pred), normalize(ref))
