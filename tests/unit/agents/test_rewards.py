"""Rewards: code tests in the sandbox, the reward-model HTTP hook, and `score` with async / failing functions."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Iterator

import pytest

from agents.scoring import score
from agents.rewards import get_reward
from agents.rewards.code import code_tests, extract_code

SOLUTION = "Here you go:\n```python\ndef add(a, b):\n    return a + b\n```\n"
TESTS = json.dumps(["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(2, 2) == 5"])


def test_code_reward_fraction_and_all():
    assert asyncio.run(code_tests(SOLUTION, TESTS)) == (pytest.approx(2 / 3), {"passed": 2, "total": 3, "timed_out": False})
    assert asyncio.run(code_tests(SOLUTION, TESTS, mode="all"))[0] == 0.0
    assert asyncio.run(code_tests(SOLUTION, json.dumps({"setup": "import math", "tests": ["assert add(1, 1) == 2"]}),
                                  mode="all"))[0] == 1.0
    assert extract_code("```py\nfirst\n```\ntext\n```\nsecond\n```") == "second\n"
    chatty = "```python\nprint('x' * 100000)\ndef add(a, b):\n    print('y' * 100000)\n    return a + b\n```"
    assert asyncio.run(code_tests(chatty, TESTS))[1]["passed"] == 2  # prints cannot crowd out the results


@pytest.mark.parametrize(
    "code, error",
    [("import os; os._exit(0)\ndef add(a, b): return a + b", None),  # exits before the tests: nothing passes
     ("def add(a, b):\n    while True: pass", "timed out"),
     ("raise SystemExit(0)", None),
     ("print('1 0 1'); print('x 1 1')\ndef add(a, b): return None", None)],  # forged result lines lack the nonce
)
def test_code_reward_cannot_be_won_by_crashing_or_printing(code, error):
    reward, info = asyncio.run(code_tests(code, TESTS, wall_s=2, cpu_s=1))
    assert reward == 0.0 and info["passed"] == 0
    if error:
        assert error in info["error"] or "CPU" in info["error"]


class _Handler(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.requests.append(body)  # type: ignore[attr-defined]
        if body["response"] == "slow":
            time.sleep(2)
        if body["response"] == "fail":
            self.send_response(500)
            self.end_headers()
            return
        reply = {"reward": 0.75, "model": "rm-test", "nested": {"dropped": 1}} if body["response"] != "junk" else {"x": 1}
        data = json.dumps(reply).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


class _QuietServer(ThreadingHTTPServer):
    def handle_error(self, request: object, client_address: object) -> None:
        pass  # the client of the slow request hung up on purpose


@pytest.fixture
def rm_server() -> Iterator[ThreadingHTTPServer]:
    server = _QuietServer(("127.0.0.1", 0), _Handler)
    server.requests = []  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def test_reward_model_hook(rm_server: ThreadingHTTPServer):
    url = f"http://127.0.0.1:{rm_server.server_address[1]}/score"
    fn = get_reward("reward_model", url=url, timeout_s=0.5, extra={"task": "t1"})
    assert asyncio.run(score(fn, "good answer", "truth", 5.0)) == (0.75, {"model": "rm-test"})
    assert rm_server.requests[0] == {"response": "good answer", "ground_truth": "truth", "task": "t1"}
    reward, info = asyncio.run(score(fn, "fail", "truth", 5.0))
    assert reward == 0.0 and "HTTP Error 500" in info["failed"]
    reward, info = asyncio.run(score(fn, "junk", "truth", 5.0))
    assert reward == 0.0 and "no number under 'reward'" in info["failed"]
    t = time.monotonic()
    reward, info = asyncio.run(score(fn, "slow", "truth", 5.0))  # the HTTP timeout (0.5 s) fires first
    assert (reward, info) == (0.0, {"failed": "timeout"}) and time.monotonic() - t < 2.0
    dead = get_reward("reward_model", url="http://127.0.0.1:9/score", timeout_s=0.5)
    assert asyncio.run(score(dead, "x", "y", 5.0))[1]["failed"].startswith("URLError")


def test_score_awaits_async_rewards_and_counts_their_failures():
    async def good(r: str, a: str) -> tuple[float, dict]:
        return 0.5, {"async": True}

    async def boom(r: str, a: str) -> float:
        raise KeyError("k")

    async def hang(r: str, a: str) -> float:
        await asyncio.sleep(30)
        return 1.0

    assert asyncio.run(score(good, "x", "y", 1.0)) == (0.5, {"async": True})
    assert asyncio.run(score(boom, "x", "y", 1.0)) == (0.0, {"failed": "KeyError: 'k'"})
    t = time.monotonic()
    assert asyncio.run(score(hang, "x", "y", 0.2)) == (0.0, {"failed": "timeout"})
    assert time.monotonic() - t < 1.5


def test_code_reward_timeout_in_score_kills_the_sandbox():
    t = time.monotonic()
    fn = get_reward("code_tests", wall_s=30, cpu_s=30)
    assert asyncio.run(score(fn, "while True: pass", TESTS, 0.5)) == (0.0, {"failed": "timeout"})
    assert time.monotonic() - t < 3.0
