"""The RolloutServer interface: what every inference backend (torch, vllm, openai, cost_model) offers.

A server takes token ids and returns token ids with, per generated token, the log-prob
of the sampled token and the policy version that produced it. Weights are replaced in
place (`update_weights`), after which the prefix / KV cache is dropped and the version
the server stamps on new tokens is bumped.

Log-prob definition (shared with the trainer's `compute_logprobs`): the log-softmax of
`logits / temperature` at the sampled token, before top-k / top-p filtering. RL recipes
keep top_k / top_p off so that this is the sampling distribution exactly.

Pause modes, used around a weight update:
- `abort`: in-flight requests return at once with what they have (`finish_reason="abort"`),
  so the caller can resubmit prompt + partial tokens (partial rollout);
- `wait`: stop admitting new work and wait for in-flight requests to finish (drain);
- `keep`: in-flight requests continue; tokens produced after the update carry the new version.

Hooks: besides the abstract verbs, `RolloutServer` declares every method a backend may provide, each
with a default that fits a plain engine (`from_config`, `load_update`, `receiver_transport`,
`loads_in_place`, `score`, `live_requests`, `export_weights`, `close`); callers call them and never
probe a backend with `getattr` / `hasattr`. The weight plane drives `pause`, `load_update`, `resume`
and `loads_in_place` through a structural protocol of its own (`checkpoint_engine.server_loop.Updatable`),
since it does not import asyncrl.
"""

from __future__ import annotations

import abc
import asyncio
import collections
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable, Literal

if TYPE_CHECKING:
    from asyncrl.config import RolloutConfig
    from checkpoint_engine import WeightsConfig
    from checkpoint_engine.backends.base import ReceiverTransport
    from checkpoint_engine.receiver import Update

PauseMode = Literal["abort", "wait", "keep"]
PAUSE_MODES = ("abort", "wait", "keep")


def check_pause_mode(mode: str) -> None:
    """Every server's `pause` refuses a mode it does not know, with the same message."""
    if mode not in PAUSE_MODES:
        raise ValueError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")


@dataclass
class SamplingParams:
    """How to sample one request."""

    temperature: float = 1.0
    """Softmax temperature; 0 means greedy."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]; 1 disables it."""
    top_k: int = -1
    """Keep the k most likely tokens; -1 disables it."""
    max_tokens: int = 64
    """Most tokens to generate for this request."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Generation stops after emitting any of these (the EOS token is added by the server)."""
    stop: list[str] = field(default_factory=list)
    """Stop strings: generation stops at the token whose decoded text completes one of them.
    The response keeps every generated token id (that token included, with its log-prob), so
    the trainer scores exactly what was sampled; only a decoded text would be cut at the string.
    `finish_reason` is `stop`."""
    seed: int | None = None
    """Per-request seed; with it a request samples the same tokens on every run."""

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"sampling.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"sampling.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"sampling.top_k must be -1 (off) or >= 1, got {self.top_k}")
        if self.max_tokens < 1:
            raise ValueError(f"sampling.max_tokens must be >= 1, got {self.max_tokens}")
        if any(not isinstance(x, str) or not x for x in self.stop):
            raise ValueError(f"sampling.stop must be a list of non-empty strings, got {self.stop!r}")


@dataclass
class GenerateOutput:
    """Result of one request. All lists have one entry per generated token."""

    request_id: str
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    """Policy version that produced each token."""
    finish_reason: str
    """`stop`, `length` or `abort`."""


# Why a peer's hand-out of its weights to a joining server (`ServerHost.send_offered`) did not count
# because a publish reached that peer meanwhile: the joiner asks again after that publish.
PEER_WAS_LOADING = "this server was loading weights"
PEER_LOADED_MEANWHILE = "this server loaded new weights meanwhile"


@dataclass
class ServerStats:
    version: int
    in_flight: int
    paused: bool
    generated_tokens: int
    """Tokens generated since start."""
    tokens_per_s: float
    """Recent generation throughput."""
    healthy: bool = True
    arena_waits: int = 0
    """Writes of finished samples that found this server's data-plane arena full and waited for frees
    (back-pressure: `StoragePlane.backpressure`; 0 where the plane has no arena). Its host fills these three."""
    arena_wait_s: float = 0.0
    """Seconds those writes waited, the waits in progress included."""
    arena_waiting: int = 0
    """Writes waiting for arena space now."""


class RolloutServer(abc.ABC):
    """One inference server. Async methods are called from one asyncio event loop."""

    loads_in_place: bool = False
    """Whether a weight load that fails midway leaves the weights half replaced (the torch engine
    writes into its parameters as buckets land; vLLM reloads layer by layer): the server then stays
    paused until a later load succeeds (`checkpoint_engine.server_loop.apply_update`). False: a
    failed load leaves the old weights whole, and the server resumes on them."""

    @classmethod
    def from_config(cls, cfg: RolloutConfig, model_path: str, *, dtype: str, seed: int, index: int = 0,
                    log_dir: str | None = None) -> RolloutServer:
        """Server `index` of a fleet of this backend, from the `rollout:` config: what `build_server`
        (backends.py) calls for the name `rollout.backend` gives (registry.py). `seed` is the fleet's
        (a backend offsets it by `index`); `log_dir`, the run directory, takes engine logs. Default:
        not buildable from config (wrappers such as `ServerHost` and test doubles)."""
        raise NotImplementedError(f"{cls.__name__} is no rollout backend: it is not built from the rollout config")

    @abc.abstractmethod
    async def generate(
        self, prompt_ids: list[int], sampling: SamplingParams, request_id: str | None = None
    ) -> GenerateOutput: ...

    @abc.abstractmethod
    async def pause(self, mode: PauseMode = "wait") -> None: ...

    @abc.abstractmethod
    async def resume(self) -> None: ...

    @abc.abstractmethod
    async def update_weights(self, named_tensors: Iterable[tuple[str, "object"]], version: int) -> None:
        """Load (name, tensor) pairs (HF state-dict names, any order, possibly a subset) in place,
        drop the prefix / KV cache, and set the version stamped on tokens from now on."""

    async def load_update(self, update: Update) -> None:
        """Load one weight-plane update: (name, tensor) pairs as its buckets land, labelled
        `update.version`. The caller paused this server first (`checkpoint_engine.server_loop`). Default:
        the pairs are received on a worker thread (the event loop stays free for the other servers of
        this process, since the sender waits for every receiver at each step, and for requests under
        `keep`), then passed whole to `update_weights`. A backend that lands bytes in place as they
        arrive, or whose workers receive them itself (`receiver_transport`), overrides it."""
        from checkpoint_engine.server_loop import blocking

        pairs = await blocking(list, update)
        await self.update_weights(pairs, update.version)

    def receiver_transport(self, cfg: WeightsConfig) -> ReceiverTransport | None:
        """The weight plane's receiving end for this engine, when it has one of its own (vLLM: one in
        every worker, so buckets land in the workers' memory, not in this process), made when the server
        joins the plane (`ServerHost.join_weights`, on the server's event loop). None (the default): the
        `Receiver` makes the transport `cfg` names, in this process, and `load_update` reads from it."""
        return None

    @abc.abstractmethod
    async def reset_prefix_cache(self) -> None: ...

    async def score(self, token_ids: list[int]) -> list[float] | None:
        """Teacher-forced log-probs at temperature 1 of `token_ids[1:]`, each given the tokens before it,
        under the weights served now (the weight-parity probe, `asyncrl/rollout/parity.py`). None: this
        backend cannot score (an external server with frozen weights), and its parity goes unchecked."""
        return None

    async def live_requests(self) -> list[GenerateOutput]:
        """The requests generating now, each with what it has so far (`finish_reason` `running`): its
        tokens, their log-probs and versions, under the `request_id` it was given. A checkpoint saves
        them so that a resume continues those samples (`asyncrl/rollout/inflight.py`). Default: nothing
        (an engine that cannot tell; its samples in flight are generated again, counted as `redone`)."""
        return []

    def export_weights(self) -> Iterable[tuple[str, "object"]] | None:
        """The weights served now as (HF name, tensor) pairs, read in place (no copy): what a peer sends a
        server that joins a live run (`ServerHost.offer_weights`), so the trainer does not have to. None:
        this backend cannot hand out its weights (vLLM, an external server); its joiners get the next publish."""
        return None

    @abc.abstractmethod
    def stats(self) -> ServerStats: ...

    @property
    @abc.abstractmethod
    def version(self) -> int: ...

    async def close(self) -> None:
        """Release processes and memory. Idempotent."""


class TokenRate:
    """Tokens generated, in all and per second over the last `window_s` seconds (a server's `stats`).

    >>> r = TokenRate(window_s=10.0); r.add(30); (r.total, r.per_s() > 0)
    (30, True)
    """

    def __init__(self, window_s: float = 10.0) -> None:
        self.window_s = window_s
        self.total = 0
        self._recent: collections.deque[tuple[float, int]] = collections.deque()

    def add(self, n: int) -> None:
        if not n:
            return
        now = time.monotonic()
        self.total += n
        self._recent.append((now, n))
        while self._recent and now - self._recent[0][0] > self.window_s:
            self._recent.popleft()

    def per_s(self) -> float:
        now = time.monotonic()
        return sum(n for t, n in self._recent if now - t <= self.window_s) / self.window_s


class AdmissionGate:
    """Whether a server admits new requests: `generate` waits at `wait()` while the server is paused
    (`close`) until `open`. The event is made on first use, on the event loop the server runs on (a
    server may be built off it). Shared by the backends that keep pause / resume themselves (openai, vllm).

    >>> g = AdmissionGate(); g.close(); g.paused
    True
    """

    def __init__(self) -> None:
        self.paused = False
        self._event: asyncio.Event | None = None

    def _admission(self) -> asyncio.Event:
        if self._event is None:
            self._event = asyncio.Event()
            if not self.paused:
                self._event.set()
        return self._event

    async def wait(self) -> None:
        await self._admission().wait()

    def close(self) -> None:
        self.paused = True
        self._admission().clear()

    def open(self) -> None:
        self.paused = False
        self._admission().set()
