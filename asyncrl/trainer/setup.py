"""Where a trainer rank runs: its device, its process group, its sharded model, its LR schedule.

Plain torch.distributed, no Ray: used by `TrainerEngine` (engine.py, which re-exports these) in
a unit test, under `torchrun` and inside the Ray shell.
"""

from __future__ import annotations

import math
import os
import socket
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from asyncrl.trainer.lora import LoraSpec


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


def ensure_process_group(device: torch.device) -> bool:
    """Use the existing process group, or start a 1-rank one; True if this call started it."""
    if dist.is_initialized():
        return False
    backend = "nccl" if device.type == "cuda" else "gloo"
    if "RANK" in os.environ and "MASTER_ADDR" in os.environ:  # torchrun / the Ray shell
        dist.init_process_group(backend, device_id=device if device.type == "cuda" else None)
    else:
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    return True


def lr_factor(step: int, *, warmup: int, total: int, schedule: str, min_ratio: float) -> float:
    """Multiplier of the peak lr at optimizer step `step` (0-based): linear warm-up, then constant or cosine."""
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def load_sharded_model(path: str, device: torch.device, dtype: torch.dtype, trainable: bool,
                       gradient_checkpointing: bool = False, auto_class: str = "AutoModelForCausalLM", *,
                       lora: "LoraSpec | None" = None, adapters_of: torch.nn.Module | None = None) -> Any:
    """HF causal LM (or `auto_class`, e.g. the critic's `AutoModelForTokenClassification` with one label)
    in fp32 master weights, `fully_shard` per decoder layer and at the root.

    Non-fp32 `dtype` becomes the FSDP compute dtype (gradients reduced in fp32). With
    `gradient_checkpointing` (`trainer.gradient_checkpointing`) each decoder layer recomputes its
    activations in backward (non-reentrant `torch.utils.checkpoint`, set before sharding).
    With `lora` (`model.lora_rank` > 0) a trainable model is peft's wrapper, made before sharding, with
    only its adapters trainable (`lora.py`); a frozen one asked for with `adapters_of` (the LoRA policy)
    is not loaded at all: it is that policy with its adapters disabled (the KL reference).
    """
    from asyncrl.trainer.lora import AdaptersDisabled, wrap

    if lora is not None and adapters_of is not None and not trainable:
        return AdaptersDisabled(adapters_of)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    import transformers

    kwargs = {"num_labels": 1} if auto_class == "AutoModelForTokenClassification" else {}  # the critic's value head
    hf = model = getattr(transformers, auto_class).from_pretrained(path, dtype=torch.float32, **kwargs).to(device)
    model.eval()  # no dropout: the trainer must score tokens as the rollout engine does
    model.requires_grad_(trainable)
    if lora is not None and trainable:
        model = wrap(hf, lora).eval()  # freezes the base, adds trainable lora_A / lora_B (in eval: no dropout)
    if gradient_checkpointing:
        hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        # HF checkpoints a layer only while it is in training mode; the model stays in eval (no dropout), so
        # only the checkpointed layers themselves are flagged training, their submodules (dropout) stay eval
        for m in model.modules():
            if getattr(m, "gradient_checkpointing", False) is True:
                m.training = True
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32) if dtype != torch.float32 else MixedPrecisionPolicy()
    layer_types = set(getattr(hf, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in layer_types]
    if not layers:
        raise ValueError(f"{path}: no decoder layers found to shard (model._no_split_modules={sorted(layer_types)})")
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model
