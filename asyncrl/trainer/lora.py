"""LoRA (peft) on the trainer: wrapping the HF model, merged weights out, the base as the reference.

Job: with `model.lora_rank` > 0 the trainer's model is peft's `get_peft_model` of the HF causal LM
(only the adapters trainable, wrapped before FSDP2 shards it, `load.load_sharded_model`). What
leaves the trainer is always plain full weights under the base model's HF names: each adapted
linear's weight merged as W + scale * B @ A (peft's own `get_delta_weight`), no `lora_*` tensors,
no `base_model.model.` prefix, so every rollout backend and `asyncrl export` load them unchanged.
The KL reference is the same model with its adapters disabled (`AdaptersDisabled`): no second copy.

Boundary: names and merging only; when to publish, how to shard or checkpoint belongs to
`weights.py`, `rank.py`, `checkpoint.py` (which saves the peft names: the checkpoint resumes
into a LoRA engine, and `merge_state_dict` turns it into base names for export).

    spec = LoraSpec.from_model(cfg.model)              # None when model.lora_rank == 0
    model = wrap(hf_model, spec)                       # PeftModel, adapters trainable
    hf_name("base_model.model.model.layers.0.mlp.up_proj.base_layer.weight")  # 'model.layers.0.mlp.up_proj.weight'
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

PREFIX = "base_model.model."
"""What peft puts in front of the HF names."""
ADAPTER = "default"
"""The one adapter the trainer trains."""


@dataclass(frozen=True)
class LoraSpec:
    """The LoRA settings of `ModelConfig` (`lora_rank`, `lora_alpha`, `target_modules`)."""

    rank: int
    alpha: int
    target_modules: tuple[str, ...] = ("all-linear",)

    @property
    def scale(self) -> float:
        """alpha / rank: the factor of B @ A in the merged weight (peft's `scaling`, no rsLoRA)."""
        return self.alpha / self.rank

    @classmethod
    def from_model(cls, model: Any) -> "LoraSpec | None":
        """From a `ModelConfig`; None with `lora_rank` 0 (LoRA off)."""
        if not model.lora_rank:
            return None
        return cls(int(model.lora_rank), int(model.lora_alpha), tuple(model.target_modules))

    def peft_config(self) -> Any:
        from peft import LoraConfig

        targets: str | list[str] = "all-linear" if self.target_modules == ("all-linear",) else list(self.target_modules)
        return LoraConfig(r=self.rank, lora_alpha=self.alpha, target_modules=targets, lora_dropout=0.0, bias="none")


def wrap(model: torch.nn.Module, spec: LoraSpec) -> torch.nn.Module:
    """peft model of `model`: the base frozen, only the `lora_A` / `lora_B` weights trainable."""
    from peft import get_peft_model

    try:
        peft = get_peft_model(model, spec.peft_config())
    except ValueError as e:  # peft: "Target modules {...} not found in the base model"
        raise ValueError(f"model.target_modules: {list(spec.target_modules)} do not fit the model ({e})") from e
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        print(f"asyncrl: {trainable_line(peft, spec)}", flush=True)
    return peft


def trainable_line(model: torch.nn.Module, spec: LoraSpec) -> str:
    """What LoRA trains, in one line: `LoRA rank 8 (alpha 16) on [all-linear]: 1,024 of 494,032 parameters train (0.21%)`."""
    train = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    return (f"LoRA rank {spec.rank} (alpha {spec.alpha}) on {list(spec.target_modules)}: {train:,} of {total:,} parameters "
            f"train ({100 * train / max(total, 1):.2f}%; model.lora_rank, model.target_modules)")


def is_adapter_key(key: str) -> bool:
    return ".lora_A." in key or ".lora_B." in key or ".lora_embedding_" in key


def hf_name(key: str) -> str:
    """peft state-dict name -> the base model's HF name (unchanged without LoRA)."""
    return key.removeprefix(PREFIX).replace(".base_layer.", ".")


def lora_layer(model: torch.nn.Module, key: str) -> Any:
    """The peft LoRA layer whose base weight `key` is (`....q_proj.base_layer.weight`), or None."""
    path, _, attr = key.rpartition(".")
    if attr != "weight" or not path.endswith(".base_layer"):
        return None
    layer = model.get_submodule(path.removesuffix(".base_layer"))
    active = [a for a in getattr(layer, "active_adapters", []) if a in getattr(layer, "lora_A", {})]
    return layer if active and not getattr(layer, "disable_adapters", False) else None


def delta(layer: Any, a_full: Tensor | None = None, b_rows: Tensor | None = None) -> Tensor:
    """scale * B @ A of the layer's active adapters (fp32), from its parameters as they are now
    (gathered), or from `b_rows` (some rows of B) and `a_full` (all of A) for one adapter."""
    if a_full is not None and b_rows is not None:
        (name,) = layer.active_adapters
        return (b_rows.float() @ a_full.float()) * layer.scaling[name]
    return sum(layer.get_delta_weight(a).float() for a in layer.active_adapters)


def merge_state_dict(sd: dict[str, Tensor], scale: float) -> dict[str, Tensor]:
    """A saved peft state dict (full tensors) -> base HF names with W + scale * B @ A merged in.

    For readers without the model (`asyncrl export`): one adapter (`default`), no fan-in-fan-out."""
    out: dict[str, Tensor] = {}
    for key, t in sd.items():
        if is_adapter_key(key):
            continue
        if key.endswith(".base_layer.weight"):
            stem = key.removesuffix(".base_layer.weight")
            a, b = sd.get(f"{stem}.lora_A.{ADAPTER}.weight"), sd.get(f"{stem}.lora_B.{ADAPTER}.weight")
            if a is not None and b is not None:
                t = (t.float() + scale * (b.float() @ a.float())).to(t.dtype)
        out[hf_name(key)] = t
    return out


class AdaptersDisabled:
    """The KL reference of a LoRA policy: the policy's own base, called with its adapters off.

    Scores like the initial weights (LoRA's B starts at 0) without a second model in memory; has
    what the engine's scoring calls (`__call__`, `get_output_embeddings`)."""

    def __init__(self, policy: torch.nn.Module) -> None:
        self.policy = policy

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        off = getattr(self.policy, "disable_adapter", None)
        with off() if off is not None else nullcontext():
            return self.policy(*args, **kwargs)

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.policy.get_output_embeddings()
