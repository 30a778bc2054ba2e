"""OpenAIRolloutServer: a `RolloutServer` on one external OpenAI-compatible completion server.

Job: send token ids to `POST {url}/v1/completions` (`prompt` as a list of ids) and return the
generated token ids with, per token, the sampled token's log-prob and the version label this
server stamps; `finish_reason` `stop`, `length` or `abort`. Pause / resume are admission rules
kept here (the remote server knows nothing of them): `wait` drains, `keep` lets running requests
finish, `abort` cancels them (the HTTP request is closed, which makes vLLM drop it) and returns
them with no tokens.
Boundary: one URL, one `httpx.AsyncClient`, no retries (a failed request raises with the URL;
the Router's failover decides what next). The Router routes between several of these.

What the server must return (vLLM: `logprobs` and `return_tokens_as_token_ids=true` give
`token_id:<n>` strings; `return_token_ids=true` gives `token_ids` too, which must agree): one
log-prob per token, parsed into typed records (`msgspec`), never guessed. A reply that does not
have exactly that is a `ReplyError` naming the URL (and counted in `malformed_replies`): a wrong
token or a missing log-prob would be trained on as if sampled.

Weights: such a server cannot take the trainer's weights. The config refuses the backend unless
`rollout.external_weights=frozen`, and a warning says so when each server is built. With it,
`update_weights` consumes the update without loading it and adopts the published version label,
so staleness accounting keeps the samples (their log-probs are the frozen policy's, which the
off-policy correction sees as the behavior policy).

    server = OpenAIRolloutServer("http://127.0.0.1:8000", timeout_s=60)
    out = await server.generate([5, 6, 7], SamplingParams(max_tokens=8, seed=1))
"""

from __future__ import annotations

import asyncio
import logging
import math
import uuid
from typing import TYPE_CHECKING, Any, Iterable

import msgspec

from asyncrl.engines.base import AdmissionGate, GenerateOutput, PauseMode, RolloutServer, SamplingParams, ServerStats, TokenRate, check_pause_mode

if TYPE_CHECKING:
    from asyncrl.config import RolloutConfig

log = logging.getLogger(__name__)
TOKEN_PREFIX = "token_id:"
FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "abort", "eos": "stop"}
_RATE_WINDOW_S = 10.0


class ReplyError(RuntimeError):
    """An external server's reply that cannot be used (HTTP error, timeout, malformed body)."""


class _Logprobs(msgspec.Struct):
    tokens: list[str]
    token_logprobs: list[float | None]


class _Choice(msgspec.Struct):
    finish_reason: str | None
    logprobs: _Logprobs | None = None
    token_ids: list[int] | None = None


class _Completion(msgspec.Struct):
    choices: list[_Choice]


class _Model(msgspec.Struct):
    id: str


class _Models(msgspec.Struct):
    data: list[_Model]


def parse_completion(body: bytes, url: str) -> tuple[list[int], list[float], str]:
    """`(token_ids, logprobs, finish_reason)` of a `/v1/completions` reply; `ReplyError` otherwise."""
    try:
        reply = msgspec.json.decode(body, type=_Completion)
    except msgspec.DecodeError as e:
        raise ReplyError(f"{url}: malformed completion reply ({e}): {body[:200]!r}") from None
    if len(reply.choices) != 1:
        raise ReplyError(f"{url}: expected 1 choice, got {len(reply.choices)}")
    choice = reply.choices[0]
    if choice.logprobs is None:
        raise ReplyError(f"{url}: reply has no logprobs (does the server support `logprobs`?)")
    lp = choice.logprobs
    if len(lp.tokens) != len(lp.token_logprobs):
        raise ReplyError(f"{url}: {len(lp.tokens)} tokens but {len(lp.token_logprobs)} logprobs")
    ids = [_token_id(t, url) for t in lp.tokens]
    if choice.token_ids is not None and choice.token_ids != ids:
        raise ReplyError(f"{url}: token_ids {choice.token_ids[:8]}... disagree with logprobs tokens {ids[:8]}...")
    logprobs: list[float] = []
    for i, x in enumerate(lp.token_logprobs):
        if x is None or not math.isfinite(x) or x > 0:
            raise ReplyError(f"{url}: token {i} has log-prob {x!r}")
        logprobs.append(float(x))
    reason = FINISH_REASONS.get(choice.finish_reason or "")
    if reason is None:
        raise ReplyError(f"{url}: unknown finish_reason {choice.finish_reason!r}")
    return ids, logprobs, reason


def _token_id(token: str, url: str) -> int:
    if not token.startswith(TOKEN_PREFIX) or not token[len(TOKEN_PREFIX):].isdigit():
        raise ReplyError(f"{url}: token {token[:40]!r} is not `token_id:<n>` (the server must honour "
                         "return_tokens_as_token_ids=true)")
    return int(token[len(TOKEN_PREFIX):])


def request_body(model: str, prompt_ids: list[int], sampling: SamplingParams) -> dict[str, Any]:
    """The JSON body of one completion request (OpenAI fields plus vLLM / SGLang extensions)."""
    body: dict[str, Any] = {
        "model": model, "prompt": list(prompt_ids), "max_tokens": sampling.max_tokens,
        "temperature": sampling.temperature, "top_p": sampling.top_p, "logprobs": 1,
        "return_tokens_as_token_ids": True, "return_token_ids": True,
    }
    if sampling.top_k != -1:
        body["top_k"] = sampling.top_k
    if sampling.seed is not None:
        body["seed"] = sampling.seed
    if sampling.stop_token_ids:
        body["stop_token_ids"] = list(sampling.stop_token_ids)
    if sampling.stop:
        body["stop"] = list(sampling.stop)
    return body


class OpenAIRolloutServer(RolloutServer):
    """One external server at `url`; see the module docstring."""

    @classmethod
    def from_config(cls, cfg: RolloutConfig, model_path: str, *, dtype: str, seed: int, index: int = 0,
                    log_dir: str | None = None) -> OpenAIRolloutServer:
        """Server `index` is `rollout.server_urls[index]` (one per URL; the config requires
        `external_weights=frozen`)."""
        return cls(cfg.server_urls[index], timeout_s=cfg.request_timeout_s)

    def __init__(self, url: str, *, timeout_s: float = 600.0, model: str | None = None) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.model = model
        """Served model name; asked from `/v1/models` on first use when None."""
        self._client: Any = None  # built on the event loop that first uses it
        self._tasks: set[asyncio.Task] = set()
        self._gate = AdmissionGate()
        self._version = 0
        self._rate = TokenRate(_RATE_WINDOW_S)
        self._closed = False
        self.malformed_replies = 0
        self.ignored_updates = 0
        log.warning("rollout server %s is external: it does not load the trainer's weights "
                    "(rollout.external_weights=frozen): rollouts keep its policy for the whole run", self.url)

    # ---- HTTP -------------------------------------------------------------------------------
    def _http(self) -> Any:
        if self._client is None:
            import httpx

            self._client = httpx.AsyncClient(base_url=self.url, timeout=self.timeout_s)
        return self._client

    async def _send(self, method: str, path: str, **kw: Any) -> bytes:
        import httpx

        try:
            resp = await self._http().request(method, path, **kw)
        except httpx.TimeoutException:
            raise ReplyError(f"{self.url}{path}: no reply within {self.timeout_s} s (rollout.request_timeout_s)") from None
        except httpx.HTTPError as e:
            raise ReplyError(f"{self.url}{path}: {type(e).__name__}: {e}") from None
        if resp.status_code != 200:
            raise ReplyError(f"{self.url}{path}: HTTP {resp.status_code}: {resp.text[:300]}")
        return resp.content

    async def _model_name(self) -> str:
        if self.model is None:
            body = await self._send("GET", "/v1/models")
            try:
                models = msgspec.json.decode(body, type=_Models)
            except msgspec.DecodeError as e:
                raise ReplyError(f"{self.url}/v1/models: malformed reply ({e})") from None
            if not models.data:
                raise ReplyError(f"{self.url}/v1/models: the server lists no model")
            self.model = models.data[0].id
        return self.model

    # ---- generation -------------------------------------------------------------------------
    async def generate(self, prompt_ids: list[int], sampling: SamplingParams, request_id: str | None = None) -> GenerateOutput:
        if not prompt_ids:
            raise ValueError("generate: prompt_ids is empty")
        if self._closed:
            raise RuntimeError(f"rollout server {self.url} is closed")
        rid = request_id or uuid.uuid4().hex
        await self._gate.wait()
        task = asyncio.ensure_future(self._complete(prompt_ids, sampling, rid))
        self._tasks.add(task)
        try:
            ids, logprobs, reason = await asyncio.shield(task)
        except asyncio.CancelledError:
            if not task.cancelled():  # our caller was cancelled: stop the request too
                task.cancel()
                raise
            return GenerateOutput(rid, [], [], [], "abort")  # aborted by pause("abort")
        finally:
            self._tasks.discard(task)
        self._rate.add(len(ids))
        return GenerateOutput(rid, ids, logprobs, [self._version] * len(ids), reason)

    async def _complete(self, prompt_ids: list[int], sampling: SamplingParams, rid: str) -> tuple[list[int], list[float], str]:
        body = request_body(await self._model_name(), prompt_ids, sampling)
        raw = await self._send("POST", "/v1/completions", json=body, headers={"X-Request-Id": rid})
        try:
            return parse_completion(raw, f"{self.url}/v1/completions")
        except ReplyError:
            self.malformed_replies += 1
            raise

    # ---- pause / weights --------------------------------------------------------------------
    async def pause(self, mode: PauseMode = "wait") -> None:
        check_pause_mode(mode)
        self._gate.close()
        if mode == "abort":
            for task in list(self._tasks):
                task.cancel()
        if mode in ("abort", "wait") and self._tasks:
            await asyncio.wait(list(self._tasks))
            await asyncio.sleep(0)  # let each caller take its result before pause returns

    async def resume(self) -> None:
        self._gate.open()

    async def update_weights(self, named_tensors: Iterable[tuple[str, Any]], version: int) -> None:
        """Consume the update without loading it (the server cannot take weights; accepted by
        `rollout.external_weights=frozen`) and adopt `version` as this server's label."""
        for _ in named_tensors:
            pass
        self.ignored_updates += 1
        self._version = int(version)

    async def reset_prefix_cache(self) -> None:
        """Nothing to do: the server's weights never change, so its cached KV never goes stale."""

    def stats(self) -> ServerStats:
        return ServerStats(self._version, len(self._tasks), self._gate.paused, self._rate.total,
                           self._rate.per_s(), healthy=not self._closed)

    @property
    def version(self) -> int:
        return self._version

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for task in list(self._tasks):
            task.cancel()
        if self._client is not None:
            await self._client.aclose()
