"""`asyncrl bench trainer --shape NAME`: peak memory of one micro-batch's log-prob/loss step, full vs chunked logits.

A Qwen2 with a published model's widths (`SHAPES`; `--layers` cuts its decoder layers) is built here with
random weights (nothing is downloaded) in `--dtype`. One micro-batch of `--tokens` tokens (`--rows` rows)
runs forward through the engine's own scoring (`scoring.Scorer.logprobs_and_entropy`, so the full-logits
branch and `packing.head_scores` are the code a trainer step runs), a policy-gradient loss (the token mean
of log-prob x a random advantage; `--entropy`: an entropy bonus too) and backward. Like a default train step it
computes the entropy (the adaptive control reads it); only with `--entropy` does it carry a gradient. Two variants:

- `full`: `trainer.logit_chunk_tokens=0` (the old default): the [rows, T, vocab] logits at once;
- `chunked`: `trainer.logit_chunk_tokens=--logit-chunk-tokens` (the default 1024): the head per chunk.

Each variant runs in its own fresh process, after a small warm-up step that also allocates the gradients.
Peak memory is what the step adds above what is held before it (model, gradients and runtime left out):
on CPU the peak RSS (VmHWM, reset through /proc/self/clear_refs after gc and malloc_trim) minus the RSS
just before; on `--device cuda` `torch.cuda.max_memory_allocated` minus the memory allocated before (not
run on the 2-core CPU machine the figures in docs come from: it has no GPU). `logits_fp32_mb` is the size
the full logits would have in fp32 (tokens x vocab x 4 bytes).

Reading the figures: `full` grows with tokens x vocab (about 5 fp32-logit sizes at its peak, the entropy
metric included); `chunked` with chunk x vocab plus one head-weight-sized gradient buffer. (Until
2026-12-07 each chunk was a `checkpoint` whose own head-weight gradient autograd summed, 3 weight-sized
gradients live at once: 2.2x the full logits' peak at 7B width and 512 tokens; the head's own backward,
`packing._ChunkedHead`, adds every chunk into one buffer: 0.98x there.)

`--check` compares the two variants (same seed, so the same weights and batch): the log-probs and the
gradients of the head weight and of the last layer's `mlp.down_proj` weight, max abs difference; in fp32
(its default dtype) both are expected below 1e-5. `--quick`: 1 layer, 512 tokens, chunks of 128, fp32
and `--check` (what is given explicitly still applies).

    asyncrl bench trainer --shape qwen2.5-7b --layers 2 [--tokens 4096] [--json]
    asyncrl bench trainer --shape qwen2.5-0.5b --quick
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, replace
from typing import Any

MIB = 2**20
ENTROPY_COEF = 0.01
DTYPES = {"bf16": "bfloat16", "fp32": "float32"}


@dataclass(frozen=True)
class Shape:
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int
    layers: int
    tied: bool


SHAPES = {  # Qwen2.5 configs as published (config.json); `tiny` is for tests: a big vocabulary for its width
    "qwen2.5-0.5b": Shape(hidden=896, intermediate=4864, heads=14, kv_heads=2, vocab=151936, layers=24, tied=True),
    "qwen2.5-1.5b": Shape(hidden=1536, intermediate=8960, heads=12, kv_heads=2, vocab=151936, layers=28, tied=True),
    "qwen2.5-7b": Shape(hidden=3584, intermediate=18944, heads=28, kv_heads=4, vocab=152064, layers=28, tied=False),
    "tiny": Shape(hidden=64, intermediate=128, heads=4, kv_heads=2, vocab=16384, layers=1, tied=False),
}


@dataclass(frozen=True)
class Case:
    """One variant's run, as the parent hands it to a fresh process."""

    shape: Shape
    layers: int
    rows: int
    tokens: int
    dtype: str
    device: str
    logit_chunk_tokens: int
    entropy: bool
    seed: int
    save_to: str | None
    """Where to write the log-probs and the compared gradients (`--check`); None: nothing written."""


def _model(case: Case):  # -> Qwen2ForCausalLM
    import torch

    from asyncrl.hf_imports import skip_unused_backends

    skip_unused_backends()
    from transformers import AutoModelForCausalLM, Qwen2Config

    s = case.shape
    config = Qwen2Config(vocab_size=s.vocab, hidden_size=s.hidden, intermediate_size=s.intermediate,
                         num_hidden_layers=case.layers, num_attention_heads=s.heads, num_key_value_heads=s.kv_heads,
                         tie_word_embeddings=s.tied, max_position_embeddings=max(4096, case.tokens // case.rows))
    torch.manual_seed(case.seed)
    # built in the measured dtype directly: a 7B-wide model never exists in fp32 here
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, case.dtype)).to(case.device)  # a Qwen2ForCausalLM
    return model.eval()  # no dropout, as the trainer scores


def _batch(case: Case, length: int):  # -> (TrainBatch, advantages [rows, length])
    import numpy as np
    import torch

    from asyncrl.trainer.batch import TrainBatch

    rng = np.random.default_rng(case.seed)
    prompt = min(16, length - 1)
    n = length - prompt
    rows = [{"prompt_ids": rng.integers(0, case.shape.vocab, prompt), "response_ids": rng.integers(0, case.shape.vocab, n),
             "behavior_logprobs": np.zeros(n, np.float32), "loss_mask": np.ones(n, np.float32),
             "token_versions": np.zeros(n, np.int64)} for _ in range(case.rows)]
    batch = TrainBatch.from_arrays(rows, [0.0] * case.rows, pad_id=0).to(case.device)
    adv = torch.from_numpy(rng.standard_normal((case.rows, length)).astype(np.float32)).to(case.device)
    return batch, adv


def _step(model, batch, adv, case: Case):  # -> [rows, T] log-probs
    """Forward through the engine's scoring (`scoring.Scorer`, what `TrainerEngine` runs), the loss, backward.
    A whole `TrainerEngine` would hold fp32 master weights under FSDP, which at 7B width do not fit the
    machine this runs on."""
    import torch

    from asyncrl.config import TrainerConfig
    from asyncrl.trainer.scoring import Scorer

    scorer = Scorer(TrainerConfig(logit_chunk_tokens=case.logit_chunk_tokens), temperature=1.0, device=torch.device(case.device))
    lp, ent = scorer.logprobs_and_entropy(model, batch, entropy=True, entropy_grad=case.entropy)
    mask = batch.loss_mask
    loss = -(lp * adv * mask).sum() / mask.sum()
    if case.entropy:
        loss = loss - ENTROPY_COEF * (ent * mask).sum() / mask.sum()
    loss.backward()
    return lp.detach()


def measure(case: Case) -> dict[str, Any]:
    """One variant in this (fresh) process: warm-up step, then the measured step's peak above the memory before it."""
    import torch

    from asyncrl.bench.rss import mark, peak_mib

    model = _model(case)
    _step(model, *_batch(case, 16), case)  # warm-up: allocates the gradients and lazy runtime state
    model.zero_grad(set_to_none=False)
    batch, adv = _batch(case, case.tokens // case.rows)
    cuda = case.device.startswith("cuda")
    before = mark(cuda)
    t0 = time.perf_counter()
    lp = _step(model, batch, adv, case)
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    peak = peak_mib(cuda) - before
    if case.save_to:
        head = model.get_output_embeddings().weight.grad
        down = model.model.layers[-1].mlp.down_proj.weight.grad
        grads = {"head": head.float().cpu(), "down_proj": down.float().cpu()}
        torch.save({"lp": lp.float().cpu(), "grads": grads}, case.save_to)
    return {"peak_step_mb": round(peak, 1), "before_step_mb": round(before, 1), "step_s": round(seconds, 2),
            "params": sum(p.numel() for p in model.parameters())}


def _in_fresh_process(case: Case) -> dict[str, Any]:
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(measure, case).result()


def _max_abs_diff(a: Any, b: Any) -> float:
    return float((a - b).abs().max())


def run(name: str, case: Case, check: bool) -> dict[str, Any]:
    """Both variants, each in a fresh process, and with `check` their log-probs and gradients compared."""
    variants = {"full": 0, "chunked": case.logit_chunk_tokens}
    logits_mb = round(case.tokens * case.shape.vocab * 4 / MIB, 1)
    rows, out = [], {}
    with tempfile.TemporaryDirectory(prefix="asyncrl-trainer-memory-") as tmp:
        for variant, chunk in variants.items():
            save_to = os.path.join(tmp, f"{variant}.pt") if check else None
            r = _in_fresh_process(replace(case, logit_chunk_tokens=chunk, save_to=save_to))
            rows.append({"variant": variant, "logit_chunk_tokens": chunk, **r, "logits_fp32_mb": logits_mb})
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)  # progress
        if check:
            import torch

            full, chunked = (torch.load(os.path.join(tmp, f"{n}.pt")) for n in variants)
            out["logprob_max_abs_diff"] = _max_abs_diff(full["lp"], chunked["lp"])
            out["grad_max_abs_diff"] = max(_max_abs_diff(full["grads"][k], chunked["grads"][k]) for k in full["grads"])
    return {"shape": name, "widths": asdict(case.shape), "layers": case.layers, "tokens": case.tokens,
            "rows_of_tokens": case.rows, "dtype": case.dtype, "device": case.device, "entropy_in_loss": case.entropy,
            "params": rows[0]["params"],
            "rows": rows, "peak_ratio_chunked_vs_full": round(rows[1]["peak_step_mb"] / rows[0]["peak_step_mb"], 3),
            "logprob_max_abs_diff": out.get("logprob_max_abs_diff"), "grad_max_abs_diff": out.get("grad_max_abs_diff"),
            "grads_compared": ["head weight", "last layer mlp.down_proj weight"] if check else [],
            "peak_memory": "cuda max_memory_allocated" if case.device.startswith("cuda") else
            "peak RSS (VmHWM, reset after gc + malloc_trim) during the step, above the RSS just before it"}


def parse(argv: list[str] | None) -> tuple[argparse.Namespace, Case]:
    p = argparse.ArgumentParser(prog="asyncrl bench trainer", description=__doc__.splitlines()[0])
    p.add_argument("--shape", required=True, choices=list(SHAPES), metavar="NAME",
                   help=f"the model's widths: {', '.join(SHAPES)}")
    p.add_argument("--layers", type=int, metavar="L", help="decoder layers (default: the model's own; --quick: 1)")
    p.add_argument("--tokens", type=int, metavar="N", help="tokens of the micro-batch (default 4096; --quick: 512)")
    p.add_argument("--rows", type=int, default=2, metavar="R", help="rows the tokens are split into (default 2)")
    p.add_argument("--dtype", choices=list(DTYPES), help="model dtype (default bf16; --check and --quick: fp32)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the step runs (default cpu)")
    p.add_argument("--logit-chunk-tokens", type=int, metavar="N",
                   help="trainer.logit_chunk_tokens of `chunked` (default 1024; --quick: 128)")
    p.add_argument("--entropy", action="store_true", help="an entropy bonus in the loss (the entropy then carries a gradient)")
    p.add_argument("--check", action="store_true", help="compare the variants' log-probs and gradients (1e-5 expected in fp32)")
    p.add_argument("--quick", action="store_true", help="1 layer, 512 tokens, chunks of 128, fp32, --check")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--seed", type=int, default=0, help="weights, tokens and advantages (default 0)")
    a = p.parse_args(argv)
    a.check = a.check or a.quick
    shape = SHAPES[a.shape]
    layers = a.layers if a.layers is not None else (1 if a.quick else shape.layers)
    tokens = a.tokens if a.tokens is not None else (512 if a.quick else 4096)
    chunk = a.logit_chunk_tokens if a.logit_chunk_tokens is not None else (128 if a.quick else 1024)
    dtype = DTYPES[a.dtype] if a.dtype else ("float32" if a.check else "bfloat16")
    if layers < 1:
        p.error(f"--layers: must be >= 1, got {layers}")
    if a.rows < 1 or tokens % a.rows or tokens // a.rows < 2:
        p.error(f"--tokens: must split into --rows={a.rows} rows of at least 2 tokens, got {tokens}")
    if chunk < 1:
        p.error(f"--logit-chunk-tokens: must be >= 1 (the `full` variant is the 0), got {chunk}")
    return a, Case(shape=shape, layers=layers, rows=a.rows, tokens=tokens, dtype=dtype, device=a.device,
                   logit_chunk_tokens=chunk, entropy=a.entropy, seed=a.seed, save_to=None)


def main(argv: list[str] | None = None) -> int:
    args, case = parse(argv)
    t0 = time.perf_counter()
    res = run(args.shape, case, args.check)
    res["wall_s"] = round(time.perf_counter() - t0, 1)
    if args.json:
        print(json.dumps(res, indent=1))
        return 0
    print(f"{args.shape}: {case.layers} layer(s), {res['params'] / 1e6:.0f}M params, {case.tokens} tokens ({case.rows} rows), "
          f"{case.dtype} on {case.device}, entropy in loss: {case.entropy} ({res['wall_s']} s)")
    print(f"{'variant':<9}{'chunk':>7}{'peak step MiB':>15}{'before MiB':>12}{'step s':>8}{'fp32 logits MiB':>17}")
    for r in res["rows"]:
        print(f"{r['variant']:<9}{r['logit_chunk_tokens']:>7}{r['peak_step_mb']:>15}{r['before_step_mb']:>12}{r['step_s']:>8}"
              f"{r['logits_fp32_mb']:>17}")
    print(f"peak chunked / full: {res['peak_ratio_chunked_vs_full']}; peak = {res['peak_memory']}")
    if args.check:
        print(f"max abs diff: log-probs {res['logprob_max_abs_diff']:.3g}, gradients ({', '.join(res['grads_compared'])}) "
              f"{res['grad_max_abs_diff']:.3g} (1e-5 expected in fp32)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
