"""A model of a real size, built locally with random weights, for benches (nothing is downloaded).

Job: `ensure_real_model(cache, "qwen2.5-0.5b")` writes a folder that vLLM and transformers load
like the real checkpoint's architecture: Qwen2.5-0.5B's config (hidden 896, 24 layers, 14
attention heads, 2 KV heads, intermediate 4864, vocab 151,936, tied word embeddings, rope theta
1e6, q/k/v biases), random weights (bf16 on disk, about 1 GB) and a tokenizer that covers the
whole vocabulary: the demo's character tokens (`asyncrl.data.tiny_model.vocab`), then one filler
token per id up to the vocabulary size, so every id decodes. `random_state` gives the same
names and shapes as a state dict (no `lm_head.weight`: tied, as in the real checkpoint), and
`hf_model` an fp32 HF model that holds given tensors without copying them (the reference a
bench compares an engine's log-probs with).

What it is not: the real model's weights or tokenizer; log-probs of random weights only show
that an engine serves exactly the tensors it was sent.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

REAL_CONFIGS: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": {
        "hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
        "intermediate_size": 4864, "vocab_size": 151936, "tie_word_embeddings": True, "rope_theta": 1e6,
        "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "hidden_act": "silu",
    },
}
"""Architectures by name (Qwen2 family), the fields of each one's published config.json that matter."""

INIT_STD = 0.02
"""Std of the random matrices (Qwen2's `initializer_range`); norm weights are 1 + 0.1 N(0, 1)."""


def qwen2_config(name: str) -> Any:
    from transformers import Qwen2Config

    from asyncrl.data.tiny_model import BOS_ID, EOS_ID, PAD_ID

    spec = dict(REAL_CONFIGS[name])
    rope = {"rope_type": "default", "rope_theta": spec.pop("rope_theta")}
    return Qwen2Config(**spec, rope_parameters=rope, bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
                       torch_dtype="bfloat16")


def param_shapes(config: Any) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor of the checkpoint (no `lm_head.weight` when tied), in sorted order."""
    h, inter = config.hidden_size, config.intermediate_size
    kv = config.num_key_value_heads * (h // config.num_attention_heads)
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, h), "model.norm.weight": (h,)}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (h, h), p + "self_attn.q_proj.bias": (h,),
            p + "self_attn.k_proj.weight": (kv, h), p + "self_attn.k_proj.bias": (kv,),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.v_proj.bias": (kv,),
            p + "self_attn.o_proj.weight": (h, h),
            p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h), p + "mlp.down_proj.weight": (h, inter),
        })
    return dict(sorted(shapes.items()))


def random_state(config: Any, seed: int, dtype: Any = None) -> dict[str, Any]:
    """Random weights of `config`'s checkpoint, the same for the same seed (sorted names, `dtype`, default fp32)."""
    import torch

    dtype = dtype or torch.float32
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in param_shapes(config).items():
        t = torch.empty(shape, dtype=torch.float32)
        if "norm" in name:
            t.normal_(0.0, 0.1, generator=g).add_(1.0)
        else:
            t.normal_(0.0, INIT_STD, generator=g)
        out[name] = t if dtype == torch.float32 else t.to(dtype)
    return out


def build_tokenizer(vocab_size: int) -> Any:
    """The demo's character tokenizer, extended with one filler token per id up to `vocab_size`."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from asyncrl.data.tiny_model import vocab

    table = dict(vocab())
    for i in range(len(table), vocab_size):
        table[f"<x{i}>"] = i
    tok = Tokenizer(models.WordLevel(vocab=table, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                   unk_token="<unk>", clean_up_tokenization_spaces=False)


def ensure_real_model(cache_dir: str | os.PathLike, name: str = "qwen2.5-0.5b", seed: int = 0) -> Path:
    """The folder of `name`'s architecture with random weights (`seed`), built on first use (atomic rename)."""
    from safetensors.torch import save_file
    import torch

    final = Path(cache_dir) / f"{name}-random-s{seed}"
    if (final / "config.json").exists() and (final / "tokenizer.json").exists():
        return final
    tmp = final.with_name(final.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    config = qwen2_config(name)
    config.save_pretrained(tmp)
    build_tokenizer(config.vocab_size).save_pretrained(tmp)
    save_file(random_state(config, seed, torch.bfloat16), str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "generation_config.json").write_text(json.dumps({"bos_token_id": config.bos_token_id,
                                                            "eos_token_id": config.eos_token_id}))
    try:
        os.rename(tmp, final)
    except OSError:  # another process built it first
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return final


def hf_model(folder: str | os.PathLike, state: dict[str, Any]) -> Any:
    """An fp32 HF model of `folder`'s architecture whose parameters ARE `state`'s tensors (fp32, no
    copy; a tied head is the embedding). For teacher-forced reference log-probs."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if set(missing) - {"lm_head.weight"} or unexpected or ("lm_head.weight" in missing and not config.tie_word_embeddings):
        raise KeyError(f"state does not fit {folder}: missing {missing}, unexpected {unexpected}")
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.model.rotary_emb = type(model.model.rotary_emb)(config=config)  # its buffers were built on meta
    return model.eval()


def teacher_forced_logprobs(model: Any, prompt: list[int], response: list[int]) -> list[float]:
    """log-softmax of `model`'s logits at each response token (temperature 1)."""
    import torch

    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(response)[:, None])[:, 0].tolist()
