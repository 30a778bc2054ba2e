"""`asyncrl bench trainer`: what a long-tail batch costs one trainer step, padded against packed.

One Qwen2 of about 20M parameters built locally (random init, `data/tiny_model.py`), one batch
whose lengths run from 32 to 2048 tokens (log-normal, mean about 300), fp32 on CPU, through the
real `TrainerEngine.train_step` (FSDP2 on one gloo rank). Three cases, one after the other:

- `padded`: the plain path, `trainer.micro_batch_size` rows per micro-batch padded to the longest, full logits;
- `packed`: `trainer.packing` + token-budget micro-batches (`trainer.max_tokens_per_micro_batch`
  = the longest sequence) + chunked log-probs (`trainer.logit_chunk_tokens`);
- `checkpointing`: `packed` + `trainer.gradient_checkpointing`.

Each case takes two steps on the batch: the first gives the loss and the full gradients (captured
before the optimizer applies them; `max_abs_loss_diff` / `max_abs_grad_diff` compare `padded` and
`packed`), the second is measured. Trained tokens/s counts real (unpadded) tokens over its wall
time. Peak memory is the peak RSS (VmHWM, reset through /proc/self/clear_refs after gc and
malloc_trim, Linux) during that step above the RSS just before it: what the step itself adds, the
model, optimizer state and runtime left out.

    asyncrl bench trainer [--json] [--quick]

`--shape NAME` runs another bench instead (`trainer_memory.py`): one micro-batch's log-prob/loss step at a
published model's width, full against chunked logits, peak memory (`asyncrl bench trainer --shape NAME --help`).
`--speed` too (`trainer_speed.py`): tokens/s, MFU and loss of a step with each trainer speed switch against a
baseline (`asyncrl bench trainer --speed --help`).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from asyncrl.bench.rss import peak_rss_mib, settle

if TYPE_CHECKING:
    import torch

PEAK_MEMORY = ("peak RSS (VmHWM, reset through /proc/self/clear_refs after gc + malloc_trim) during the timed step, "
               "above the RSS just before it")
TARGETS = {"packed_vs_padded_tokens_per_s": 1.5, "packed_vs_padded_peak_memory": 0.7, "max_abs_loss_diff": 1e-5,
           "max_abs_grad_diff": 1e-5}


@dataclass(frozen=True)
class Size:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    rows: int
    min_len: int
    max_len: int
    median_len: int
    micro_batch_size: int


SIZES = {
    "full": Size(hidden=384, layers=9, heads=8, kv_heads=2, intermediate=1536, rows=16, min_len=32, max_len=2048,
                 median_len=170, micro_batch_size=4),
    "quick": Size(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=256, rows=8, min_len=8, max_len=256,
                  median_len=24, micro_batch_size=4),
}


def cases(size: Size) -> dict[str, dict[str, object]]:
    packed = {"packing": True, "max_tokens_per_micro_batch": size.max_len, "logit_chunk_tokens": 1024}
    # `padded` is the path before packing and token budgets: full logits too (`logit_chunk_tokens` is on by default now)
    return {"padded": {"logit_chunk_tokens": 0}, "packed": packed, "checkpointing": packed | {"gradient_checkpointing": True}}


def lengths(size: Size, seed: int = 0) -> list[int]:
    """Log-normal lengths clipped to [min_len, max_len]; the longest row is exactly max_len (the tail)."""
    rng = np.random.default_rng(seed)
    out = np.clip(np.exp(rng.normal(np.log(size.median_len), 1.0, size.rows)), size.min_len, size.max_len).astype(int)
    out[rng.integers(size.rows)] = size.max_len
    return out.tolist()


def long_tail_batch(size: Size, vocab: int, seed: int = 0):  # -> TrainBatch
    from asyncrl.trainer.batch import TrainBatch

    rng = np.random.default_rng(seed + 1)
    rows = []
    for n in lengths(size, seed):
        p = max(1, n // 8)
        r = n - p
        rows.append({"prompt_ids": rng.integers(4, vocab, p), "response_ids": rng.integers(4, vocab, r),
                     "behavior_logprobs": -rng.uniform(3.5, 5.5, r).astype(np.float32), "loss_mask": np.ones(r, np.float32),
                     "token_versions": np.zeros(r, dtype=np.int64)})
    return TrainBatch.from_arrays(rows, rng.normal(size=len(rows)).tolist(), pad_id=0)


def model_spec(size: Size):  # -> TinyModelSpec
    from asyncrl.data.tiny_model import TinyModelSpec

    return TinyModelSpec(hidden_size=size.hidden, num_layers=size.layers, num_heads=size.heads, num_kv_heads=size.kv_heads,
                         intermediate_size=size.intermediate, max_position_embeddings=max(size.max_len, 512))


def measure(size: Size, case: str, model_path: str) -> tuple[dict[str, object], dict[str, "torch.Tensor"]]:
    """One case: a first train_step gives the loss and the full gradients (captured before the optimizer
    applies them); a second one, timed, gives tokens/s and the peak memory it added."""
    import torch

    from asyncrl.config import AlgorithmConfig, TrainerConfig
    from asyncrl.data.tiny_model import vocab
    from asyncrl.trainer.engine import TrainerEngine
    from asyncrl.trainer.synthetic import full_grads

    batch = long_tail_batch(size, len(vocab()))
    trainer = TrainerConfig(micro_batch_size=size.micro_batch_size, minibatches=1, total_steps=10, device="cpu",
                            **cases(size)[case])  # type: ignore[arg-type]
    engine = TrainerEngine(model_path, trainer=trainer, algorithm=AlgorithmConfig(entropy_coef=0.0))
    grads: dict[str, torch.Tensor] = {}
    real_step = engine.optimizer_step

    def capture(end_of_step: bool = True) -> dict[str, float]:
        if not grads:
            grads.update(full_grads(engine))
        return real_step(end_of_step)

    engine.optimizer_step = capture  # type: ignore[method-assign]
    try:
        first = engine.train_step(batch)  # also allocates the optimizer state and warms FSDP up
        rss0 = settle()
        t0 = time.perf_counter()
        engine.train_step(batch)
        wall = time.perf_counter() - t0
        peak = peak_rss_mib() - rss0
    finally:
        engine.close()
        del engine
    tokens = float(batch.attention_mask.sum())
    return {"case": case, "config": cases(size)[case], "loss": first["loss"], "step_s": wall, "tokens": tokens,
            "tokens_per_s": tokens / wall, "peak_memory_mib": peak, "rss_before_step_mib": rss0,
            "params": sum(g.numel() for g in grads.values())}, grads


def run(size_name: str) -> dict[str, object]:
    from asyncrl.data.tiny_model import ensure_tiny_model

    size = SIZES[size_name]
    t0 = time.perf_counter()
    rows, grads = {}, {}
    with tempfile.TemporaryDirectory(prefix="asyncrl-bench-trainer-") as tmp:
        path = str(ensure_tiny_model(tmp, model_spec(size)))
        for case in cases(size):
            rows[case], g = measure(size, case, path)
            if case != "checkpointing":
                grads[case] = g
            del g
            print(json.dumps(rows[case]), file=sys.stderr, flush=True)  # progress
    pad, pack, ckpt = rows["padded"], rows["packed"], rows["checkpointing"]
    lens = lengths(size)
    out = {
        "packed_vs_padded_tokens_per_s": pack["tokens_per_s"] / pad["tokens_per_s"],
        "packed_vs_padded_peak_memory": pack["peak_memory_mib"] / pad["peak_memory_mib"],
        "checkpointing_peak_memory_ratio": ckpt["peak_memory_mib"] / pack["peak_memory_mib"],
        "max_abs_loss_diff": abs(pack["loss"] - pad["loss"]),
        "max_abs_grad_diff": max(float((grads["padded"][k] - grads["packed"][k]).abs().max()) for k in grads["padded"]),
        "peak_memory": PEAK_MEMORY,
        "model_params": pad["params"], "lengths": {"rows": len(lens), "min": min(lens), "max": max(lens), "mean": sum(lens) / len(lens)},
        "cases": rows, "targets": TARGETS, "size": size_name, "wall_s": time.perf_counter() - t0,
    }
    out["verdicts"] = {
        "packed_vs_padded_tokens_per_s": out["packed_vs_padded_tokens_per_s"] >= TARGETS["packed_vs_padded_tokens_per_s"],
        "packed_vs_padded_peak_memory": out["packed_vs_padded_peak_memory"] <= TARGETS["packed_vs_padded_peak_memory"],
        "max_abs_loss_diff": out["max_abs_loss_diff"] <= TARGETS["max_abs_loss_diff"],
        "max_abs_grad_diff": out["max_abs_grad_diff"] <= TARGETS["max_abs_grad_diff"],
    }
    return out


def main(argv: list[str] | None = None) -> int:
    from asyncrl.bench import trainer_memory, trainer_speed

    argv = sys.argv[1:] if argv is None else argv
    if "--speed" in argv:
        return trainer_speed.main([a for a in argv if a != "--speed"])
    if any(a == "--shape" or a.startswith("--shape=") for a in argv):
        return trainer_memory.main(argv)
    p = argparse.ArgumentParser(prog="asyncrl bench trainer", description=__doc__.splitlines()[0])
    p.add_argument("--shape", metavar="NAME", help="instead: peak memory of one micro-batch's log-prob step at a model's "
                   f"width, full vs chunked logits ({', '.join(trainer_memory.SHAPES)}; --shape NAME --help: its options)")
    p.add_argument("--speed", action="store_true", help="instead: tokens/s, MFU and loss of a step per trainer speed "
                   "switch against a baseline (--speed --help: its options)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--quick", action="store_true", help="a ~0.1M-parameter model and lengths 8-256 (seconds)")
    args = p.parse_args(argv)
    result = run("quick" if args.quick else "full")
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    print(f"model {result['model_params'] / 1e6:.1f}M params, lengths {result['lengths']}")
    print(f"{'case':<14}{'tokens/s':>10}{'step s':>9}{'peak MiB':>10}  loss")
    for name, r in result["cases"].items():  # type: ignore[union-attr]
        print(f"{name:<14}{r['tokens_per_s']:>10.0f}{r['step_s']:>9.2f}{r['peak_memory_mib']:>10.0f}  {r['loss']:.6f}")
    for key, ok in result["verdicts"].items():  # type: ignore[union-attr]
        print(f"{key}: {result[key]:.3g} (target {TARGETS[key]}) {'ok' if ok else 'MISSED'}")
    print(f"checkpointing_peak_memory_ratio: {result['checkpointing_peak_memory_ratio']:.3g}; peak memory = {result['peak_memory']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
