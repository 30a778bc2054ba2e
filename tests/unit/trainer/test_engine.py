"""TrainerEngine on one gloo rank with real FSDP2: scoring, learning, KL reference, weights, resume."""

import pytest
import torch

from asyncrl.config import AlgorithmConfig, TrainerConfig
from asyncrl.trainer.engine import TrainerEngine
from asyncrl.trainer.synthetic import synthetic_batch

VOCAB = 100  # tiny model: 4 special tokens + 96 characters


def make_engine(path, *, temperature=1.0, micro_batch_size=3, lr=1e-3, minibatches=1, **alg):
    trainer = TrainerConfig(micro_batch_size=micro_batch_size, lr=lr, total_steps=10, minibatches=minibatches)
    return TrainerEngine(path, trainer=trainer, algorithm=AlgorithmConfig(**alg), temperature=temperature)


def test_compute_logprobs_matches_plain_hf_forward(tiny_model_path):
    from transformers import AutoModelForCausalLM

    batch = synthetic_batch(7, vocab_size=VOCAB, seed=3)
    engine = make_engine(tiny_model_path, temperature=0.7)
    try:
        got = engine.compute_logprobs(batch)
    finally:
        engine.close()
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    ref = torch.log_softmax(logits[:, :-1] / 0.7, dim=-1).gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
    valid = batch.attention_mask[:, 1:].bool()
    assert got.shape == batch.input_ids.shape
    assert (got[:, 1:][valid] - ref[valid]).abs().max().item() < 1e-5
    assert got[:, 0].abs().sum() == 0 and got[:, 1:][~valid].abs().sum() == 0


def test_train_steps_raise_logprob_of_positive_advantage_tokens(tiny_model_path):
    batch = synthetic_batch(8, vocab_size=VOCAB, seed=1)
    sign = torch.tensor([1.0, -1.0] * 4)[:, None]
    batch = batch.replace(advantages=sign * batch.loss_mask)
    engine = make_engine(tiny_model_path, micro_batch_size=4, lr=3e-3)
    try:
        before = engine.compute_logprobs(batch)
        for _ in range(4):
            metrics = engine.train_step(batch.replace(old_logprobs=engine.compute_logprobs(batch) * batch.loss_mask))
        after = engine.compute_logprobs(batch)
    finally:
        engine.close()
    pos, neg = (batch.advantages > 0), (batch.advantages < 0)
    assert (after - before)[pos].mean() > 0.1
    assert (after - before)[neg].mean() < -0.1
    assert engine.step == 4
    expected = {"loss", "pg_loss", "kl", "entropy", "clip_frac", "grad_norm", "lr", "ratio_mean", "ratio_max", "ratio_min", "tokens", "seqs"}
    assert expected <= set(metrics)
    assert metrics["tokens"] == batch.num_tokens and metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert metrics["grad_norm"] > 0 and metrics["entropy"] > 0


def test_kl_to_reference_starts_at_zero_and_grows(tiny_model_path):
    batch = synthetic_batch(6, vocab_size=VOCAB, seed=2)
    engine = make_engine(tiny_model_path, kl_coef=0.1, kl_estimator="k3", entropy_coef=0.01, entropy_target=0.0)
    try:
        ref = engine.compute_ref_logprobs(batch)
        assert torch.allclose(ref, engine.compute_logprobs(batch), atol=1e-6)
        batch = batch.replace(old_logprobs=ref * batch.loss_mask)
        first = engine.train_step(batch)  # ref_logprobs computed by the engine
        second = engine.train_step(batch)
        assert first["kl"] == pytest.approx(0.0, abs=1e-7)
        assert second["kl"] > 1e-6
        for m in (first, second):  # token_mean: loss = pg + kl_coef * kl - entropy_coef * entropy
            assert m["loss"] == pytest.approx(m["pg_loss"] + 0.1 * m["kl"] - 0.01 * m["entropy"], abs=1e-6)
    finally:
        engine.close()


def test_iter_full_params_gives_hf_names_and_values(tiny_model_path):
    from safetensors.torch import load_file

    engine = make_engine(tiny_model_path)
    try:
        params = dict(engine.iter_full_params())
    finally:
        engine.close()
    disk = load_file(f"{tiny_model_path}/model.safetensors")
    assert set(params) == set(disk)
    for name, t in disk.items():
        assert params[name].device.type == "cpu" and torch.equal(params[name], t), name


def test_adaptive_entropy_weight_tracks_the_target(tiny_model_path):
    batch = synthetic_batch(6, vocab_size=VOCAB, seed=5)
    up = make_engine(tiny_model_path, entropy_target=10.0, entropy_coef_lr=0.01)  # entropy (<= ln V) is below 10
    down = make_engine(tiny_model_path, entropy_coef=0.002, entropy_target=0.01, entropy_coef_lr=0.01)
    try:
        m1 = up.train_step(batch)
        m2 = up.train_step(batch)
        assert m1["entropy_coef"] == 0.0  # the weight used in a step is the one before its update
        assert m2["entropy_coef"] == pytest.approx(0.01 * (10.0 - m1["entropy"]))
        assert up.entropy_coef == pytest.approx(m2["entropy_coef"] + 0.01 * (10.0 - m2["entropy"]))
        # with a non-zero weight the bonus is in the loss: loss = pg_loss - weight * entropy (token_mean)
        assert m2["loss"] == pytest.approx(m2["pg_loss"] - m2["entropy_coef"] * m2["entropy"], abs=1e-6)
        d = down.train_step(batch)
        assert d["entropy_coef"] == 0.002 and down.entropy_coef == 0.0  # above the target: lowered, clamped at 0
        # every token is above the 0.01 target (near-uniform policy): each counts as 0.01 in the bonus
        assert d["entropy"] > 1.0
        assert d["loss"] == pytest.approx(d["pg_loss"] - 0.002 * 0.01, abs=1e-7)
    finally:
        up.close()
        down.close()


def test_minibatches_step_the_optimizer_within_one_trainer_step(tiny_model_path):
    """Decoupled PPO: with one mini-batch the ratio to the proximal policy is exactly 1 (the clip
    cannot bind); with two, the second mini-batch sees weights moved by the first."""
    batch = synthetic_batch(8, vocab_size=VOCAB, seed=6)
    runs = {}
    for n in (1, 2):
        engine = make_engine(tiny_model_path, lr=5e-2, minibatches=n, correction="decoupled_ppo", is_cap=0.0)
        try:
            before = engine.compute_logprobs(batch)
            m = engine.train_step(batch)
            runs[n] = (m, engine.step, engine.scheduler.last_epoch, (engine.compute_logprobs(batch) - before).abs().max().item())
        finally:
            engine.close()
    (m1, step1, sched1, moved1), (m2, step2, sched2, moved2) = runs[1], runs[2]
    assert step1 == step2 == 1 and sched1 == sched2 == 1  # versions and the schedule count trainer steps
    assert m1["ratio_max"] == pytest.approx(1.0, abs=1e-5) and m1["ratio_min"] == pytest.approx(1.0, abs=1e-5)
    assert m2["ratio_max"] > 1.001 or m2["ratio_min"] < 0.999
    assert m2["tokens"] == m1["tokens"] == batch.num_tokens
    assert moved1 > 0 and moved2 > 0


def test_save_load_resumes_identically(tiny_model_path, tmp_path):
    batch = synthetic_batch(6, vocab_size=VOCAB, seed=4)
    batch = batch.replace(old_logprobs=batch.old_logprobs * 0 + (-4.6) * batch.loss_mask)
    adaptive = dict(entropy_target=10.0, entropy_coef_lr=0.01)  # the adapted entropy weight is state too
    a = make_engine(tiny_model_path, lr=1e-3, **adaptive)
    b = None
    try:
        a.train_step(batch)
        coef = a.entropy_coef
        assert coef > 0
        a.save(str(tmp_path / "ckpt"))
        saved = {k: v.clone() for k, v in a.iter_full_params()}
        next_a = a.train_step(batch)
        b = make_engine(tiny_model_path, lr=1e-3, **adaptive)
        b.load(str(tmp_path / "ckpt"))
        assert b.step == 1 and b.entropy_coef == coef
        assert b.scheduler.last_epoch == 1
        for name, t in b.iter_full_params():
            assert torch.equal(t, saved[name]), name
        next_b = b.train_step(batch)  # same Adam moments -> same loss and same update
        assert next_b["loss"] == pytest.approx(next_a["loss"], abs=1e-6)
        after_a, after_b = dict(a.iter_full_params()), dict(b.iter_full_params())
        assert max((after_a[k] - after_b[k]).abs().max().item() for k in after_a) < 1e-6
    finally:
        if b is not None:
            b.close()
        a.close()


def test_bfloat16_compute_trains_fp32_master_weights_and_nan_steps_are_skipped(tiny_model_path):
    batch = synthetic_batch(6, vocab_size=VOCAB, seed=1)
    batch = batch.replace(advantages=torch.tensor([1.0, -1.0] * 3)[:, None] * batch.loss_mask)
    engine = TrainerEngine(tiny_model_path, trainer=TrainerConfig(micro_batch_size=4, max_bad_steps=2),
                           algorithm=AlgorithmConfig(), dtype="bfloat16")
    nan = batch.replace(advantages=batch.advantages * float("nan"))
    try:
        lp = engine.compute_logprobs(batch)
        metrics = engine.train_step(batch.replace(old_logprobs=lp * batch.loss_mask))
        assert metrics["grad_norm"] > 0 and metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-2) and metrics["bad_step"] == 0
        assert all(p.dtype == torch.float32 for p in engine.model.parameters())  # master weights stay fp32
        assert all(t.dtype == torch.bfloat16 for _, t in engine.iter_full_params())  # published in the model dtype
        before = dict(engine.iter_full_params())
        metrics = engine.train_step(nan)  # skipped: counted, the version advances, the weights do not move
        assert metrics["bad_step"] == 1 and metrics["skipped_minibatches"] >= 1 and engine.bad_steps == 1
        assert engine.step == 2
        assert all(torch.equal(t, before[n]) for n, t in engine.iter_full_params())  # no update was applied
        lp = engine.compute_logprobs(batch)
        good = engine.train_step(batch.replace(old_logprobs=lp * batch.loss_mask))  # stale NaN grads dropped
        assert good["grad_norm"] > 0 and good["bad_step"] == 0 and engine.bad_steps_in_a_row == 0
        engine.train_step(nan)
        with pytest.raises(FloatingPointError, match="trainer.max_bad_steps=2"):  # two in a row stop the run
            engine.train_step(nan)
        assert engine.bad_steps == 3
    finally:
        engine.close()


def test_cuda_device_without_a_gpu_is_an_error_naming_the_key(monkeypatch):
    import pytest
    import torch

    from asyncrl.trainer.setup import pick_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert pick_device("auto").type == "cpu"
    with pytest.raises(RuntimeError, match="trainer.device=cuda but this process sees no CUDA GPU"):
        pick_device("cuda")
