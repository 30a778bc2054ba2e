"""Fixtures of the data tests: a tiny byte-level BPE tokenizer (trained here, saved with `save_pretrained`)
with and without a ChatML chat template, and verl-format rows."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _save_tokenizer(out: Path, chat_template: str | None) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = [f"Natalia sold {i} clips to {i + 1} friends. How many clips? #### {2 * i + 1}" for i in range(200)]
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    if chat_template:
        fast.chat_template = chat_template
    fast.save_pretrained(str(out))
    return out


@pytest.fixture(scope="session")
def chatml_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Loaded back from its folder, as `launch.build` loads `model.path`."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(_save_tokenizer(tmp_path_factory.mktemp("chatml_tok"), CHATML)))


@pytest.fixture(scope="session")
def plain_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The same kind of tokenizer with no chat template (a base model's)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(_save_tokenizer(tmp_path_factory.mktemp("plain_tok"), None)))


def verl_row(i: int, chat: bool = True, source: str = "openai/gsm8k") -> dict[str, Any]:
    """A row as verl's GSM8K preprocessing writes it (chat prompt) or with a string prompt."""
    q = f"Natalia sold {i} clips. How many? Let's think step by step and output the final answer after \"####\"."
    return {
        "data_source": source,
        "prompt": [{"role": "user", "content": q}] if chat else q,
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(2 * i)},
        "extra_info": {"split": "train", "index": i},
    }


def write_parquet(path: Path, rows: list[dict[str, Any]]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path
