"""`asyncrl bench trainer-load`: a trainer rank's peak host memory while it loads its models, before and after.

A Qwen2 with Qwen2.5-7B's widths (hidden 3584, intermediate 18944, 28 heads, 4 KV heads, vocabulary
152064, untied head) cut to `--layers` decoder layers (1 by default: the old path's two ranks then
take about 20 of a 24 GiB machine, 2 layers would not fit), built here with random weights (nothing is
downloaded) and saved as bf16 safetensors (one file per layer, one for the embedding and the head, and
`model.safetensors.index.json`). Two gloo ranks (fresh processes, one pair per path) then load what a
`TrainerEngine` with `model.dtype=bfloat16` and a KL term loads: the policy (fp32 master weights) and the
reference. Two paths, in the same run:

- `new`: `load.load_sharded_model` (meta build, rank 0 alone reads, a bf16 reference);
- `old`: the code it replaced (`_old_load`): every rank `from_pretrained` in fp32, then `fully_shard`;
  the reference a second fp32 copy.

Per rank: the peak RSS (VmHWM) of the process, its RSS before the load (imports, process group), and the
target: the bytes of its own shards (the new layout) plus one decoder layer in fp32. The ratios are
(peak - RSS before the load) / target. `--quick`: one layer, small widths (seconds).

    asyncrl bench trainer-load [--json] [--quick] [--layers N]
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import tempfile
import time
from typing import Any

QWEN25_7B = {"hidden_size": 3584, "intermediate_size": 18944, "num_attention_heads": 28, "num_key_value_heads": 4,
             "vocab_size": 152064}
QUICK = {"hidden_size": 1024, "intermediate_size": 4096, "num_attention_heads": 16, "num_key_value_heads": 4, "vocab_size": 32000}
MIB = 2**20


def build(folder: str, widths: dict[str, int], layers: int, seed: int = 0) -> None:
    """A random Qwen2 of these widths and layers, saved as bf16 safetensors one layer per file (the parent
    never holds more than the embedding and head at once)."""
    import torch
    from safetensors.torch import save_file

    from asyncrl.hf_imports import skip_unused_backends

    skip_unused_backends()
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**widths, num_hidden_layers=layers, tie_word_embeddings=False, max_position_embeddings=4096)
    config.architectures = ["Qwen2ForCausalLM"]
    config.save_pretrained(folder)
    with torch.device("meta"):
        names = {n: p.shape for n, p in Qwen2ForCausalLM(config).named_parameters()}
    groups: dict[str, list[str]] = {}
    for n in names:
        group = ".".join(n.split(".")[:3]) if n.startswith("model.layers.") else "rest"
        groups.setdefault(group, []).append(n)
    gen = torch.Generator().manual_seed(seed)
    weight_map = {}
    for i, (group, keys) in enumerate(groups.items()):
        file = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {k: torch.ones(names[k], dtype=torch.bfloat16) if "norm" in k
                   else (torch.randn(names[k], generator=gen) * 0.02).to(torch.bfloat16) for k in keys}
        save_file(tensors, os.path.join(folder, file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(keys, file))
        del tensors
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)


def _old_load(path: str, device: Any, dtype: Any, trainable: bool) -> Any:
    """`load_sharded_model` as it was (no LoRA, no checkpointing): the full fp32 model on every rank, then sharded."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)
    model.eval()
    model.requires_grad_(trainable)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32) if dtype != torch.float32 else MixedPrecisionPolicy()
    layer_types = set(model._no_split_modules or [])
    for layer in [m for m in model.modules() if type(m).__name__ in layer_types]:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def _status_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        return int(next(x for x in f if x.startswith(field + ":")).split()[1]) / 1024


def _rank(rank: int, world: int, port: int, folder: str, path_kind: str, out: str) -> None:
    """One rank of one path: load the policy and the reference as a bf16 `TrainerEngine` with a KL term does."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    import torch

    from asyncrl.hf_imports import skip_unused_backends
    from asyncrl.trainer.load import load_sharded_model
    from asyncrl.trainer.setup import close_process_group, ensure_process_group

    skip_unused_backends()
    importlib.import_module("transformers")  # before the RSS baseline: the imports are not the load

    torch.set_num_threads(1)
    cpu = torch.device("cpu")
    ensure_process_group(cpu)
    before = _status_mib("VmRSS")
    load = load_sharded_model if path_kind == "new" else _old_load
    t0 = time.perf_counter()
    policy = load(folder, cpu, torch.bfloat16, trainable=True)
    ref = load(folder, cpu, torch.bfloat16, trainable=False)
    seconds = time.perf_counter() - t0
    peak = _status_mib("VmHWM")
    shard = sum(t.to_local().numel() * t.element_size() for m in (policy, ref) for t in m.parameters())
    layer = sum(p.numel() * 4 for p in policy.model.layers[0].parameters())  # full (DTensor) shapes, fp32
    with open(os.path.join(out, f"{path_kind}-{rank}.json"), "w") as f:
        json.dump({"peak_mib": peak, "before_mib": before, "shard_mib": shard / MIB, "layer_mib": layer / MIB, "load_s": seconds}, f)
    del policy, ref
    close_process_group()


def measure(folder: str, path_kind: str, out: str, world: int = 2) -> list[dict[str, float]]:
    """`world` fresh processes loading by `path_kind` ("new" or "old"); each rank's figures."""
    import torch.multiprocessing as mp

    from asyncrl.trainer.setup import free_port

    env = {"OMP_NUM_THREADS": "1"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        mp.start_processes(_rank, args=(world, free_port(), folder, path_kind, out), nprocs=world, start_method="spawn")
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    ranks = []
    for r in range(world):
        with open(os.path.join(out, f"{path_kind}-{r}.json")) as f:
            ranks.append(json.load(f))
    return ranks


def run(layers: int, quick: bool) -> dict[str, Any]:
    widths, layers = (QUICK, 1) if quick else (QWEN25_7B, layers)
    with tempfile.TemporaryDirectory(prefix="asyncrl-trainer-load-") as tmp:
        folder = os.path.join(tmp, "model")
        os.makedirs(folder)
        t0 = time.perf_counter()
        build(folder, widths, layers)
        build_s = time.perf_counter() - t0
        disk = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder) if f.endswith(".safetensors"))
        new, old = measure(folder, "new", tmp), measure(folder, "old", tmp)
    ranks = []
    for r, (n, o) in enumerate(zip(new, old)):
        target = n["shard_mib"] + n["layer_mib"]
        ranks.append({"rank": r, "peak_rss_mb_new": round(n["peak_mib"]), "peak_rss_mb_old": round(o["peak_mib"]),
                      "target_mb": round(target), "ratio_new_to_target": round((n["peak_mib"] - n["before_mib"]) / target, 2),
                      "ratio_old_to_target": round((o["peak_mib"] - o["before_mib"]) / target, 2),
                      "rss_before_load_mb_new": round(n["before_mib"]), "rss_before_load_mb_old": round(o["before_mib"]),
                      "shard_mb": round(n["shard_mib"]), "layer_mb": round(n["layer_mib"]),
                      "load_s_new": round(n["load_s"], 1), "load_s_old": round(o["load_s"], 1)})
    return {"model": {**widths, "layers": layers, "on_disk": "bf16", "disk_mb": round(disk / MIB)}, "ranks": ranks,
            "build_s": round(build_s, 1), "ratio": "(peak RSS - RSS before the load) / target"}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="asyncrl bench trainer-load", description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--quick", action="store_true", help="1 layer and small widths (seconds)")
    p.add_argument("--layers", type=int, default=1,
                   help="decoder layers of the 7B-wide model (default 1: the old path then peaks at about 10 GiB a rank)")
    args = p.parse_args(argv)
    started = time.time()
    res = run(args.layers, args.quick)
    res["bench_wall_s"] = round(time.time() - started, 1)
    if args.json:
        print(json.dumps(res, indent=1))
        return 0
    m = res["model"]
    print(f"Qwen2 hidden {m['hidden_size']}, vocab {m['vocab_size']}, {m['layers']} layer(s), {m['disk_mb']} MiB bf16 on disk; "
          f"2 gloo ranks, policy + reference, dtype bf16 ({res['bench_wall_s']} s)")
    print(f"{'rank':<6}{'peak new':>10}{'peak old':>10}{'target':>8}{'new/target':>12}{'old/target':>12}{'load s new/old':>16}   (MiB)")
    for r in res["ranks"]:
        print(f"{r['rank']:<6}{r['peak_rss_mb_new']:>10}{r['peak_rss_mb_old']:>10}{r['target_mb']:>8}{r['ratio_new_to_target']:>12}"
              f"{r['ratio_old_to_target']:>12}{r['load_s_new']:>9}/{r['load_s_old']}")
    print(f"target = the rank's shards ({res['ranks'][0]['shard_mb']} MiB) + one layer in fp32 ({res['ranks'][0]['layer_mb']} MiB); "
          f"ratio = {res['ratio']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
