"""LoRA on the trainer (one gloo rank, real FSDP2, real peft): only adapters train, weights leave merged
under the base model's names (equal to peft's own `merge_and_unload`), the reference is the base with the
adapters off, and a checkpoint round-trips (and exports merged)."""

import copy

import pytest
import torch

from asyncrl.config import AlgorithmConfig, ModelConfig, TrainerConfig
from asyncrl.trainer.engine import TrainerEngine
from asyncrl.trainer.lora import LoraSpec, merge_state_dict
from asyncrl.trainer.synthetic import synthetic_batch

VOCAB = 100
SPEC = LoraSpec(rank=4, alpha=8)


def make_engine(path, *, lr=1e-2, **alg):
    trainer = TrainerConfig(micro_batch_size=4, lr=lr, total_steps=10, minibatches=1, warmup_steps=0)
    return TrainerEngine(path, trainer=trainer, algorithm=AlgorithmConfig(entropy_coef=0.0, **alg), lora=SPEC)


def learning_batch(seed=1):
    batch = synthetic_batch(8, vocab_size=VOCAB, seed=seed)
    sign = torch.tensor([1.0, -1.0] * 4)[:, None]
    return batch.replace(advantages=sign * batch.loss_mask)


def full(t):
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def params(engine):
    return {n: full(p) for n, p in engine.model.named_parameters()}


def base_state(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()


def test_spec_from_model_config():
    assert LoraSpec.from_model(ModelConfig()) is None
    spec = LoraSpec.from_model(ModelConfig(lora_rank=8, lora_alpha=32, target_modules=["q_proj", "v_proj"]))
    assert spec == LoraSpec(8, 32, ("q_proj", "v_proj")) and spec.scale == 4.0
    with pytest.raises(ValueError, match="model.lora_rank"):
        ModelConfig(lora_rank=-1)


@pytest.mark.timeout(120)
def test_only_adapters_train_and_weights_leave_merged_under_base_names(tiny_model_path):
    from peft import get_peft_model

    engine = make_engine(tiny_model_path)
    try:
        trainable = {n for n, p in engine.model.named_parameters() if p.requires_grad}
        assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
        opt_params = {id(p) for g in engine.optimizer.param_groups for p in g["params"]}
        assert opt_params == {id(p) for p in engine.model.parameters() if p.requires_grad}
        total = sum(p.numel() for p in engine.model.parameters())
        frac = sum(p.numel() for p in engine.model.parameters() if p.requires_grad) / total
        assert 0 < frac < 0.1, frac

        before_params = params(engine)
        before_out = dict(engine.iter_full_params())
        base = base_state(tiny_model_path)
        assert sorted(before_out) == sorted(base)  # the base model's names: no peft prefixes, no lora_*
        assert all(torch.equal(before_out[k], base[k]) for k in base)  # B starts at 0: merged == base

        engine.train_step(learning_batch())
        after_params = params(engine)
        changed = {n for n in after_params if not torch.equal(after_params[n], before_params[n])}
        assert changed and changed <= trainable and any(".lora_B." in n for n in changed)

        out = dict(engine.iter_full_params())
        moved = {k for k in out if not torch.equal(out[k], before_out[k])}
        assert moved and all(k.endswith("_proj.weight") for k in moved)  # only adapted linears' weights

        # peft's own merge of the same adapters, on a copy of the base
        from transformers import AutoModelForCausalLM

        ref = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32), SPEC.peft_config())
        ref.load_state_dict({n: after_params[n] for n in trainable}, strict=False)
        merged = copy.deepcopy(ref).merge_and_unload().state_dict()
        assert sorted(merged) == sorted(out)
        assert max((merged[k] - out[k]).abs().max().item() for k in out) < 1e-6

        shards = {name: rows for name, rows, shape, offset in engine.iter_local_shards()}  # the sharded publish path
        assert sorted(shards) == sorted(out) and all(torch.allclose(shards[k], out[k], atol=1e-6) for k in out)
        saved = merge_state_dict({k: full(v) for k, v in engine.model.state_dict().items()}, SPEC.scale)  # export path
        assert sorted(saved) == sorted(out) and all(torch.allclose(saved[k], out[k], atol=1e-6) for k in out)
    finally:
        engine.close()


@pytest.mark.timeout(120)
def test_reference_is_the_base_with_adapters_disabled(tiny_model_path):
    engine = make_engine(tiny_model_path, kl_coef=0.1)
    batch = learning_batch(seed=2)
    try:
        assert not isinstance(engine.ref_model, torch.nn.Module)  # no second model
        ref0 = engine.compute_ref_logprobs(batch)
        assert torch.allclose(ref0, engine.compute_logprobs(batch), atol=1e-6)
        engine.train_step(batch)
        assert engine.train_step(batch)["kl"] > 0  # the loss's KL: the policy has left the reference
        ref1, pol = engine.compute_ref_logprobs(batch), engine.compute_logprobs(batch)
        assert torch.allclose(ref1, ref0, atol=1e-6)  # the base did not move
        assert (pol - ref1).abs().max().item() > 1e-3  # the adapted policy did
    finally:
        engine.close()


@pytest.mark.timeout(120)
def test_checkpoint_round_trip_and_export_merge(tiny_model_path, tmp_path):
    from asyncrl.export import load_policy_weights

    batch = learning_batch(seed=3)
    engine = make_engine(tiny_model_path)
    try:
        engine.train_step(batch)
        engine.save(str(tmp_path / "ckpt"))
        want = dict(engine.iter_full_params())
        engine.train_step(batch)
        want_next = dict(engine.iter_full_params())
    finally:
        engine.close()
    fresh = make_engine(tiny_model_path)
    try:
        fresh.load(str(tmp_path / "ckpt"))
        assert fresh.step == 1
        got = dict(fresh.iter_full_params())
        assert all(torch.equal(got[k], want[k]) for k in want)
        fresh.train_step(batch)  # Adam moments restored: the same second step
        got_next = dict(fresh.iter_full_params())
        assert max((got_next[k] - want_next[k]).abs().max().item() for k in want) < 1e-6
    finally:
        fresh.close()
    exported = merge_state_dict(load_policy_weights(tmp_path / "ckpt"), SPEC.scale)
    assert sorted(exported) == sorted(want) and all(torch.allclose(exported[k], want[k], atol=1e-6) for k in want)
