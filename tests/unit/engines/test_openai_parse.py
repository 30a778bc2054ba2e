"""The `openai` backend against a tiny local HTTP server with canned OpenAI replies: parsing of
token ids and log-probs, every malformed reply a clear error naming the URL (never a wrong
token), timeouts, pause(abort), and the config rules (frozen weights, one server per URL)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Iterator

import pytest

from asyncrl.config import ConfigError, RolloutConfig
from asyncrl.engines.base import SamplingParams
from asyncrl.engines.openai_server import OpenAIRolloutServer, ReplyError, parse_completion

pytestmark = pytest.mark.timeout(30)


def completion(tokens: list[str], logprobs: list[Any], finish: str | None = "length", token_ids: Any = None) -> dict:
    return {"choices": [{"index": 0, "text": "", "finish_reason": finish, "token_ids": token_ids,
                         "logprobs": {"tokens": tokens, "token_logprobs": logprobs, "text_offset": [0] * len(tokens)}}]}


GOOD = completion(["token_id:7", "token_id:0", "token_id:41"], [-1.5, -0.25, -3.0], "stop", [7, 0, 41])
REPLIES: dict[int, Any] = {  # keyed by the prompt's first id
    1: GOOD,
    2: b"{not json",
    3: completion(["oops", "token_id:4"], [-1.0, -1.0]),  # text tokens: return_tokens_as_token_ids ignored
    4: completion(["token_id:5", "token_id:6"], [-1.0, None]),  # a missing log-prob
    5: completion(["token_id:5", "token_id:6"], [-1.0]),  # lengths disagree
    6: completion(["token_id:5", "token_id:6"], [-1.0, -2.0], token_ids=[5, 9]),  # ids disagree
    7: {"choices": []},
    8: completion(["token_id:5"], [-1.0], "weird"),
    9: completion(["token_id:5"], [0.5]),  # a positive log-prob is no log-prob
    10: completion(["token_id:5"], [-1.0], "length", None),  # no token_ids field: the tokens decide
}


class Handler(BaseHTTPRequestHandler):
    bodies: list[dict] = []

    def log_message(self, *args: Any) -> None:  # keep test output clean
        pass

    def _reply(self, status: int, payload: Any) -> None:
        data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self._reply(200, {"object": "list", "data": [{"id": "tiny", "object": "model"}]})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        Handler.bodies.append(body)
        first = body["prompt"][0]
        if first == 99:
            self._reply(500, {"error": {"message": "engine is dead"}})
        elif first == 98:  # slow: for timeouts and aborts
            time.sleep(1.5)
            self._reply(200, GOOD)
        else:
            self._reply(200, REPLIES[first])


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 20))


def test_good_reply_gives_ids_logprobs_versions_and_sends_token_ids(url: str) -> None:
    async def go() -> Any:
        server = OpenAIRolloutServer(url, timeout_s=5)
        out = await server.generate([1, 2, 3], SamplingParams(max_tokens=3, seed=4, stop=["\n"], stop_token_ids=[41]))
        await server.update_weights(iter([("w", None)]), version=3)  # consumed, not loaded; label adopted
        again = await server.generate([1], SamplingParams(max_tokens=3))
        await server.close()
        return out, again, server

    out, again, server = run(go())
    assert (out.token_ids, out.logprobs, out.finish_reason) == ([7, 0, 41], [-1.5, -0.25, -3.0], "stop")
    assert out.versions == [0, 0, 0] and again.versions == [3, 3, 3]
    assert server.ignored_updates == 1 and server.stats().generated_tokens == 6
    sent = Handler.bodies[-2]
    assert sent["prompt"] == [1, 2, 3] and sent["model"] == "tiny" and sent["seed"] == 4
    assert sent["return_tokens_as_token_ids"] is True and sent["logprobs"] >= 0
    assert sent["stop"] == ["\n"] and sent["stop_token_ids"] == [41] and "top_k" not in sent


@pytest.mark.parametrize("first, words", [
    (2, "malformed"), (3, "token_id:<n>"), (4, "log-prob None"), (5, "2 tokens but 1 logprobs"),
    (6, "disagree"), (7, "expected 1 choice"), (8, "finish_reason 'weird'"), (9, "log-prob 0.5"),
])
def test_malformed_reply_is_an_error_naming_the_url_and_counted(url: str, first: int, words: str) -> None:
    async def go() -> OpenAIRolloutServer:
        server = OpenAIRolloutServer(url, timeout_s=5, model="tiny")
        with pytest.raises(ReplyError) as err:
            await server.generate([first], SamplingParams(max_tokens=2))
        assert f"{url}/v1/completions" in str(err.value) and words in str(err.value)
        await server.close()
        return server

    server = run(go())
    assert server.malformed_replies == 1 and server.stats().generated_tokens == 0 and server.stats().in_flight == 0


def test_reply_without_token_ids_field_uses_the_token_strings() -> None:
    assert parse_completion(json.dumps(REPLIES[10]).encode(), "u") == ([5], [-1.0], "length")


def test_http_error_and_timeout_name_url_and_key(url: str) -> None:
    async def go() -> None:
        server = OpenAIRolloutServer(url, timeout_s=0.5, model="tiny")
        with pytest.raises(ReplyError, match=r"/v1/completions: HTTP 500: .*engine is dead"):
            await server.generate([99], SamplingParams())
        with pytest.raises(ReplyError, match=r"no reply within 0.5 s \(rollout.request_timeout_s\)"):
            await server.generate([98], SamplingParams())
        await server.close()
        dead = OpenAIRolloutServer("http://127.0.0.1:9", timeout_s=2)
        with pytest.raises(ReplyError, match=r"http://127.0.0.1:9/v1/models: ConnectError"):
            await dead.generate([1], SamplingParams())
        await dead.close()

    run(go())


def test_pause_abort_returns_running_requests_and_holds_new_ones(url: str) -> None:
    async def go() -> None:
        server = OpenAIRolloutServer(url, timeout_s=5, model="tiny")
        running = asyncio.ensure_future(server.generate([98], SamplingParams()))
        await asyncio.sleep(0.3)
        assert server.stats().in_flight == 1
        t0 = time.monotonic()
        await server.pause("abort")
        assert time.monotonic() - t0 < 1.0  # did not wait for the slow reply
        out = running.result()
        assert (out.token_ids, out.finish_reason) == ([], "abort")
        held = asyncio.ensure_future(server.generate([1], SamplingParams()))
        await asyncio.sleep(0.2)
        assert not held.done() and server.stats().paused
        await server.resume()
        assert (await held).token_ids == [7, 0, 41]
        await server.close()

    run(go())


def test_config_refuses_openai_without_frozen_weights_and_counts_servers_by_url() -> None:
    urls = ["http://127.0.0.1:8000", "http://127.0.0.1:8001"]
    with pytest.raises(ConfigError, match=r"rollout.external_weights: .*frozen"):
        RolloutConfig(backend="openai", server_urls=urls)
    with pytest.raises(ConfigError, match=r"rollout.server_urls"):
        RolloutConfig(backend="openai", external_weights="frozen")
    with pytest.raises(ConfigError, match=r"rollout.server_urls\[1\]"):
        RolloutConfig(backend="openai", external_weights="frozen", server_urls=[urls[0], "127.0.0.1:1"])
    with pytest.raises(ConfigError, match=r"rollout.num_servers"):
        RolloutConfig(backend="openai", external_weights="frozen", server_urls=urls, num_servers=3)
    cfg = RolloutConfig(backend="openai", external_weights="frozen", server_urls=urls)
    assert cfg.num_servers == 2

    from asyncrl.rollout.fleet_build import build_fleet

    servers = build_fleet(cfg, "unused", dtype="float32", seed=0)
    assert [s.url for s in servers] == urls and all(isinstance(s, OpenAIRolloutServer) for s in servers)
