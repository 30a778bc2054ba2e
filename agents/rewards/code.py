"""Code reward: run the reference unit tests against the code in a response, in the sandbox.

The ground truth holds the tests: a JSON list of Python snippets (each usually one or more
`assert` lines), a JSON object `{"tests": [...], "setup": "..."}`, or plain text (one
test). The code is the last fenced block of the response (```python ... ``` or ``` ... ```),
else the whole response. All tests run in one sandboxed process (`run_python`): the
solution once, then each test in its own copy of the solution's namespace; each result is
reported on stdout with a per-run random nonce that the code never sees in its source
(the solution's own prints are discarded, so they cannot crowd out the results).

`mode="fraction"`: reward = passed / total; `mode="all"`: 1.0 only when every test passes.
A crash, timeout or limit in the solution fails the tests that had not reported yet.
Not hardened against a policy that attacks the harness on purpose (frame inspection,
objects whose `__eq__` is always true); it is a test runner, not a judge.
"""

from __future__ import annotations

import json
import re
import secrets
from typing import Any, Literal

from agents.tools.python_sandbox import SandboxLimits, run_python

_FENCE = re.compile(r"```[ \t]*(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)

_HARNESS = '''
import os
import sys


def _main(code, setup, tests):
    nonce = sys.stdin.readline().strip()
    out = os.fdopen(os.dup(1), "w")  # results go here; the solution's prints go to /dev/null
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
    sys.stdout = open(os.devnull, "w")
    ns = {"__name__": "__solution__"}
    exec(compile(setup + "\\n" + code, "solution.py", "exec"), ns)
    for i, test in enumerate(tests):
        try:
            exec(compile(test, f"test_{i}.py", "exec"), dict(ns))
            ok = 1
        except BaseException as e:
            ok = 0
            print(f"test {i}: {type(e).__name__}: {e}"[:300], file=sys.stderr)
        out.write(f"{nonce} {i} {ok}\\n")
        out.flush()


_main(CODE, SETUP, TESTS)
'''


def extract_code(response: str) -> str:
    blocks = _FENCE.findall(response)
    return blocks[-1] if blocks else response


def parse_tests(ground_truth: str) -> tuple[str, list[str]]:
    """(setup, tests) from the ground-truth text."""
    try:
        obj = json.loads(ground_truth)
    except ValueError:
        return "", [ground_truth]
    if isinstance(obj, list) and all(isinstance(t, str) for t in obj):
        return "", obj
    if isinstance(obj, dict) and isinstance(obj.get("tests"), list):
        return str(obj.get("setup", "")), [str(t) for t in obj["tests"]]
    raise ValueError("code reward: ground truth must be a JSON list of tests, {'tests': [...]}, or test text")


async def code_tests(
    response: str, ground_truth: str, *, mode: Literal["fraction", "all"] = "fraction", **limits: Any
) -> tuple[float, dict[str, Any]]:
    """Reward of one response; `limits` are `SandboxLimits` fields (e.g. `wall_s=5`)."""
    if mode not in ("fraction", "all"):
        raise ValueError(f"code reward: mode must be 'fraction' or 'all', got {mode!r}")
    setup, tests = parse_tests(ground_truth)
    if not tests:
        raise ValueError("code reward: no tests in the ground truth")
    program = (_HARNESS.replace("CODE, SETUP, TESTS", f"{extract_code(response)!r}, {setup!r}, {tests!r}"))
    nonce = secrets.token_hex(16)
    result = await run_python(program, SandboxLimits(**limits), stdin=nonce + "\n")
    passed = set()
    for line in result.stdout.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[0] == nonce and parts[2] == "1":
            passed.add(int(parts[1]))
    n = len(tests)
    reward = len(passed) / n if mode == "fraction" else float(len(passed) == n)
    info = {"passed": len(passed), "total": n, "timed_out": result.timed_out}
    if failure := result.describe_failure():
        info["error"] = failure
    return reward, info
