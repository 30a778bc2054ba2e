"""`asyncrl bench rollout --fleet`: how rollout throughput scales with the number of servers.

One run starts a local Ray and one fleet of 1, 2 and 4 torch servers (Ray actors, one torch
thread and one CPU bundle each, one placement group per fleet), then sends each fleet the same workload through the
`Router`: N trajectories (prompts of random characters, up to M new tokens, temperature 1,
a fixed seed per request, so every fleet generates exactly the same tokens), all submitted at
once. Each server decodes at most `--batch` sequences together (its KV budget; 8 by default), so
one server works through N trajectories in waves and n servers share the waves: without that
bound a tiny model's decode step costs about the same for 8 or 64 rows and splitting the
requests would only shorten batches, not the number of steps. It reports trajectories/s and tokens/s per fleet size and the scaling efficiency
relative to one server measured in the same run: (rate_n / rate_1) / n. `--json` prints the
rows as JSON; `--quick` runs a small workload on 1 and 2 servers (a smoke test).

What bounds the numbers: each server decodes on one core; a host with fewer cores than
servers time-shares them, so efficiency falls once servers outnumber cores (the output says
how many cores this host has). Timings are wall clock after one warm-up pass, best of
`repeats` rounds that time the sizes in turn (a noisy neighbour then hits every size alike);
start-up (actor start, model load) is reported apart and not counted.
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

from asyncrl.bench.rollout import Workload, make_prompts


@dataclass
class FleetRow:
    servers: int
    trajectories: int = 0
    tokens: int = 0
    seconds: float = 0.0
    trajectories_per_s: float = 0.0
    tokens_per_s: float = 0.0
    speedup: float = 1.0
    """tokens/s relative to one server in this run."""
    efficiency: float = 1.0
    """speedup / servers."""
    startup_s: float = 0.0


async def bench_sizes(sizes: tuple[int, ...], path: Path, prompts: list[list[int]], w: Workload,
                      batch: int) -> list[FleetRow]:
    """One fleet of actor servers per size, all started first; one warm-up pass each, then
    `w.repeats` rounds that time every size in turn (interleaved, so a noisy neighbour hits all
    sizes alike); the best pass per size is kept."""
    from asyncrl.config import RolloutConfig
    from asyncrl.engines.base import SamplingParams
    from asyncrl.rollout.fleet_build import Fleet
    from asyncrl.rollout.router import Router

    params = [SamplingParams(temperature=1.0, max_tokens=w.max_tokens, seed=w.seed + i) for i in range(len(prompts))]
    fleets, rows = [], []
    for n in sizes:
        cfg = RolloutConfig(num_servers=n, torch_threads=1, cpus_per_server=1, max_batch_size=batch)
        t0 = time.perf_counter()
        fleets.append(await Fleet.spawn(f"bench-{n}", cfg, str(path), dtype="float32", seed=w.seed))
        rows.append(FleetRow(n, startup_s=time.perf_counter() - t0))

    async def once(router: Router) -> int:
        outs = await asyncio.gather(*(router.generate(p, s) for p, s in zip(prompts, params)))
        return sum(len(o.token_ids) for o in outs)

    routers = [Router(f.servers) for f in fleets]
    for router in routers:
        await once(router)
    for _ in range(w.repeats):
        for row, router in zip(rows, routers):
            t1 = time.perf_counter()
            tokens = await once(router)
            seconds = time.perf_counter() - t1
            if row.seconds == 0 or tokens / seconds > row.tokens_per_s:
                row.trajectories, row.tokens, row.seconds = len(prompts), tokens, seconds
                row.trajectories_per_s, row.tokens_per_s = len(prompts) / seconds, tokens / seconds
    await asyncio.gather(*(f.close() for f in fleets))
    return rows


def run(sizes: tuple[int, ...], w: Workload, batch: int = 8) -> list[FleetRow]:
    import ray

    from asyncrl.data.tiny_model import ensure_tiny_model

    path = ensure_tiny_model(Path(os.path.expanduser("~/.cache/asyncrl/models")))
    prompts = make_prompts(w)
    ray.init(num_cpus=sum(sizes), include_dashboard=False, log_to_driver=False)  # logical CPUs: one bundle per server
    try:
        rows = asyncio.run(bench_sizes(sizes, path, prompts, w, batch))
    finally:
        ray.shutdown()
    per_server = rows[0].tokens_per_s / rows[0].servers  # the first size is the reference (1 by default)
    for r in rows:
        r.speedup = r.tokens_per_s / rows[0].tokens_per_s
        r.efficiency = r.tokens_per_s / (per_server * r.servers)
    return rows


def _table(rows: list[FleetRow], w: Workload, batch: int) -> str:
    lines = [
        f"fleet scaling: {w.prompts} trajectories x up to {w.max_tokens} tokens, torch servers as Ray actors "
        f"(1 thread, at most {batch} sequences each)",
        f"host: {os.cpu_count()} cores; efficiency = (tokens/s of n servers / tokens/s of 1) / n",
        f"{'servers':>7} {'traj/s':>8} {'tokens/s':>9} {'speedup':>8} {'efficiency':>10} {'startup s':>9}",
    ]
    for r in rows:
        lines.append(f"{r.servers:>7} {r.trajectories_per_s:>8.2f} {r.tokens_per_s:>9.1f} {r.speedup:>8.2f} "
                     f"{r.efficiency:>10.2f} {r.startup_s:>9.1f}")
    cores = os.cpu_count() or 1
    if max(r.servers for r in rows) > cores:
        lines.append(f"note: more servers than the {cores} cores of this host: past {cores}, servers share cores and "
                     "efficiency falls by construction (the cores, not the router, bound it).")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="asyncrl bench rollout --fleet", description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print the rows as JSON")
    ap.add_argument("--quick", action="store_true", help="small workload on 1 and 2 servers (smoke test)")
    ap.add_argument("--sizes", default="", help="comma-separated fleet sizes (default 1,2,4)")
    ap.add_argument("--prompts", type=int, default=0, help="trajectories per pass")
    ap.add_argument("--max-tokens", type=int, default=0, help="most new tokens per trajectory")
    ap.add_argument("--batch", type=int, default=8, help="most sequences one server decodes together")
    args = ap.parse_args(argv)
    w = Workload(prompts=16, max_tokens=32, repeats=1) if args.quick else Workload(prompts=64, max_tokens=64, repeats=3)
    w.prompts = args.prompts or w.prompts
    w.max_tokens = args.max_tokens or w.max_tokens
    sizes = tuple(int(s) for s in args.sizes.split(",")) if args.sizes else ((1, 2) if args.quick else (1, 2, 4))
    rows = run(sizes, w, args.batch)
    if args.json:
        print(json.dumps({"workload": asdict(w), "max_batch_size": args.batch, "host_cores": os.cpu_count(), "rows": [asdict(r) for r in rows]}, indent=2))
    else:
        print(_table(rows, w, args.batch))
    return 0


if __name__ == "__main__":
    sys.exit(main())
