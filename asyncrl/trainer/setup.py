"""Where a trainer rank runs: its device, its process group, its LR schedule (its model: `load.py`).

Plain torch.distributed, no Ray: used by `TrainerEngine` (engine.py) in
a unit test, under `torchrun` and inside a rank actor (`actor.py`).
"""

from __future__ import annotations

import datetime
import gc
import math
import os
import socket
from functools import partial
from typing import Any

import torch
import torch.distributed as dist


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pick_device(setting: str) -> torch.device:
    """`trainer.device` -> this rank's device (cuda:LOCAL_RANK on GPU)."""
    use_cuda = setting == "cuda" or (setting == "auto" and torch.cuda.is_available())
    if not use_cuda:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("trainer.device=cuda but this process sees no CUDA GPU "
                           f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}); use trainer.device=cpu or auto")
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    return dev


PG_KEY_ENV = "ASYNCRL_PG_KEY"
"""Environment variable a rank actor sets to the run's random rendezvous prefix (`rendezvous_store`)."""


def rendezvous_store(addr: str, port: int, rank: int, world_size: int, key: str, timeout_s: float = 1800.0) -> dist.Store:
    """The process group's store: rank 0 hosts a TCPStore on `addr:port` only (its socket is bound here
    and handed over; TCPStore alone listens on every interface), and every key lives under `key`, a
    random prefix handed to the ranks by their launcher. The store itself authenticates nobody: a
    process that reaches the port but lacks `key` cannot find the rendezvous keys (a TCPStore cannot
    list them), so it cannot take a rank or read the ranks' addresses (or NCCL's unique id)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if rank == 0:
        family = socket.AF_INET6 if ":" in addr else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((addr, port))
            sock.listen(512)
        except OSError:
            sock.close()
            raise
        store = dist.TCPStore(addr, port, world_size, is_master=True, wait_for_workers=False, timeout=timeout,
                              master_listen_fd=sock.detach())
    else:
        store = dist.TCPStore(addr, port, world_size, is_master=False, timeout=timeout)
    return dist.PrefixStore(key, store)


def ensure_process_group(device: torch.device) -> bool:
    """Use the existing process group, or start one; True if this call started it.

    - one rank (no `RANK` / `MASTER_ADDR`): an in-process store (no TCPStore listens);
    - a rank actor (`ASYNCRL_PG_KEY` set): `rendezvous_store` on `MASTER_ADDR:MASTER_PORT`;
    - torchrun (`RANK`, `MASTER_ADDR`, no key): torchrun's own rendezvous (its store is torchrun's).
    """
    if dist.is_initialized():
        return False
    backend = "nccl" if device.type == "cuda" else "gloo"
    device_id = device if device.type == "cuda" else None
    if "RANK" in os.environ and "MASTER_ADDR" in os.environ:
        key = os.environ.get(PG_KEY_ENV, "")
        if key:
            rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            store = rendezvous_store(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), rank, world, key)
            dist.init_process_group(backend, store=store, rank=rank, world_size=world, device_id=device_id)
        else:
            dist.init_process_group(backend, device_id=device_id)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return True


def close_process_group() -> None:
    """Tear the default process group down in step on every rank (each rank calls it, after dropping its models):
    FSDP's modules and the collectives' work objects they hold are freed first (they sit in reference cycles;
    gloo's worker threads freeing one after the group is gone, or at interpreter exit, abort the process:
    "terminate called without an active exception"), then every rank leaves its last collective (a barrier)
    before any destroys the group."""
    gc.collect()
    if dist.get_world_size() > 1:
        dist.barrier()
    dist.destroy_process_group()
    gc.collect()


def lr_factor(step: int, *, warmup: int, total: int, schedule: str, min_ratio: float) -> float:
    """Multiplier of the peak lr at optimizer step `step` (0-based): linear warm-up, then constant or cosine."""
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def adamw_with_schedule(model: torch.nn.Module, trainer: Any, lr: float, weight_decay: float) -> tuple[torch.optim.Optimizer, Any]:
    """AdamW over `model`'s trainable parameters (`trainer.betas`, `trainer.optimizer_impl`) and its `LambdaLR` on `lr_factor`
    (`trainer.warmup_steps`, `total_steps`, `lr_schedule`, `min_lr_ratio`): the policy's and the critic's."""
    params = [p for p in model.parameters() if p.requires_grad]
    impl = trainer.optimizer_impl
    if impl == "auto":  # foreach: one dispatch per op over all DTensor shards, much cheaper on CPU than a per-param loop
        impl = "fused" if params and params[0].device.type == "cuda" else "foreach"
    optimizer = torch.optim.AdamW(params, lr=lr, betas=(trainer.betas[0], trainer.betas[1]), weight_decay=weight_decay,
                                  **{impl: True})
    schedule = partial(lr_factor, warmup=trainer.warmup_steps, total=trainer.total_steps, schedule=trainer.lr_schedule,
                       min_ratio=trainer.min_lr_ratio)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)


def clip_and_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, grad_clip: float) -> tuple[float, bool]:
    """Clip the gradient norm to `grad_clip` (0: no clip), step unless the norm is non-finite (the
    weights and optimizer state then stay as they were), zero the gradients. Returns (norm before
    clipping, stepped)."""
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=grad_clip if grad_clip > 0 else math.inf)
    norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
    stepped = math.isfinite(norm)
    if stepped:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm, stepped


def compile_disabled() -> bool:
    """torch.compile is turned off in this process (`TORCH_COMPILE_DISABLE` set to anything but 0)."""
    return os.environ.get("TORCH_COMPILE_DISABLE", "0") not in ("", "0")


def attention_kernel(trainer: Any, device: torch.device) -> str:
    """transformers' `attn_implementation` for `trainer.attn_implementation`; `auto`: flash-attention's varlen
    kernel on CUDA where the package is installed, else flex attention's document mask on CUDA with packing
    (no dense [N, N] mask), else `sdpa`.

    >>> from types import SimpleNamespace as NS
    >>> attention_kernel(NS(attn_implementation="auto", packing=True), torch.device("cpu"))
    'sdpa'
    >>> attention_kernel(NS(attn_implementation="eager", packing=True), torch.device("cpu"))
    'eager'
    """
    chosen = trainer.attn_implementation
    if chosen != "auto":
        return chosen
    if device.type != "cuda":
        return "sdpa"
    import importlib.util

    if importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    return "flex_attention" if trainer.packing else "sdpa"
