"""`asyncrl bench trainer --speed`: what each trainer speed switch buys one step, and that it keeps the step's loss.

A Qwen2 of `--model`'s widths (`tiny`, a few M parameters for CPU; Qwen2.5 `0.5b`, `1.5b`; `7b-cut`: 7B's
widths with `--layers` decoder layers, default 4, so it fits one GPU) is built here with random weights, saved
in bf16 to a temporary folder, and trained by the real `TrainerEngine` (FSDP2 on one rank) on one long-tail batch
(16 rows of 512-2048 real tokens on CUDA, 32-256 on CPU). Cases, one after the other in this process:

- `baseline`: packing, token-budget micro-batches, chunked logits, `trainer.attn_implementation=sdpa`,
  `grad_reduce=micro_batch`, `optimizer_impl=foreach`, `compile=false`, `proximal_forward=always`,
  `minibatches=2`, and `algorithm.correction=decoupled_ppo` with recomputed proximal log-probs (so the
  proximal pass exists);
- each switch alone on top of it (`SWITCHES`), then `all`: every switch that ran (the later attention kernel
  of `SWITCHES` wins where both ran).

A switch that cannot run here is reported skipped with the reason (flex_attention on CPU: torch has no
backward for it; flash_attention_2 without CUDA or the flash-attn package; compile without a C++ compiler on
CPU, under TORCH_COMPILE_DISABLE, in `--quick` unless named in `--switches`, or where compiling fails).

Each case builds its engine, takes one warm-up `train_step` (kernels, optimizer state, compilation), then
`--steps` timed steps on the same batch; `step_s` is their median (a step stalled by another process on a
shared host weighs less than in a mean). `tokens_per_s` counts real tokens; `mfu` is model FLOPs
(`model_flops_per_token`: training FLOPs only, so a proximal pass saved shows up as MFU gained) per second over
the device's nominal dense bf16 peak (CUDA only), `mfu_of_measured_gemm` over a large matmul's FLOP/s measured
in the same run (bf16 on CUDA, fp32 on CPU). `max_abs_loss_diff_vs_baseline`: the same weights, batch and seed
give every switch the baseline's losses (warm-up and timed steps): to 1e-5 in fp32 (CPU), 1e-2 in bf16 (CUDA:
other kernels round differently). `peak_memory_mib`: what the case adds above what was held before it
(CUDA `max_memory_allocated`; CPU peak RSS, `rss.py`).

    asyncrl bench trainer --speed [--device cpu|cuda] [--model tiny|0.5b|1.5b|7b-cut] [--layers L]
                                  [--steps N] [--switches a,b,...] [--json] [--quick]
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from typing import Any

from asyncrl.bench.trainer_memory import SHAPES, Shape

MODELS = {
    "tiny": Shape(hidden=256, intermediate=768, heads=4, kv_heads=2, vocab=8192, layers=4, tied=False),
    "0.5b": SHAPES["qwen2.5-0.5b"],
    "1.5b": SHAPES["qwen2.5-1.5b"],
    "7b-cut": replace(SHAPES["qwen2.5-7b"], layers=4),
}
BASELINE: dict[str, Any] = dict(packing=True, attn_implementation="sdpa", grad_reduce="micro_batch", optimizer_impl="foreach",
                                compile=False, proximal_forward="always", minibatches=2)
SWITCHES: dict[str, dict[str, Any]] = {
    "flex_attention": {"attn_implementation": "flex_attention"},
    "flash_attention_2": {"attn_implementation": "flash_attention_2"},
    "grad_reduce_mini_batch": {"grad_reduce": "mini_batch"},
    "fused_adamw": {"optimizer_impl": "fused"},
    "compile": {"compile": True},
    "proximal_reuse": {"proximal_forward": "auto"},
}
PEAK_BF16 = (("H200", 989e12), ("H100 NVL", 835e12), ("H100 PCIe", 756e12), ("H100", 989e12), ("A100", 312e12))
"""Nominal dense bf16 tensor-core peaks by device name (the first that `get_device_name` contains)."""
TOLERANCE = {"float32": 1e-5, "bfloat16": 1e-2}


@dataclass(frozen=True)
class Load:
    rows: int
    min_len: int
    max_len: int
    token_budget: int
    """`trainer.max_tokens_per_micro_batch`: several micro-batches per mini-batch, so `grad_reduce` matters."""
    logit_chunk_tokens: int

    def lengths(self) -> list[int]:
        """Spread evenly over [min_len, max_len] in a fixed shuffled order (golden-ratio steps), the first the longest."""
        return [self.max_len] + [self.min_len + int((self.max_len - self.min_len) * (i * 0.618034 % 1)) for i in range(1, self.rows)]


LOADS = {"cuda": Load(16, 512, 2048, 4096, 4096), "cpu": Load(16, 32, 256, 512, 1024), "quick": Load(8, 16, 64, 256, 1024)}


def model_flops_per_token(*, hidden: int, intermediate: int, heads: int, kv_heads: int, vocab: int, layers: int,
                          seq_len: int) -> int:
    """Training FLOPs (forward + backward) per token of a sequence of `seq_len` tokens: 6 x the matmul parameters
    (q, o: hidden^2 each; k, v: hidden x kv width each; gate, up, down: hidden x intermediate each; per layer, plus
    the LM head, tied or not) + causal attention, 2 x 2 x layers x hidden x seq_len / 2 forward (QK^T and AV over
    half the positions on average), x 3 with backward. Packing attends within each sequence: use its own length.

    >>> model_flops_per_token(hidden=4, intermediate=8, heads=2, kv_heads=1, vocab=10, layers=1, seq_len=3)
    1176
    """
    kv = hidden // heads * kv_heads
    per_layer = 2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * intermediate
    return 6 * (layers * per_layer + hidden * vocab) + 6 * layers * hidden * seq_len


def step_flops(shape: Shape, layers: int, lengths: list[int]) -> int:
    """Model FLOPs of one training step over sequences of `lengths` tokens."""
    w = dict(hidden=shape.hidden, intermediate=shape.intermediate, heads=shape.heads, kv_heads=shape.kv_heads, vocab=shape.vocab)
    return sum(n * model_flops_per_token(**w, layers=layers, seq_len=n) for n in lengths)


def gemm_flops(device: str, n: int, reps: int, rounds: int = 5) -> float:
    """A square matmul's achieved FLOP/s here (bf16 on CUDA, fp32 on CPU): what this device really gives a GEMM.
    The best of `rounds` rounds of `reps` matmuls: on a shared CPU one round can run at a tenth of the others."""
    import torch

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    a @ b
    _sync(device)
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(reps):
            a @ b
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 * reps / best


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def build_model(shape: Shape, layers: int, folder: str, device: str, seed: int = 0) -> str:
    """A Qwen2 of `shape`'s widths with random weights (seeded), saved in bf16; built on `device` (a 7B-wide
    model never exists in fp32 on the host)."""
    import torch

    from asyncrl.hf_imports import skip_unused_backends

    skip_unused_backends()
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                         num_hidden_layers=layers, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
                         tie_word_embeddings=shape.tied, max_position_embeddings=4096, rope_theta=1e6, pad_token_id=0)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder, safe_serialization=True)
    del model
    return folder


def long_tail(lengths: list[int], vocab: int, seed: int = 0):  # -> TrainBatch
    """Rows of `lengths` tokens (a quarter prompt), random tokens and advantages; behavior log-probs near a random
    model's own (-ln vocab +- 0.5), so the decoupled correction's weights are about 1 and the loss is not ~0."""
    import numpy as np

    from asyncrl.trainer.batch import TrainBatch

    rng = np.random.default_rng(seed)
    rows = []
    for n in lengths:
        p = max(1, n // 4)
        r = n - p
        behav = (-np.log(vocab) + rng.uniform(-0.5, 0.5, r)).astype(np.float32)
        rows.append({"prompt_ids": rng.integers(4, vocab, p), "response_ids": rng.integers(4, vocab, r), "behavior_logprobs": behav,
                     "loss_mask": np.ones(r, np.float32), "token_versions": np.zeros(r, dtype=np.int64)})
    return TrainBatch.from_arrays(rows, rng.normal(size=len(rows)).tolist(), pad_id=0)


def cannot_run(switch: str, device: str, quick: bool, named: bool) -> str | None:
    """Why `switch` cannot run here, or None."""
    from asyncrl.trainer.setup import compile_disabled

    compile_off = compile_disabled()
    if switch == "flex_attention" and device == "cpu":
        return "torch's flex_attention has no backward on CPU (forward only)"
    if switch == "flex_attention" and compile_off:
        return "TORCH_COMPILE_DISABLE is set: flex attention needs torch.compile"
    if switch == "flash_attention_2" and device != "cuda":
        return "flash_attention_2 needs CUDA"
    if switch == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
        return "the flash-attn package is not installed"
    if switch == "compile":
        if compile_off:
            return "TORCH_COMPILE_DISABLE is set: torch.compile would do nothing"
        if device == "cpu" and not (shutil.which("c++") or shutil.which("g++")):
            return "no C++ compiler on this host (inductor needs one on CPU)"
        if quick and not named:
            return "not in --quick (compiling takes longer than the rest); --switches compile runs it"
    return None


@dataclass(frozen=True)
class Run:
    device: str
    model: str
    layers: int
    steps: int
    load: Load
    switches: tuple[str, ...]
    named: bool
    """`--switches` was given (a switch skipped in `--quick` by default runs when named)."""
    quick: bool

    @property
    def dtype(self) -> str:
        return "bfloat16" if self.device == "cuda" else "float32"


def measure(run: Run, path: str, batch, overrides: dict[str, Any]) -> dict[str, Any]:
    """One case: its engine, a warm-up step, `run.steps` timed steps; losses of every step, peak memory."""
    from asyncrl.bench.rss import mark, peak_mib
    from asyncrl.config import AlgorithmConfig, TrainerConfig
    from asyncrl.trainer.corrections import Corrector
    from asyncrl.trainer.engine import TrainerEngine

    cuda = run.device == "cuda"
    before = mark(cuda)
    trainer = TrainerConfig(device=run.device, micro_batch_size=8, max_tokens_per_micro_batch=run.load.token_budget,
                            logit_chunk_tokens=run.load.logit_chunk_tokens, lr=1e-4, total_steps=10, **(BASELINE | overrides))
    algorithm = AlgorithmConfig(entropy_coef=0.0, entropy_target=0.0, correction="decoupled_ppo", proximal="recompute")
    assert Corrector(algorithm).needs_proximal, "the baseline's correction must need proximal log-probs"
    t0 = time.perf_counter()
    eng = TrainerEngine(path, trainer=trainer, algorithm=algorithm, dtype=run.dtype, seed=0)
    try:
        losses = [eng.train_step(batch)["loss"]]  # warm-up: optimizer state, kernels, compilation
        _sync(run.device)
        warm = time.perf_counter() - t0
        times = []
        for _ in range(run.steps):
            t0 = time.perf_counter()
            losses.append(eng.train_step(batch)["loss"])
            _sync(run.device)
            times.append(time.perf_counter() - t0)
        peak = peak_mib(cuda) - before
    finally:
        eng.close()
        del eng
        gc.collect()
    return {"config": overrides, "build_and_warmup_s": warm, "step_s": statistics.median(times), "step_times_s": times,
            "losses": losses, "loss": losses[1], "peak_memory_mib": peak}


def run_cases(run: Run, path: str, batch) -> dict[str, dict[str, Any]]:
    """`baseline`, each switch of `run.switches` (or why it is skipped), then `all` of those that ran."""
    cases = {"baseline": measure(run, path, batch, {})}
    ran: list[str] = []
    for switch in run.switches:
        why = cannot_run(switch, run.device, run.quick, run.named)
        if why:
            cases[switch] = {"skipped": why}
        else:
            try:
                cases[switch] = measure(run, path, batch, SWITCHES[switch])
                ran.append(switch)
            except Exception as e:  # compile only: a compiler failing here is reported as the other skips are
                if switch != "compile":
                    raise
                cases[switch] = {"skipped": f"compile failed: {type(e).__name__}: {' '.join(str(e).split())[:200]}"}
        print(json.dumps({switch: cases[switch]}), file=sys.stderr, flush=True)  # progress
    if len(ran) >= 2:
        cases["all"] = measure(run, path, batch, {k: v for s in ran for k, v in SWITCHES[s].items()}) | {"switches": ran}
    else:
        cases["all"] = {"skipped": f"{len(ran)} switch(es) ran: nothing to combine"}
    return cases


def bench(run: Run) -> dict[str, Any]:
    """The run's figures: the GEMM measured, every case, their rates against the model FLOPs and the baseline."""
    t0 = time.perf_counter()
    shape, lengths, tol = MODELS[run.model], run.load.lengths(), TOLERANCE[run.dtype]
    if run.device == "cuda":
        import torch

        name = torch.cuda.get_device_name()
        gemm, peak = gemm_flops("cuda", 8192, 10), next((f for key, f in PEAK_BF16 if key in name), None)
    else:
        name, peak, gemm = "cpu", None, gemm_flops("cpu", 512 if run.quick else 1024, 2)
    with tempfile.TemporaryDirectory(prefix="asyncrl-bench-speed-") as tmp:
        cases = run_cases(run, build_model(shape, run.layers, tmp, run.device), long_tail(lengths, shape.vocab))
    flops, tokens, base = step_flops(shape, run.layers, lengths), sum(lengths), cases["baseline"]
    ran = {k: c for k, c in cases.items() if "skipped" not in c}
    for c in ran.values():
        c["tokens_per_s"] = tokens / c["step_s"]
        c["mfu"] = flops / c["step_s"] / peak if peak else None
        c["mfu_of_measured_gemm"] = flops / c["step_s"] / gemm
        c["max_abs_loss_diff_vs_baseline"] = max(abs(a - b) for a, b in zip(c["losses"], base["losses"]))
        c["loss_matches_baseline"] = c["max_abs_loss_diff_vs_baseline"] <= tol
    return {"device": name, "model": run.model, "widths": asdict(shape) | {"layers": run.layers}, "dtype": run.dtype,
            "steps": run.steps, "lengths": {"rows": len(lengths), "min": min(lengths), "max": max(lengths), "tokens": tokens},
            "model_flops_per_step": flops, "peak_flops_nominal": peak, "gemm_flops_measured": gemm, "loss_tolerance": tol,
            "cases": cases, "speedup_vs_baseline": {k: base["step_s"] / c["step_s"] for k, c in ran.items()},
            "loss_matches_baseline": all(c["loss_matches_baseline"] for c in ran.values()), "wall_s": time.perf_counter() - t0}


def parse(argv: list[str] | None) -> tuple[Run, bool]:
    """The run `argv` asks for, and whether to print JSON."""
    p = argparse.ArgumentParser(prog="asyncrl bench trainer --speed", description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the steps run (default cpu: fp32; cuda: bf16)")
    p.add_argument("--model", choices=list(MODELS), help="the widths (default: tiny on cpu and with --quick, 0.5b on cuda)")
    p.add_argument("--layers", type=int, metavar="L", help="decoder layers (default: the model's own; 7b-cut 4; --quick 2)")
    p.add_argument("--steps", type=int, metavar="N", help="timed steps per case after the warm-up (default 3; --quick 1)")
    p.add_argument("--switches", metavar="a,b,...", help=f"the switches to try (default all: {','.join(SWITCHES)})")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--quick", action="store_true", help="tiny model of 2 layers, 8 rows of 16-64 tokens, 1 step, no compile (seconds)")
    a = p.parse_args(argv)
    model = a.model or ("tiny" if a.quick or a.device == "cpu" else "0.5b")
    layers = a.layers if a.layers is not None else (2 if a.quick and model == "tiny" else MODELS[model].layers)
    steps = a.steps if a.steps is not None else (1 if a.quick else 3)
    switches = tuple(s.strip() for s in a.switches.split(",") if s.strip()) if a.switches else tuple(SWITCHES)
    if unknown := [s for s in switches if s not in SWITCHES]:
        p.error(f"--switches: unknown {', '.join(unknown)} (known: {', '.join(SWITCHES)})")
    if layers < 1 or steps < 1:
        p.error(f"--layers and --steps: must be >= 1, got {layers} and {steps}")
    load = LOADS["quick" if a.quick else a.device]
    return Run(device=a.device, model=model, layers=layers, steps=steps, load=load, switches=switches,
               named=a.switches is not None, quick=a.quick), a.json


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def main(argv: list[str] | None = None) -> int:
    run, as_json = parse(argv)
    res = bench(run)
    if as_json:
        print(json.dumps(res, indent=1))
        return 0
    w, L = res["widths"], res["lengths"]
    peak = f"{res['peak_flops_nominal'] / 1e12:.0f} TFLOP/s nominal" if res["peak_flops_nominal"] else "no nominal peak"
    print(f"{res['device']} ({res['dtype']}), model {res['model']}: {w['layers']} layers, hidden {w['hidden']}, vocab {w['vocab']}; "
          f"{L['rows']} rows of {L['min']}-{L['max']} tokens ({L['tokens']} real); {res['steps']} timed step(s) per case")
    print(f"GEMM measured {res['gemm_flops_measured'] / 1e12:.3g} TFLOP/s; {peak}; wall {res['wall_s']:.0f} s")
    print(f"{'case':<24}{'tokens/s':>10}{'step s':>9}{'speedup':>9}{'MFU':>7}{'of GEMM':>9}{'peak MiB':>10}"
          f"{'loss':>12}{'|dloss|':>10}")
    for name, c in res["cases"].items():
        if "skipped" in c:
            print(f"{name:<24}skipped: {c['skipped']}")
            continue
        print(f"{name:<24}{c['tokens_per_s']:>10.0f}{c['step_s']:>9.3f}{res['speedup_vs_baseline'][name]:>8.2f}x{_pct(c['mfu']):>7}"
              f"{_pct(c['mfu_of_measured_gemm']):>9}{c['peak_memory_mib']:>10.0f}{c['loss']:>12.6f}"
              f"{c['max_abs_loss_diff_vs_baseline']:>10.1e}")
    print(f"losses {'match' if res['loss_matches_baseline'] else 'DO NOT match'} the baseline's within {res['loss_tolerance']:g} "
          f"({res['dtype']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
