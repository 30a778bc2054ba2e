"""The embedded torch engine alone at a few concurrencies: the shape of its per-token cost.

Job: part of the demo calibration (`demo.py`). A batched engine decodes every running request
in one step, so a request's seconds per token grow with the requests in flight; this module
times rounds of `c` concurrent requests (the demo's tiny model, four new tokens each, one torch
thread: with two on this shared 2-core host a round ran 100x slower) for each `c` in `CONCURRENCY`, best of `REPEATS`, and
fits `seconds per token = base + slope x c` by least squares. It runs as its own process
(`python -m asyncrl.plan.engine_sweep`) so the plan command never imports torch and the timing
sees the host as a demo run does. It knows the engine's constructor and `generate`, nothing of
the trainer, the pipeline or the simulator; `demo.py` scales the fitted line to the sync
calibration run's level, so only its shape (slope / base) is taken from here.
"""

from __future__ import annotations

import json
import subprocess
import sys

CONCURRENCY = (2, 8, 32, 64)
"""Requests in flight per timed round: from a paced fully_async run's few to a sync batch (8 x 8)."""
MAX_TOKENS = 4
"""New tokens per request, as the demo task's responses."""
REPEATS = 3
QUICK = {"concurrency": (2, 64), "repeats": 1, "tokens_per_point": 64}
"""`--quick`: two points, one try each (a test of the chain, ~6 s of which ~5 s are imports and the model load)."""


def fit_line(points: dict[int, float]) -> tuple[float, float]:
    """(base, slope) of the least-squares line through {requests in flight: seconds per token};
    the slope is clamped at 0 (a cost that falls with concurrency is noise, not a model)."""
    if len(points) < 2:
        raise ValueError(f"engine sweep: a line needs >= 2 concurrencies, got {sorted(points)}")
    xs, ys = list(points), list(points.values())
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    slope = max(0.0, slope)
    return my - slope * mx, slope


def sweep(concurrency: tuple[int, ...] = CONCURRENCY, repeats: int = REPEATS, tokens_per_point: int = 512) -> dict[int, float]:
    """{c: seconds per generated token of one request with c in flight} (a round's latency / its tokens)."""
    import asyncio
    import os
    import time

    from asyncrl.bench.rollout import Workload, make_prompts
    from asyncrl.data.tiny_model import ensure_tiny_model
    from asyncrl.engines.base import SamplingParams
    from asyncrl.engines.torch_engine import TorchRolloutServer

    path = ensure_tiny_model(os.path.expanduser("~/.cache/asyncrl/models"))
    prompts = make_prompts(Workload(prompts=max(concurrency), prompt_len=16, max_tokens=MAX_TOKENS))
    server = TorchRolloutServer(path, seed=0, threads=1, max_batch_size=max(512, max(concurrency)))

    async def rounds(c: int, n: int) -> None:
        for _ in range(n):
            params = [SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, seed=i) for i in range(c)]
            await asyncio.gather(*(server.generate(prompts[i], p) for i, p in enumerate(params)))

    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(rounds(max(concurrency), 2))  # warm-up: allocator, threads
        out = {}
        for c in concurrency:
            n = max(2, tokens_per_point // (c * MAX_TOKENS))
            best = float("inf")
            for _ in range(repeats):
                t = time.perf_counter()
                loop.run_until_complete(rounds(c, n))
                best = min(best, (time.perf_counter() - t) / n / MAX_TOKENS)
            out[c] = best
        loop.run_until_complete(server.close())
    finally:
        loop.close()
    return out


def run_sweep(quick: bool = False, timeout_s: float = 120.0) -> dict[int, float]:
    """`sweep()` (`quick`: with `QUICK`) in its own process; its points, keyed by requests in flight."""
    cmd = [sys.executable, "-m", "asyncrl.plan.engine_sweep", *(["--quick"] if quick else [])]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode:
        raise RuntimeError(f"engine sweep failed ({done.returncode}): {done.stderr[-2000:]}")
    return {int(k): float(v) for k, v in json.loads(done.stdout.strip().splitlines()[-1]).items()}


if __name__ == "__main__":
    print(json.dumps(sweep(**(QUICK if "--quick" in sys.argv[1:] else {}))))
