"""TorchRolloutServer: the embedded rollout engine (HF causal LM, KV cache, continuous batching).

Job: serve `RolloutServer` calls from one asyncio event loop with an HF model on CPU (or one
GPU): batched decoding of all concurrent requests, per-token log-probs and versions, weight
updates between decode steps, a prefix cache, and the three pause modes of `base.py`.
Boundary: one process, one device, full-attention decoder models; no HTTP, no Ray (a fleet
actor wraps this class). The CPU default, and the plain reference for what a backend must do.
`eos_token_ids` (generation config, model config and tokenizer EOS together) is added to every
request's stop tokens. Stop strings (`SamplingParams.stop`) are matched on the decoded tail of the
response after each token (`torch_sampling.StopRule`, needs the tokenizer in the model folder);
the token that completes one is kept with its log-prob and the request ends with `stop`.

Threading: one engine thread (`torch_worker.EngineWorker`) owns the model and all decode state. The
asyncio side only touches a lock-protected inbox (pending requests, commands, pause state) and
awaits futures that the engine thread resolves with `loop.call_soon_threadsafe`. torch releases
the GIL inside its kernels, so the event loop keeps running while a step computes.

Example:
    server = TorchRolloutServer(path, seed=0)
    out = await server.generate([5, 6, 7], SamplingParams(max_tokens=8, seed=1))
    await server.pause("keep"); await server.update_weights(named, version=1); await server.resume()
    await server.close()
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from typing import TYPE_CHECKING, Any, Iterable

import torch

from asyncrl.engines.base import GenerateOutput, PauseMode, RolloutServer, SamplingParams, ServerStats, check_pause_mode
from asyncrl.engines.torch_kv import PrefixCache
from asyncrl.engines.torch_sampling import StopRule, draw_uniforms, load_tokenizer, model_eos_ids
from asyncrl.engines.torch_worker import Command, EngineWorker, Inbox, Request, resolve

if TYPE_CHECKING:
    from asyncrl.config import RolloutConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class TorchRolloutServer(RolloutServer):
    """The embedded rollout server; see the module docstring. Build it, await its verbs, `close()` it.

    Args:
        model_path: a local HF model folder (config + safetensors).
        dtype: `float32`, `bfloat16` or `float16`; the model and KV cache run in it.
        weights_dtype: the dtype published weights arrive in (the trainer's `model.dtype`) when it is
            not `dtype` (`rollout.dtype`): such tensors are cast into the parameters as they land
            (`land_into`'s `cast_from`); None: every tensor must arrive in `dtype`.
        device: torch device string (`cpu`, `cuda:0`).
        max_batch_size: most requests decoded together; more wait in the queue.
        seed: base seed for requests without `SamplingParams.seed` (drawn in arrival order).
        threads: torch intra-op threads for this process when > 0 (`torch.set_num_threads`).
        prefix_cache_size: prompts whose KV is kept (exact match, LRU); 0 disables it.
    """

    loads_in_place = True
    """`load_update` writes into the parameters as buckets land: one that fails midway leaves them
    half replaced, so the server stays paused until an update succeeds (`server_loop`)."""

    @classmethod
    def from_config(cls, cfg: RolloutConfig, model_path: str, *, dtype: str, seed: int, index: int = 0,
                    log_dir: str | None = None) -> TorchRolloutServer:
        """`dtype` is the trainer's (what weights are published in); the engine runs in `rollout.dtype`
        when set (`cfg.engine_dtype`) and casts what lands."""
        return cls(model_path, dtype=cfg.engine_dtype(dtype), weights_dtype=dtype, max_batch_size=cfg.max_batch_size,
                   seed=seed + index, threads=cfg.torch_threads, prefix_cache_size=cfg.prefix_cache_size)

    def __init__(
        self,
        model_path: str | os.PathLike,
        *,
        dtype: str = "float32",
        weights_dtype: str | None = None,
        device: str = "cpu",
        max_batch_size: int = 512,
        seed: int = 0,
        threads: int = 0,
        prefix_cache_size: int = 64,
    ) -> None:
        from asyncrl.hf_imports import skip_unused_backends

        skip_unused_backends()
        from transformers import AutoModelForCausalLM

        for arg, value in (("dtype", dtype), ("weights_dtype", weights_dtype or dtype)):
            if value not in DTYPES:
                raise ValueError(f"TorchRolloutServer {arg} must be one of {sorted(DTYPES)}, got {value!r}")
        if max_batch_size < 1:
            raise ValueError(f"TorchRolloutServer max_batch_size must be >= 1, got {max_batch_size}")
        if threads > 0:
            torch.set_num_threads(threads)
        # safetensors only, as the trainer's loader: a pytorch_model.bin would be unpickled
        model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=DTYPES[dtype], use_safetensors=True).to(device).eval()
        model.requires_grad_(False)
        self.model = model
        self._params: dict[str, torch.Tensor] = {k: v.data for k, v in model.state_dict(keep_vars=True).items()}
        """HF name -> the parameter's storage (what updates copy into)."""
        self.cast_from = DTYPES[weights_dtype] if weights_dtype and weights_dtype != dtype else None
        """The trainer's dtype when it is not the engine's: updates in it are cast on landing."""
        self.model_path = str(model_path)
        self.tokenizer = load_tokenizer(model_path)
        """The folder's tokenizer (None without one): EOS ids and stop strings."""
        gen = getattr(model, "generation_config", None)
        self.eos_token_ids = model_eos_ids(getattr(gen, "eos_token_id", None), model.config.eos_token_id, self.tokenizer)
        self.max_model_len = int(getattr(model.config, "max_position_embeddings", 1 << 30))
        self._seeds = torch.Generator().manual_seed(seed)
        self._inbox = Inbox()
        self._worker = EngineWorker(
            model, self._inbox, torch.device(device), max_batch_size=max_batch_size,
            prefix_cache=PrefixCache(prefix_cache_size), max_model_len=self.max_model_len,
        )
        self._thread = threading.Thread(target=self._worker.run, name="torch-rollout-engine", daemon=True)
        self._thread.start()

    # -- verbs ---------------------------------------------------------------------------

    async def generate(
        self, prompt_ids: list[int], sampling: SamplingParams, request_id: str | None = None
    ) -> GenerateOutput:
        if not prompt_ids:
            raise ValueError("generate: prompt_ids is empty")
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(f"generate: prompt of {len(prompt_ids)} tokens leaves no room (max_model_len {self.max_model_len})")
        loop = asyncio.get_running_loop()
        inbox = self._inbox
        with inbox.cv:
            inbox.raise_if_unusable()
            seed = sampling.seed if sampling.seed is not None else int(torch.randint(2**62, (1,), generator=self._seeds))
            rid = request_id if request_id is not None else f"req-{inbox.counter}"
            inbox.counter += 1
            tokens: list[int] = []
            req = Request(
                rid=rid, prompt=list(prompt_ids), sampling=sampling, tokens=tokens,
                stop_ids=self._stop_rule(sampling, tokens),  # a frozenset or a StopRule
                uniforms=draw_uniforms(seed, min(sampling.max_tokens, self.max_model_len - len(prompt_ids))),
                loop=loop, future=loop.create_future(),
            )
            inbox.pending.append(req)
            inbox.in_flight += 1
            inbox.cv.notify()
        try:
            return await req.future
        except asyncio.CancelledError:
            self._cancel(req)
            raise

    def _stop_rule(self, sampling: SamplingParams, tokens: list[int]) -> frozenset[int] | StopRule:
        """What ends this request: its stop ids and EOS, and its stop strings read off `tokens`."""
        ids = self.eos_token_ids | frozenset(sampling.stop_token_ids)
        if not sampling.stop:
            return ids
        if self.tokenizer is None:
            raise ValueError(f"rollout.stop: stop strings {sampling.stop!r} need a tokenizer, and {self.model_path} has none")
        decode = self.tokenizer.decode
        return StopRule(ids, sampling.stop, tokens, lambda t: decode(t, skip_special_tokens=True))

    def _cancel(self, req: Request) -> None:
        """A caller gave up on `req`: drop it from the queue, or let the engine drop its row."""
        with self._inbox.cv:
            if req in self._inbox.pending:
                self._inbox.pending.remove(req)
                self._inbox.in_flight -= 1
                return
            req.cancelled = True
            self._inbox.cv.notify()

    async def pause(self, mode: PauseMode = "wait") -> None:
        """Stop admitting requests (until `resume`), then, by `mode`: `abort` returns every in-flight
        and queued request at once with what it has; `wait` returns once the running requests have
        finished; `keep` freezes the running requests (no decode step until `resume`), keeping
        their state, so after an `update_weights` they continue under the new weights."""
        check_pause_mode(mode)
        with self._inbox.cv:
            self._inbox.paused = mode
            queued = list(self._inbox.pending) if mode == "abort" else []
            if queued:
                self._inbox.pending.clear()
                self._inbox.in_flight -= len(queued)
        for req in queued:  # never started: nothing generated yet
            resolve(req.loop, req.future, req.output("abort"))
        kind = {"abort": "abort_all", "wait": "drain", "keep": "barrier"}[mode]
        await self._command(kind)

    async def resume(self) -> None:
        with self._inbox.cv:
            self._inbox.paused = None
            self._inbox.cv.notify()

    async def update_weights(self, named_tensors: Iterable[tuple[str, Any]], version: int) -> None:
        """Copy (name, tensor) pairs into the model between decode steps, drop the prefix cache,
        recompute the KV of running requests with the new weights, and stamp `version` on every
        token sampled from then on. All pairs are checked (name, shape, dtype) before any is copied; a
        tensor in `weights_dtype` is cast into its parameter by the copy."""
        updates: list[tuple[torch.Tensor, torch.Tensor]] = []
        for name, value in named_tensors:
            tensor = value if isinstance(value, torch.Tensor) else torch.as_tensor(value)
            param = self._params.get(name)
            if param is None:
                known = ", ".join(list(self._params)[:4])
                raise KeyError(f"update_weights: model has no parameter {name!r} (names look like: {known}, ...)")
            if tensor.shape != param.shape:
                raise ValueError(f"update_weights: {name} has shape {tuple(tensor.shape)}, model expects {tuple(param.shape)}")
            if tensor.dtype != param.dtype and tensor.dtype != self.cast_from:
                raise ValueError(f"update_weights: {name} has dtype {tensor.dtype}, model expects {param.dtype}")
            updates.append((param, tensor))
        await self._command("update", (updates, int(version)))

    def export_weights(self) -> Iterable[tuple[str, Any]] | None:
        return None if self.version < 0 else list(self._params.items())

    async def load_update(self, update: Any) -> None:
        """Load a weight-plane update while paused (the host pauses first, so the engine thread is
        idle): its tensors land straight in the parameters as buckets arrive (one copy, no
        allocation; `checkpoint_engine.land_into`), then, on the engine thread, the prefix cache is
        dropped, running KV recomputed and `update.version` stamped from then on. An unknown name
        or a mismatched shape stops the load midway (`loads_in_place`: the server stays paused
        until a later update succeeds). The update carries the trainer's dtype; with `weights_dtype`
        set each tensor is cast into its parameter as it lands (one copy, as without a cast)."""
        from checkpoint_engine.receiver import land_into
        from checkpoint_engine.server_loop import blocking

        await blocking(land_into, update, self._params, cast_from=self.cast_from)
        await self._command("update", ([], int(update.version)))

    async def reset_prefix_cache(self) -> None:
        await self._command("reset_prefix_cache")

    async def score(self, token_ids: list[int]) -> list[float]:
        """Log-probs of `token_ids[1:]` (teacher-forced, temperature 1), on the engine thread between steps."""
        if len(token_ids) < 2:
            raise ValueError("score: needs at least 2 token ids")
        return await self._command("score", list(token_ids))

    async def live_requests(self) -> list[GenerateOutput]:
        """What every running request has so far, read on the engine thread between two steps
        (queued ones have nothing yet and are not listed)."""
        return await self._command("live")

    def stats(self) -> ServerStats:
        inbox = self._inbox
        with inbox.cv:
            now = time.monotonic()
            while inbox.recent and inbox.recent[0][0] < now - inbox.rate_window_s:
                inbox.recent.popleft()
            span = min(inbox.rate_window_s, now - inbox.first_step_at) if inbox.first_step_at else 0.0
            rate = sum(n for _, n in inbox.recent) / span if span > 0 else 0.0
            return ServerStats(
                version=self._worker.version, in_flight=inbox.in_flight, paused=inbox.paused is not None,
                generated_tokens=inbox.generated_tokens, tokens_per_s=rate,
                healthy=inbox.error is None and (inbox.closed or self._thread.is_alive()),
            )

    @property
    def version(self) -> int:
        return self._worker.version

    @property
    def prefix_cache(self) -> PrefixCache:
        """The prefix cache (read `hits`, `misses`, `len()`); owned by the engine thread."""
        return self._worker.prefix_cache

    async def close(self) -> None:
        """Stop the engine thread; requests still in flight return with `finish_reason="abort"`."""
        with self._inbox.cv:
            self._inbox.closed = True
            self._inbox.cv.notify()
        await asyncio.to_thread(self._thread.join)

    async def _command(self, kind: str, payload: Any = None) -> Any:
        loop = asyncio.get_running_loop()
        cmd = Command(kind=kind, payload=payload, loop=loop, future=loop.create_future())
        with self._inbox.cv:
            self._inbox.raise_if_unusable()
            self._inbox.commands.append(cmd)
            self._inbox.cv.notify()
        return await cmd.future
