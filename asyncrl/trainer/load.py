"""How a trainer rank gets its model: built on the meta device, sharded, then filled from the folder by rank 0.

`load_sharded_model` is the one entry (the policy, its frozen reference and the critic: `engine.py`,
`critic.py`); the rest are its steps. Plain torch.distributed, no Ray.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from asyncrl.trainer.lora import LoraSpec


def load_sharded_model(path: str, device: torch.device, dtype: torch.dtype, trainable: bool,
                       gradient_checkpointing: bool = False, auto_class: str = "AutoModelForCausalLM", *,
                       lora: "LoraSpec | None" = None, adapters_of: torch.nn.Module | None = None,
                       attn_implementation: str = "sdpa", compile: bool = False) -> Any:
    """HF causal LM (or `auto_class`, e.g. the critic's `AutoModelForTokenClassification` with one label)
    from the folder `path`, `fully_shard` per decoder layer and at the root, each rank holding its shard only.

    Every rank builds the model on the meta device, wraps and shards it there, then allocates its own
    shard (`to_empty`); rank 0 alone reads the folder's safetensors, one tensor at a time in the stored
    dtype, and broadcasts it; each rank keeps its rows (`_fill`). No rank ever holds the full model: the
    peak is a rank's shard plus one tensor. What it reads equals what `from_pretrained` gives, bit for bit.

    A trainable model holds fp32 master weights; a non-fp32 `dtype` is the FSDP compute dtype (gradients
    reduced in fp32). A frozen one (the KL reference, it never steps) holds its parameters in `dtype`
    (buffers such as rotary `inv_freq` stay fp32, as in the trainable one): what it computes is unchanged.
    With `gradient_checkpointing` (`trainer.gradient_checkpointing`) each decoder layer recomputes its
    activations in backward (non-reentrant `torch.utils.checkpoint`, set before sharding).
    `attn_implementation` is transformers' (`trainer.attn_implementation`, resolved by `setup.attention_kernel`);
    with `compile` (`trainer.compile`) each decoder layer is `torch.compile`d in place before it is sharded.
    With `lora` (`model.lora_rank` > 0) a trainable model is peft's wrapper, made before sharding, with
    only its adapters trainable (`lora.py`); a frozen one asked for with `adapters_of` (the LoRA policy)
    is not loaded at all: it is that policy with its adapters disabled (the KL reference).

    What the folder lacks is an error naming it, except what is new by design, drawn as transformers and
    peft draw it: LoRA adapters, and a head the folder's architecture does not have (the critic's value
    head `score` from a causal LM's folder, whose `lm_head` it then leaves unread). Tied weights
    (`tie_word_embeddings`) stay one parameter.
    """
    from asyncrl.trainer.lora import AdaptersDisabled, wrap

    if lora is not None and adapters_of is not None and not trainable:
        return AdaptersDisabled(adapters_of)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from asyncrl.hf_imports import skip_unused_backends

    skip_unused_backends()
    import transformers

    kwargs = {"num_labels": 1} if auto_class == "AutoModelForTokenClassification" else {}  # the critic's value head
    config = transformers.AutoConfig.from_pretrained(path, **kwargs)
    with torch.device("meta"):
        hf = model = getattr(transformers, auto_class).from_config(config, dtype=torch.float32, attn_implementation=attn_implementation)
        if not trainable and dtype != torch.float32:
            for p in hf.parameters():  # the parameters only: buffers (rotary inv_freq) stay fp32
                p.data = p.data.to(dtype)
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
    index = _checkpoint_index(path, device)
    sources, fresh = _sources(model, hf, index, path)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32) if dtype != torch.float32 else MixedPrecisionPolicy()
    layer_types = set(getattr(hf, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in layer_types]
    if not layers:
        raise ValueError(f"{path}: no decoder layers found to shard (model._no_split_modules={sorted(layer_types)})")
    for layer in layers:
        if compile:  # in place (the module keeps its class and names): FSDP's hooks stay outside the compiled graph
            layer.compile()
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    model.to_empty(device=device)
    _init_buffers(hf)
    _fill(model, sources, fresh, index, path, device)
    return model


_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I64": torch.int64,
           "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}
"""safetensors' dtype names -> torch's (what a rank that never opens the file allocates to receive a tensor)."""


def _checkpoint_index(path: str, device: torch.device) -> dict[str, tuple[str, str, list[int]]]:
    """Checkpoint name -> (file, safetensors dtype, shape), from the headers of the folder's safetensors
    (`model.safetensors.index.json`'s files, or `model.safetensors`), read by rank 0 and broadcast as JSON."""
    import json

    data = json.dumps(_read_index(path)).encode() if dist.get_rank() == 0 else b""
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    dist.broadcast(size, src=0)
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device) if data else torch.empty(int(size), dtype=torch.uint8, device=device)
    dist.broadcast(buf, src=0)
    index = json.loads(buf.cpu().numpy().tobytes())
    if isinstance(index, str):  # rank 0's error, raised on every rank (none waits in a collective)
        raise FileNotFoundError(index)
    return {k: (f, d, shape) for k, (f, d, shape) in index.items()}


def _read_index(path: str) -> dict[str, tuple[str, str, list[int]]] | str:
    import json

    sharded = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(sharded):
        with open(sharded) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.exists(os.path.join(path, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        return f"{path}: no model.safetensors (or model.safetensors.index.json) in the model folder"
    index: dict[str, tuple[str, str, list[int]]] = {}
    for name in files:
        with _open(os.path.join(path, name)) as f:
            for key in f.keys():
                s = f.get_slice(key)
                index[key] = (name, s.get_dtype(), list(s.get_shape()))
    return index


def _open(file: str) -> Any:
    """A safetensors file opened for reads with pread (no mapping of the file stays resident),
    or memory-mapped where the installed safetensors has no `backend`."""
    from safetensors import safe_open

    try:
        return safe_open(file, framework="pt", backend="pread")
    except TypeError:  # an older safetensors
        return safe_open(file, framework="pt")


def _tensors(model: torch.nn.Module) -> list[tuple[list[str], torch.Tensor]]:
    """The model's parameters and persistent buffers, each once with every name it has (a tied weight has two)."""
    seen: dict[int, tuple[list[str], torch.Tensor]] = {}
    for prefix, m in model.named_modules(remove_duplicate=False):
        persistent = [(k, b) for k, b in m._buffers.items() if k not in m._non_persistent_buffers_set]
        for attr, t in [*m._parameters.items(), *persistent]:
            if t is not None:
                seen.setdefault(id(t), ([], t))[0].append(f"{prefix}.{attr}" if prefix else attr)
    return list(seen.values())


def _sources(model: torch.nn.Module, hf: Any, index: dict[str, tuple[str, str, list[int]]],
             path: str) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """(model name -> the checkpoint name that fills it; model name -> its fresh full value on the CPU, for
    what the folder lacks by design). Every rank computes the same from the index; anything else the
    folder lacks, holds beyond the model, or holds in another shape is an error naming the folder."""
    import re

    from asyncrl.trainer.lora import hf_name, is_adapter_key

    prefix = f"{hf.base_model_prefix}." if hf.base_model_prefix else ""
    bare = bool(prefix) and not any(k.startswith(prefix) for k in index)  # a base model's folder: no head, no prefix
    new_head = type(hf).__name__ not in (hf.config.architectures or [])  # e.g. the critic from a causal LM's folder

    def ckpt(name: str) -> str:
        n = hf_name(name)
        return n.removeprefix(prefix) if bare else n

    def is_head(key: str) -> bool:  # outside the backbone, in the checkpoint's names
        return not bare and not key.startswith(prefix)

    sources: dict[str, str] = {}
    fresh: list[str] = []
    missing, shapes, used = [], [], set()
    for names, t in _tensors(model):
        found = [ckpt(n) for n in names if ckpt(n) in index]
        used.update(found)
        if found:
            sources[names[0]] = found[0]
            _, stored, shape = index[found[0]]
            if shape != list(t.shape) or stored not in _DTYPES:
                shapes.append(f"{found[0]} {stored}{shape} (the model's: {list(t.shape)})")
        elif is_adapter_key(names[0]) or (new_head and is_head(ckpt(names[0]))):
            fresh.append(names[0])
        else:
            missing.append(ckpt(names[0]))
    ignored = list(getattr(hf, "_keys_to_ignore_on_load_unexpected", None) or []) + [r"rotary_emb\.inv_freq$"]
    unexpected = [k for k in index if k not in used and not (new_head and is_head(k)) and not any(re.search(p, k) for p in ignored)]
    problems = [f"{what} ({len(keys)}): {', '.join(keys[:5])}{' ...' if len(keys) > 5 else ''}"
                for what, keys in (("missing", missing), ("unexpected", unexpected), ("of another shape or dtype", shapes)) if keys]
    if problems:
        raise ValueError(f"{path}: its weights do not fit {type(hf).__name__}: " + "; ".join(problems))
    return sources, _fresh_values(model, hf, fresh)


def _fresh_values(model: torch.nn.Module, hf: Any, names: list[str]) -> dict[str, torch.Tensor]:
    """Full CPU values of the parameters new by design, each drawn by its owner's own init on a CPU copy of
    the (meta) module that holds it: peft's `reset_lora_parameters` for an adapter, transformers' `_init_weights`
    for a new head (what `from_pretrained` runs on what it reports MISSING). Every rank draws the same (seeded)."""
    import copy

    from asyncrl.trainer.lora import ADAPTER, is_adapter_key

    out: dict[str, torch.Tensor] = {}
    wanted = set(names)
    for name in names:
        if name in out:
            continue
        if is_adapter_key(name):
            owner = name.split(".lora_", 1)[0]
            twin = copy.deepcopy(model.get_submodule(owner))
            for part in ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B"):
                getattr(twin, part).to_empty(device="cpu")
            twin.reset_lora_parameters(ADAPTER, model.peft_config[ADAPTER].init_lora_weights)
        else:
            owner = name.rpartition(".")[0]
            twin = copy.deepcopy(model.get_submodule(owner)).to_empty(device="cpu")
            twin.apply(_init_owner(hf, owner)._init_weights)
        for n, p in twin.named_parameters():
            if f"{owner}.{n}" in wanted:
                out[f"{owner}.{n}"] = p.detach()
    return out


def _init_owner(hf: Any, path: str) -> Any:
    """The innermost transformers model that holds the module at `path` (a composite model's part inits its own)."""
    from transformers import PreTrainedModel

    owner, m = hf, hf
    for part in path.split(".") if path else []:
        m = getattr(m, part)
        owner = m if isinstance(m, PreTrainedModel) else owner
    return owner


def _init_buffers(hf: Any) -> None:
    """Non-persistent buffers (rotary `inv_freq`), garbage after `to_empty`, set as `from_pretrained` sets them
    after its own meta build: the `_init_weights` of the innermost transformers model holding each."""
    from transformers import PreTrainedModel

    def visit(m: torch.nn.Module, owner: Any) -> None:
        owner = m if isinstance(m, PreTrainedModel) else owner
        for child in m.children():
            visit(child, owner)
        if m._non_persistent_buffers_set:
            owner._init_weights(m)

    visit(hf, hf)


@torch.no_grad()
def _fill(model: torch.nn.Module, sources: dict[str, str], fresh: dict[str, torch.Tensor],
          index: dict[str, tuple[str, str, list[int]]], path: str, device: torch.device) -> None:
    """Every parameter and persistent buffer of the sharded (empty) model, one tensor at a time: rank 0
    reads it from its file (pread: no mapping of the file stays resident), broadcasts it in the stored
    dtype, and each rank copies its own rows (FSDP2 shards dim 0 as `torch.chunk` does) in the model's dtype."""
    from contextlib import ExitStack

    from torch.distributed.tensor import DTensor, Shard

    rank, world = dist.get_rank(), dist.get_world_size()
    with ExitStack() as files:
        opened: dict[str, Any] = {}
        for names, t in _tensors(model):
            name = names[0]
            if name in fresh:
                full = fresh[name].to(device)
            else:
                file, stored, shape = index[sources[name]]
                if rank == 0:
                    if file not in opened:
                        opened[file] = files.enter_context(_open(os.path.join(path, file)))
                    full = opened[file].get_tensor(sources[name]).to(device)
                else:
                    full = torch.empty(shape, dtype=_DTYPES[stored], device=device)
                if world > 1:
                    dist.broadcast(full, src=0)
            if isinstance(t, DTensor):
                if tuple(t.placements) != (Shard(0),):
                    raise RuntimeError(f"{name}: sharded as {t.placements}, expected FSDP2's Shard(0)")
                local = t.to_local()
                start = min(t.device_mesh.get_local_rank() * -(-full.shape[0] // world), full.shape[0])
                local.copy_(full[start:start + local.shape[0]])
            else:
                t.copy_(full)
            del full
