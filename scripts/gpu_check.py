"""The checks `scripts/gpu_check.sh` runs, one per process: `python scripts/gpu_check.py CHECK WORKDIR`.

Each check prints one line, `PASS <name>  <figures>`, `SKIP <name>  <why>` (it needs CUDA and this
machine has none) or `FAIL <name>  <error>`, and exits 0 (PASS / SKIP) or 1. Written for a GPU machine
with torch, transformers, peft, safetensors and msgpack but no vLLM, no Ray and no network: every
model is built locally in WORKDIR (random init), the embedded pipeline runs in one process (torch
rollout engine, `local` weight plane, MLflow off).

Checks: imports, models (the tiny demo models; on CUDA also one of Qwen2.5-0.5B's shape), fsdp_step,
rollout, cuda_ipc (trainer -> server process, log-prob parity), packing, pipeline_demo,
pipeline_real, speed (`asyncrl bench trainer --speed` at three real shapes: each trainer speed switch's
tokens/s, MFU and loss against the baseline), throughput (tokens/s and model FLOPs utilisation at the real size).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
"""Where the checks run (the CUDA ones SKIP without CUDA; their code runs on any device)."""
IPC_BACKEND = "cuda_ipc"
PEAK_BF16_FLOPS = 989e12
"""H200 (and H100 SXM) dense bf16 tensor-core peak, the MFU denominator."""
REAL = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
            intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True, rope_theta=1e6,
            max_position_embeddings=4096)
"""Qwen2.5-0.5B's shape (its vocabulary size, tied head), random init."""
THROUGHPUT_LENGTHS = [512 + (i * 97) % 1537 for i in range(16)]
"""Rows of the throughput step: 512 to 2048 tokens, about 20k in all."""
TIMED_STEPS = 3
_NO_COMPILE = "flex_attention,flash_attention_2,grad_reduce_mini_batch,fused_adamw,proximal_reuse"
SPEED_RUNS = {"0.5b": "", "1.5b": _NO_COMPILE, "7b-cut": _NO_COMPILE}
"""`bench trainer --speed` per shape and its `--switches` ("": all): `compile` (tens of seconds of compiling per case)
at the smallest shape only, so the three fit the check's 240 s."""
SPEED_BUDGET_S = 225
"""The speed check's own deadline, or its limit from gpu_check.sh (GPU_CHECK_LIMIT_S) less 15 s, whichever is less:
its bench processes end before the check is killed (a killed check would leave one holding the GPU)."""
PROBE = [1] + [5 + (7 * j) % 90 for j in range(63)]
"""A fixed token sequence whose log-probs trainer and server must agree on (the parity check)."""


class Skip(Exception):
    """The check cannot run here (no CUDA)."""


def need_cuda() -> None:
    if not CUDA:
        raise Skip("no CUDA device")


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def tiny(work: Path, seed: int = 0) -> str:
    from asyncrl.data.tiny_model import TinyModelSpec, ensure_tiny_model

    return str(ensure_tiny_model(work / "models", TinyModelSpec(seed=seed)))


def real_size(work: Path) -> str:
    """A Qwen2 folder of Qwen2.5-0.5B's shape with the demo's character tokenizer (built once, bf16)."""
    path = work / "models" / "qwen2.5-0.5b-shape"
    if (path / "config.json").exists():
        return str(path)
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from asyncrl.data.tiny_model import BOS_ID, EOS_ID, PAD_ID, build_tokenizer

    config = Qwen2Config(**REAL, bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID, torch_dtype="bfloat16")
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    tmp = path.with_name(path.name + ".tmp")
    model.save_pretrained(tmp, safe_serialization=True)
    build_tokenizer().save_pretrained(tmp)
    tmp.rename(path)
    return str(path)


def engine(path: str, dtype: str = "float32", **trainer_kw):
    from asyncrl.config import AlgorithmConfig, TrainerConfig
    from asyncrl.trainer.engine import TrainerEngine

    kw = dict(device=DEVICE, micro_batch_size=8, minibatches=1, lr=1e-4, total_steps=10) | trainer_kw
    return TrainerEngine(path, trainer=TrainerConfig(**kw), algorithm=AlgorithmConfig(entropy_coef=0.0, entropy_target=0.0),
                         dtype=dtype)


def long_tail(lengths: list[int], vocab: int, seed: int = 0):
    """A batch of rows of `lengths` tokens (a quarter prompt), random tokens and advantages."""
    import numpy as np

    from asyncrl.trainer.batch import TrainBatch

    rng = np.random.default_rng(seed)
    rows = []
    for n in lengths:
        p = max(1, n // 4)
        r = n - p
        rows.append({"prompt_ids": rng.integers(4, vocab, p), "response_ids": rng.integers(4, vocab, r),
                     "behavior_logprobs": -rng.uniform(3.5, 5.5, r).astype(np.float32),
                     "loss_mask": np.ones(r, np.float32), "token_versions": np.zeros(r, dtype=np.int64)})
    return TrainBatch.from_arrays(rows, rng.normal(size=len(rows)).tolist(), pad_id=0)


# ---- the checks ----------------------------------------------------------------------------------

def check_imports(work: Path) -> str:
    import transformers

    import asyncrl.cli  # noqa: F401
    import asyncrl.controller  # noqa: F401
    import asyncrl.launch  # noqa: F401
    import asyncrl.engines.torch_engine  # noqa: F401
    import asyncrl.trainer.engine  # noqa: F401
    import checkpoint_engine  # noqa: F401
    import checkpoint_engine.backends.cuda_ipc  # noqa: F401
    import checkpoint_engine.backends.gloo_nccl  # noqa: F401
    import transfer_queue  # noqa: F401

    cuda = f"CUDA {torch.version.cuda}, {torch.cuda.get_device_name()}" if CUDA else "no CUDA"
    return f"torch {torch.__version__} ({cuda}), transformers {transformers.__version__}, python {sys.version.split()[0]}"


def check_models(work: Path) -> str:
    t0 = time.perf_counter()
    a, b = tiny(work, 0), tiny(work, 1)
    out = f"tiny demo models {Path(a).name}, {Path(b).name}"
    if CUDA:
        real_size(work)
        out += ", Qwen2.5-0.5B shape"
    else:
        out += " (the Qwen2.5-0.5B-shape model: CUDA only)"
    return out + f" in {time.perf_counter() - t0:.1f} s"


def check_fsdp_step(work: Path) -> str:
    """An FSDP2 step on CUDA, bf16 compute over fp32 masters: the weights move, positive-advantage tokens rise."""
    need_cuda()
    from asyncrl.trainer.synthetic import synthetic_batch

    eng = engine(tiny(work), dtype="bfloat16", micro_batch_size=4, lr=1e-3)
    try:
        batch = synthetic_batch(8, vocab_size=eng.model.config.vocab_size, seed=2)
        before = eng.compute_logprobs(batch)
        t0 = time.perf_counter()
        m = eng.train_step(batch.replace(old_logprobs=before * batch.loss_mask))
        sync()
        step_s = time.perf_counter() - t0
        after = eng.compute_logprobs(batch)
        pos = (batch.advantages > 0) & (batch.loss_mask > 0)
        rise = float((after - before)[pos].mean())
        params = dict(eng.iter_full_params(device=DEVICE))
        assert eng.device.type == DEVICE and m["grad_norm"] > 0 and abs(m["ratio_mean"] - 1) < 1e-2, m
        assert rise > 0, f"positive-advantage log-probs fell by {-rise:.3g}"
        assert all(t.device.type == DEVICE and t.dtype == torch.bfloat16 for t in params.values())
    finally:
        eng.close()
    return f"loss {m['loss']:.4f}, grad_norm {m['grad_norm']:.3f}, logprob rise {rise:.3g}, step {step_s:.2f} s"


def check_rollout(work: Path) -> str:
    """The torch rollout engine on CUDA: batched decoding; its per-token log-probs equal a teacher-forced forward."""
    need_cuda()
    from asyncrl.engines.base import SamplingParams
    from asyncrl.engines.torch_engine import TorchRolloutServer

    async def go():
        server = TorchRolloutServer(tiny(work), device=DEVICE, seed=0)
        try:
            prompts = [[1] + [10 + (i * 7 + j) % 80 for j in range(8 + i)] for i in range(8)]
            t0 = time.perf_counter()
            outs = await asyncio.gather(*(server.generate(p, SamplingParams(max_tokens=32, seed=i)) for i, p in enumerate(prompts)))
            wall = time.perf_counter() - t0
            gaps = []
            for p, o in zip(prompts, outs):
                if o.token_ids:
                    scored = await server.score(p + o.token_ids)
                    gaps += [abs(a - b) for a, b in zip(scored[len(p) - 1:], o.logprobs)]
            return outs, wall, max(gaps), next(server.model.parameters()).device
        finally:
            await server.close()

    outs, wall, gap, device = asyncio.run(go())
    tokens = sum(len(o.token_ids) for o in outs)
    assert device.type == DEVICE and tokens > 0
    assert gap < 1e-3, f"decode log-probs differ from a teacher-forced forward by {gap:.3g}"
    return f"{tokens} tokens for 8 requests in {wall:.2f} s on {device}; decode vs forward log-prob gap {gap:.2e}"


def check_cuda_ipc(work: Path) -> str:
    """A trainer (this process, FSDP2 on CUDA, weights of seed 1) publishes through CUDA IPC to a torch
    server in another process on the same GPU (weights of seed 0); the server's log-probs of a fixed
    sequence must then equal the trainer's."""
    need_cuda()
    from checkpoint_engine import Sender, WeightsConfig

    cfg = ipc_config(IPC_BACKEND, DEVICE)
    eng = engine(tiny(work, 1))
    sender = Sender(cfg)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    server = subprocess.Popen([sys.executable, __file__, "_ipc_server", str(work), sender.endpoint, IPC_BACKEND, DEVICE],
                              env=env, stdout=subprocess.PIPE, text=True)
    try:
        sender.wait_for(1, timeout_s=120)
        t0 = time.perf_counter()
        out = sender.publish(eng.iter_full_params(device=DEVICE), version=1)
        publish_s = time.perf_counter() - t0
        ref = eng.score_tokens(PROBE)
        line, _ = server.communicate(timeout=120)
    finally:
        if server.poll() is None:
            server.kill()
        sender.close()
        eng.close()
    assert server.returncode == 0, f"server process exited {server.returncode}"
    got = json.loads(line.strip().splitlines()[-1])
    gap = max(abs(a - b) for a, b in zip(got["after"], ref))
    before = max(abs(a - b) for a, b in zip(got["before"], ref))
    assert out.completed == ["server"] and not out.evicted, (out.completed, out.evicted)
    assert got["version"] == 1 and got["device"].startswith(DEVICE)
    assert before > 1e-2, f"the server's old weights already scored like the trainer's ({before:.3g}): nothing was checked"
    assert gap < 1e-3, f"server vs trainer log-prob gap {gap:.3g} after the publish"
    return (f"{out.bytes / 1e6:.1f} MB in {out.buckets} buckets, {publish_s:.2f} s; parity max |dlogp| {gap:.2e} "
            f"over {len(ref)} tokens (before the publish {before:.2f})")


def ipc_config(backend: str, device: str):
    from checkpoint_engine import WeightsConfig

    return WeightsConfig(backend=backend, device=device, bucket_size_mb=1, checksum=False, timeout_s=60)


def ipc_server(work: Path, endpoint: str, backend: str, device: str) -> None:
    """The server end of `check_cuda_ipc` (another process): load, score, print one JSON line."""
    from asyncrl.engines.torch_engine import TorchRolloutServer
    from checkpoint_engine import Receiver
    from checkpoint_engine.server_loop import apply_update

    cfg = ipc_config(backend, device)

    async def go():
        server = TorchRolloutServer(tiny(work, 0), device=device, seed=0)
        rx = Receiver(cfg, "server", endpoint=endpoint, confirm_loads=True)
        try:
            before = await server.score(PROBE)
            update = await asyncio.to_thread(rx.next_update, 120)
            await apply_update(server, update, "keep")
            after = await server.score(PROBE)
            return {"before": before, "after": after, "version": server.version,
                    "device": str(next(server.model.parameters()).device)}
        finally:
            rx.close()
            await server.close()

    print(json.dumps(asyncio.run(go())), flush=True)


def check_packing(work: Path) -> str:
    """Packed rows (position ids restarting per sequence, the attention kept inside each one) give the
    padded path's log-probs and loss on CUDA."""
    need_cuda()
    from asyncrl.data.tiny_model import vocab

    lengths = [300, 7, 64, 19, 150, 5, 96, 33]
    path = tiny(work)
    batch = long_tail(lengths, len(vocab()))
    out = {}
    for name, kw in {"padded": {}, "packed": {"packing": True, "max_tokens_per_micro_batch": 512}}.items():
        eng = engine(path, micro_batch_size=3, **kw)
        try:
            lp = eng.compute_logprobs(batch)
            m = eng.train_step(batch)
            out[name] = (lp, m["loss"], eng.model.config._attn_implementation)
        finally:
            eng.close()
    mask = batch.loss_mask > 0
    gap = float((out["padded"][0] - out["packed"][0])[mask].abs().max())
    loss_gap = abs(out["padded"][1] - out["packed"][1])
    assert gap < 1e-4 and loss_gap < 1e-4, f"packed vs padded: log-prob gap {gap:.3g}, loss gap {loss_gap:.3g}"
    return f"attention {out['packed'][2]}: max |dlogp| {gap:.2e}, |dloss| {loss_gap:.2e} over {sum(lengths)} tokens"


def _train(work: Path, name: str, overrides: list[str]) -> dict:
    from asyncrl.cli import main

    run_root = work / "runs"
    args = ["train", "trainer.prompts_per_step=4", "rollout.group_size=4", "data.eval_size=4", "trainer.eval_every=100",
            "trainer.save_every=0", "logging.mlflow=false", "logging.progress=false", f"logging.run_root={run_root}",
            f"logging.run_name={name}", f"model.cache_dir={work / 'models'}", *overrides]
    t0 = time.perf_counter()
    rc = main(args)
    wall = time.perf_counter() - t0
    assert rc == 0, f"asyncrl train exited {rc}"
    summary = json.loads((run_root / name / "summary.json").read_text())
    summary["wall"] = wall
    return summary


def check_pipeline_demo(work: Path) -> str:
    """The embedded demo (trainer on CUDA where there is one; torch rollout engine; local weight plane)."""
    steps = 3 if CUDA else 2
    s = _train(work, "demo", [f"trainer.total_steps={steps}", f"trainer.device={'cuda' if CUDA else 'cpu'}"])
    assert s["steps"] == steps and s["trained_samples"] == steps * 16 and not s["bad_steps"], s
    return (f"{s['steps']} steps ({s['mode']}, trainer on {'cuda' if CUDA else 'cpu'}), {s['trained_samples']} samples, "
            f"staleness mean {s['staleness_mean']}, {s['wall']:.1f} s")


def check_pipeline_real(work: Path) -> str:
    """The embedded pipeline on the Qwen2.5-0.5B-shape model, bf16, trainer on CUDA."""
    need_cuda()
    path = real_size(work)
    s = _train(work, "real", ["trainer.total_steps=2", f"trainer.device={DEVICE}", f"model.path={path}", "model.dtype=bfloat16",
                              "trainer.micro_batch_size=16", "trainer.minibatches=1"])
    assert s["steps"] == 2 and s["trained_samples"] == 32 and not s["bad_steps"], s
    return f"2 steps ({s['mode']}), {s['trained_samples']} samples, {s['wall']:.1f} s"


def check_speed(work: Path) -> str:
    """`asyncrl bench trainer --speed --device cuda --steps 2` at the 0.5B, 1.5B and 7B-cut shapes, each in its own
    process without TORCH_COMPILE_DISABLE (flex_attention and `compile` need torch.compile): one line per case and
    shape with tokens/s and MFU; PASS when every case that ran gave the baseline's losses (bf16 tolerance)."""
    need_cuda()
    env = {k: v for k, v in os.environ.items() if k != "TORCH_COMPILE_DISABLE"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    budget = min(SPEED_BUDGET_S, float(os.environ.get("GPU_CHECK_LIMIT_S", SPEED_BUDGET_S + 15)) - 15)
    deadline, summary, off = time.monotonic() + budget, [], []
    for model, switches in SPEED_RUNS.items():
        cmd = [sys.executable, "-m", "asyncrl.cli", "bench", "trainer", "--speed", "--device", "cuda", "--model", model,
               "--steps", "2", "--json"] + (["--switches", switches] if switches else [])
        left = deadline - time.monotonic()
        if left < 30:
            summary.append(f"{model}: not run (the check's {budget:.0f} s are spent)")
            continue
        proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=left)
        sys.stderr.write(proc.stderr[-4000:])
        assert proc.returncode == 0, f"{model}: bench trainer --speed exited {proc.returncode}: {proc.stderr.strip()[-300:]}"
        res = json.loads(proc.stdout)
        for name, c in res["cases"].items():
            if "skipped" in c:
                print(f"  {model:<7}{name:<24}skipped: {c['skipped']}", flush=True)
                continue
            mfu = f"{100 * c['mfu']:.1f}%" if c["mfu"] is not None else "-"
            print(f"  {model:<7}{name:<24}{c['tokens_per_s']:>9,.0f} tokens/s  MFU {mfu} ({100 * c['mfu_of_measured_gemm']:.1f}% "
                  f"of the GEMM)  x{res['speedup_vs_baseline'][name]:.2f}  |dloss| {c['max_abs_loss_diff_vs_baseline']:.1e}", flush=True)
        off += [f"{model} {n}" for n, c in res["cases"].items() if "skipped" not in c and not c["loss_matches_baseline"]]
        best = max((n for n in res["speedup_vs_baseline"] if n != "baseline"), key=res["speedup_vs_baseline"].get, default="-")
        base = res["cases"]["baseline"]
        base_mfu = f"{100 * base['mfu']:.0f}%" if base["mfu"] is not None else "-"
        summary.append(f"{model}: baseline {base['tokens_per_s']:,.0f} tokens/s MFU {base_mfu}, "
                       f"best {best} x{res['speedup_vs_baseline'].get(best, 1):.2f}")
    assert not off, f"loss differs from the baseline's beyond the bf16 tolerance: {', '.join(off)}"
    return "; ".join(summary) + " (per case: the log)"


def check_throughput(work: Path) -> str:
    """Tokens/s of a trainer step (FSDP2, bf16 over fp32 masters, packed; 16 rows of 512-2048 real tokens; the
    mean of 3 steps after a warm-up) at Qwen2.5-0.5B's shape, and its model FLOPs utilisation: tokens/s x model
    FLOPs per token / 989 TFLOPS, the model FLOPs being forward + backward of the matmuls (6 x their parameters:
    layers and LM head) plus causal attention (6 x layers x hidden x the row's length, per token)."""
    need_cuda()
    lengths = THROUGHPUT_LENGTHS
    eng = engine(real_size(work), dtype="bfloat16", micro_batch_size=4, packing=True, max_tokens_per_micro_batch=8192,
                 logit_chunk_tokens=4096)
    try:
        batch = long_tail(lengths, REAL["vocab_size"])
        eng.train_step(batch)  # warm-up: optimizer state, kernels
        sync()
        t0 = time.perf_counter()
        for _ in range(TIMED_STEPS):
            eng.train_step(batch)
        sync()
        step_s = (time.perf_counter() - t0) / TIMED_STEPS
        mem = torch.cuda.max_memory_allocated() / 2**30 if DEVICE == "cuda" else 0.0
    finally:
        eng.close()
    from asyncrl.bench.trainer_speed import model_flops_per_token

    widths = dict(hidden=REAL["hidden_size"], intermediate=REAL["intermediate_size"], heads=REAL["num_attention_heads"],
                  kv_heads=REAL["num_key_value_heads"], vocab=REAL["vocab_size"], layers=REAL["num_hidden_layers"])
    tokens = sum(lengths)
    flops = sum(n * model_flops_per_token(**widths, seq_len=n) for n in lengths)
    mfu = flops / step_s / PEAK_BF16_FLOPS
    assert step_s > 0 and mfu > 0
    return (f"{tokens / step_s:,.0f} tokens/s ({tokens} tokens, step {step_s:.3f} s), MFU {100 * mfu:.1f}% of 989 TFLOPS "
            f"({flops / step_s / 1e12:.0f} TFLOPS achieved), peak memory {mem:.1f} GiB")


CHECKS = {"imports": check_imports, "models": check_models, "fsdp_step": check_fsdp_step, "rollout": check_rollout,
          "cuda_ipc": check_cuda_ipc, "packing": check_packing, "pipeline_demo": check_pipeline_demo,
          "pipeline_real": check_pipeline_real, "speed": check_speed, "throughput": check_throughput}


def main(argv: list[str]) -> int:
    if argv[0] == "_ipc_server":
        ipc_server(Path(argv[1]), *argv[2:5])
        return 0
    name, work = argv[0], Path(argv[1])
    work.mkdir(parents=True, exist_ok=True)
    try:
        detail = CHECKS[name](work)
    except Skip as e:
        print(f"SKIP {name}  {e}", flush=True)
        return 0
    except BaseException as e:  # one line for the summary; the traceback above it for the reader
        traceback.print_exc(file=sys.stderr)
        msg = " ".join(str(e).split()) or type(e).__name__
        print(f"FAIL {name}  {type(e).__name__}: {msg[:300]}", flush=True)
        return 1
    print(f"PASS {name}  {detail}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
