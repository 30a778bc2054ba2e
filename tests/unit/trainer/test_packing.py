"""Long sequences without padding waste: token-budget micro-batches, packing, chunked log-probs and
gradient checkpointing each give the step the padded, count-cut path gives (real FSDP2 engine, tiny Qwen2)."""

import numpy as np
import pytest
import torch

from asyncrl.config import AlgorithmConfig, TrainerConfig
from asyncrl.trainer.batch import TrainBatch
from asyncrl.trainer.engine import TrainerEngine
from asyncrl.trainer.packing import chunked_scores, pack, token_budget_groups
from asyncrl.trainer.synthetic import full_grads

VOCAB = 100
LENGTHS = [70, 5, 33, 9, 120, 4, 48, 17]  # a long tail: padded to 120 a micro-batch is mostly padding


def long_tail_batch(lengths=LENGTHS, seed=0) -> TrainBatch:
    rng = np.random.default_rng(seed)
    rows = []
    for n in lengths:
        p = max(1, n // 4)
        r = n - p
        mask = (rng.random(r) > 0.2).astype(np.float32)
        rows.append({"prompt_ids": rng.integers(4, VOCAB, p), "response_ids": rng.integers(4, VOCAB, r),
                     "behavior_logprobs": -rng.uniform(3.5, 5.5, r).astype(np.float32), "loss_mask": mask,
                     "token_versions": np.zeros(r, dtype=np.int64)})
    adv = rng.normal(size=len(lengths)).tolist()
    return TrainBatch.from_arrays(rows, adv, pad_id=0)


def run_step(path, batch, **trainer_kw):
    """compute_logprobs, then one train_step; returns the log-probs, the step's metrics and the full gradients it applied
    (not the weights after it: AdamW's first step, lr * g / (|g| + eps), turns 1e-9 gradient noise on near-zero
    gradients into lr-sized differences)."""
    kw = dict(micro_batch_size=3, lr=1e-3, total_steps=10, minibatches=1) | trainer_kw
    engine = TrainerEngine(path, trainer=TrainerConfig(**kw), algorithm=AlgorithmConfig(entropy_coef=0.01, entropy_target=0.0))
    grads = {}
    real_step = engine.optimizer_step

    def capture(end_of_step=True):
        grads.update(full_grads(engine))
        return real_step(end_of_step)

    engine.optimizer_step = capture
    try:
        logprobs = engine.compute_logprobs(batch)
        metrics = engine.train_step(batch)
    finally:
        engine.close()
    return logprobs, metrics, grads


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys() and a
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_token_budget_groups_respect_the_budget_and_cover_every_row():
    lengths = [70, 5, 33, 9, 120, 4, 48, 17, 300]
    groups = token_budget_groups(lengths, budget=128)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for g in groups:
        assert sum(lengths[i] for i in g) <= 128 or len(g) == 1  # only a row longer than the budget stands alone
    assert groups[0] == [8]  # the 300-token row is alone
    with pytest.raises(ValueError, match="trainer.max_tokens_per_micro_batch"):
        token_budget_groups(lengths, budget=0)


def test_micro_batch_rows_by_budget_hold_at_most_the_budget():
    batch = long_tail_batch()
    mbs = batch.micro_batches(3, max_tokens=130)
    assert sum(len(m) for m in mbs) == len(batch)
    assert all(int(m.attention_mask.sum()) <= 130 for m in mbs)
    assert len(mbs) < len(batch)  # rows were grouped, not one per micro-batch
    assert float(sum(m.loss_mask.sum() for m in mbs)) == batch.num_tokens


def test_pack_unpack_round_trip():
    batch = long_tail_batch()
    packed = pack(batch.input_ids, batch.attention_mask)
    n = int(batch.attention_mask.sum())
    assert packed.input_ids.shape == (1, n) and packed.position_ids.shape == (1, n)
    assert (packed.position_ids == 0).sum() == len(batch)  # restarts once per sequence
    back = packed.unpack(packed.input_ids.float())
    real = batch.attention_mask.bool()
    real[:, 0] = False  # column 0 is never scored
    assert torch.equal(back[real], batch.input_ids[real].float()) and back[~real].abs().sum() == 0


@pytest.mark.timeout(30)
def test_chunked_scores_equal_full_logits():
    torch.manual_seed(0)
    hidden = torch.randn(2, 37, 16, requires_grad=True)
    head = torch.nn.Linear(16, VOCAB, bias=False)
    ids = torch.randint(0, VOCAB, (2, 37))
    logits = head(hidden)
    z = logits[:, :-1] / 0.7
    full_lp = torch.nn.functional.pad(torch.log_softmax(z, -1).gather(-1, ids[:, 1:, None]).squeeze(-1), (1, 0))
    full_ent = torch.nn.functional.pad(-(torch.softmax(z, -1) * torch.log_softmax(z, -1)).sum(-1), (1, 0))
    lp, ent = chunked_scores(hidden, head.weight, None, ids, temperature=0.7, chunk=10)
    assert (lp - full_lp).abs().max() < 1e-5 and (ent - full_ent).abs().max() < 1e-5
    g_full = torch.autograd.grad((full_lp.sum() + full_ent.sum()), [hidden, head.weight])
    g_chunk = torch.autograd.grad((lp.sum() + ent.sum()), [hidden, head.weight])
    assert all((a - b).abs().max() < 1e-5 for a, b in zip(g_full, g_chunk))


@pytest.mark.timeout(120)
def test_every_long_sequence_option_gives_the_padded_step(tiny_model_path):
    batch = long_tail_batch()
    base_lp, base_m, base_g = run_step(tiny_model_path, batch)
    variants = {
        "budget": dict(max_tokens_per_micro_batch=130),
        "packing": dict(packing=True),
        "packing_budget_chunked": dict(packing=True, max_tokens_per_micro_batch=130, logit_chunk_tokens=16),
        "checkpointing": dict(packing=True, max_tokens_per_micro_batch=130, gradient_checkpointing=True),
    }
    for name, kw in variants.items():
        lp, m, g = run_step(tiny_model_path, batch, **kw)
        assert (lp - base_lp).abs().max() <= 1e-5, name  # compute_logprobs back in row order
        assert abs(m["loss"] - base_m["loss"]) <= 1e-5, name
        assert abs(m["entropy"] - base_m["entropy"]) <= 1e-5, name
        assert m["tokens"] == base_m["tokens"] and m["grad_norm"] > 0, name
        assert max_diff(g, base_g) <= 1e-5, name


@pytest.mark.timeout(60)
def test_packed_logits_match_padded_on_the_installed_transformers(tiny_model_path):
    """Restarting position ids without a mask (and without a KV cache: HF reads the restarts only then) keep
    attention inside each packed sequence (sdpa on CPU)."""
    from transformers import AutoModelForCausalLM

    batch = long_tail_batch(LENGTHS[:4])
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    packed = pack(batch.input_ids, batch.attention_mask)
    with torch.no_grad():
        padded = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        flat = model(input_ids=packed.input_ids, position_ids=packed.position_ids, use_cache=False).logits[0]
    real = batch.attention_mask.bool()
    assert (flat - padded[real]).abs().max() < 1e-4
    # and without the restarts the later sequences would attend to the earlier ones: the check has teeth
    with torch.no_grad():
        leaky = model(input_ids=packed.input_ids, use_cache=False).logits[0]
    assert (leaky - padded[real]).abs().max() > 1e-2


def test_gradient_checkpointing_is_active_on_the_layers(tiny_model_path):
    from asyncrl.trainer.load import load_sharded_model
    from asyncrl.trainer.setup import ensure_process_group

    owns = ensure_process_group(torch.device("cpu"))
    try:
        model = load_sharded_model(tiny_model_path, torch.device("cpu"), torch.float32, trainable=True, gradient_checkpointing=True)
        layers = [m for m in model.modules() if "Qwen2DecoderLayer" in type(m).__name__]  # FSDP2 renames the class
        assert layers and all(m.gradient_checkpointing and m.training for m in layers)
        assert not any(m.training for m in layers[0].modules() if m is not layers[0])  # dropout stays in eval
        calls = []
        layers[0].self_attn.register_forward_pre_hook(lambda *_: calls.append(1))  # a pre-hook: the recompute stops early
        model(input_ids=torch.randint(4, VOCAB, (2, 16)), use_cache=False).logits.sum().backward()
        assert len(calls) == 2  # forward, then the recompute in backward: the layer really is checkpointed
    finally:
        if owns:
            torch.distributed.destroy_process_group()


def test_config_rejects_negative_budgets():
    from asyncrl.config import ConfigError

    with pytest.raises((ConfigError, ValueError), match="trainer.max_tokens_per_micro_batch"):
        TrainerConfig(max_tokens_per_micro_batch=-1)
    with pytest.raises((ConfigError, ValueError), match="trainer.logit_chunk_tokens"):
        TrainerConfig(logit_chunk_tokens=-1)
