"""The `calculator` tool: arithmetic on numbers, evaluated by walking the `ast`, never `eval`.

Allowed: numbers, + - * / // % **, unary +/-, parentheses, and a few math functions and
constants (`sqrt`, `log`, `sin`, `pi`, ...). Anything else (names, attributes, calls to
other functions, strings) is refused with a message. Exponents and results are bounded so
that `9**9**9` is refused instead of freezing the event loop.
"""

from __future__ import annotations

import ast
import math
import operator
from typing import Any, Callable

from agents.tools.base import Tool, register_tool

_BINOPS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}
_UNOPS: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_FUNCS: dict[str, Callable[..., Any]] = {
    name: getattr(math, name)
    for name in ("sqrt", "log", "log2", "log10", "exp", "sin", "cos", "tan", "asin", "acos", "atan",
                 "floor", "ceil", "factorial", "gcd")
} | {"abs": abs, "round": round, "min": min, "max": max}
_CONSTS = {"pi": math.pi, "e": math.e}
MAX_EXPONENT = 1000
MAX_DIGITS = 1000


def _eval(node: ast.AST) -> Any:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.Name) and node.id in _CONSTS:
        return _CONSTS[node.id]
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNOPS:
        return _UNOPS[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"exponent {right} is too large (limit {MAX_EXPONENT})")
        out = _BINOPS[type(node.op)](left, right)
        if isinstance(out, int) and out.bit_length() > MAX_DIGITS * 3.33:
            raise ValueError(f"result has more than {MAX_DIGITS} digits")
        return out
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCS and not node.keywords:
        args = [_eval(a) for a in node.args]
        if node.func.id == "factorial" and args and args[0] > MAX_EXPONENT:
            raise ValueError(f"factorial argument too large (limit {MAX_EXPONENT})")
        return _FUNCS[node.func.id](*args)
    raise ValueError(f"unsupported expression: {ast.unparse(node)!r}")


def evaluate(expression: str) -> int | float:
    """Value of an arithmetic expression; ValueError / ZeroDivisionError / SyntaxError for bad input."""
    if len(expression) > 1000:
        raise ValueError("expression longer than 1000 characters")
    return _eval(ast.parse(expression.strip(), mode="eval"))


@register_tool("calculator")
class Calculator(Tool):
    name = "calculator"
    description = "Evaluate an arithmetic expression, e.g. '(3 + 4) * sqrt(2)'."
    parameters = {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}

    async def __call__(self, expression: str) -> str:
        try:
            value = evaluate(str(expression))
        except (ValueError, ZeroDivisionError, SyntaxError, OverflowError, TypeError) as e:
            return f"Error: {type(e).__name__}: {e}"
        return repr(value) if isinstance(value, float) else str(value)
