"""Reading the weights out of an FSDP2 model for publishing: whole tensors, or each rank's rows.

Two ways, chosen by the weight plane's backend (`rank.py`):
- `full_params`: the full tensors, one FSDP unit (decoder layer) at a time: one all-gather per
  unit, not per tensor, and a publisher holds one unit besides its buckets. Collective: every
  rank iterates to the end.
- `local_shards`: this rank's rows of every parameter as pieces of the full tensors (name, rows,
  full shape, byte offset), no collective at all; receivers assemble the pieces of every rank.

Both yield HF state-dict names in the model dtype, on the device asked for. A LoRA model
(`lora.py`) yields the same: base names, each adapted weight merged (W + scale * B @ A), no
adapter tensors; `local_shards` merges row by row (B's rows shard like W's), gathering only the
small A of each adapted layer up front (all-gathers on the first item asked for, which every rank of
a sharded publish asks for; nothing collective after it, so a rank may still stop early).
"""

from __future__ import annotations

from typing import Iterator

import torch
from torch import Tensor

from asyncrl.trainer.lora import delta, hf_name, is_adapter_key, lora_layer


def full_params(model: torch.nn.Module, dtype: torch.dtype, device: str | torch.device = "cpu",
                *, borrowed: bool = False) -> Iterator[tuple[str, Tensor]]:
    """(name, full tensor). `borrowed=True` yields views of the gathered unit, valid until the next
    item is asked for (the weight plane's packer copies each tensor into a bucket at once);
    otherwise every tensor is the caller's own."""
    from torch.distributed.fsdp import FSDPModule

    units = {name: m for name, m in model.named_modules() if isinstance(m, FSDPModule)}
    by_unit: dict[str, list[str]] = {}
    for key in model.state_dict():
        if is_adapter_key(key):  # merged into its base weight below
            continue
        path = key.rpartition(".")[0]
        owner = max((u for u in units if u == "" or path == u or path.startswith(u + ".")), key=len)
        by_unit.setdefault(owner, []).append(key)
    for unit, keys in by_unit.items():
        units[unit].unshard()  # this unit's own parameters only (FSDP2 unshard is not recursive)
        try:
            for key in keys:
                path, _, attr = key.rpartition(".")
                t = getattr(model.get_submodule(path), attr).detach()
                layer = lora_layer(model, key)
                if layer is not None:
                    t = t.float() + delta(layer).to(t.device)
                out = t.to(device=device, dtype=dtype)
                yield hf_name(key), out if borrowed or out.data_ptr() != t.data_ptr() else out.clone()
        finally:
            units[unit].reshard()


def local_shards(model: torch.nn.Module, rank: int, world: int, dtype: torch.dtype,
                 device: str | torch.device = "cpu") -> Iterator[tuple[str, Tensor, list[int], int]]:
    """(name, this rank's rows, full shape, byte offset of the rows in the full tensor). FSDP2 shards
    dim 0 as `torch.chunk` does; a tensor that is not sharded (a buffer) is sent whole by rank 0."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    sd = model.state_dict()
    layers = {name: layer for name in sd if not is_adapter_key(name) and (layer := lora_layer(model, name)) is not None}
    a_full = {name: _full(layer.lora_A[layer.active_adapters[0]].weight) for name, layer in layers.items()}  # collective
    for name, t in sd.items():
        if is_adapter_key(name):
            continue
        layer = layers.get(name)
        full_shape = list(t.shape)
        if hasattr(t, "to_local"):
            local = t.to_local()
            rows = full_shape[0] if full_shape else 1
            chunk = -(-rows // world)
            start = min(rank * chunk, rows)
            if local.shape[0] != max(0, min(chunk, rows - start)):
                raise RuntimeError(f"{name}: local shard of {tuple(local.shape)} is not rank {rank}'s dim-0 chunk")
            if layer is not None:  # this rank's rows of W + scale * B @ A: B's rows shard as W's do
                (a,) = layer.active_adapters
                b = layer.lora_B[a].weight
                b_rows = b.to_local() if hasattr(b, "to_local") else b[start:start + local.shape[0]]
                local = local.float() + delta(layer, a_full[name], b_rows.detach())
        elif rank == 0:
            local, start = t, 0
        else:
            continue
        if local.numel() == 0:
            continue
        row_bytes = local[0].numel() * itemsize if local.dim() else 0
        yield hf_name(name), local.detach().to(device=device, dtype=dtype), full_shape, start * row_bytes


def _full(t: Tensor) -> Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach()
