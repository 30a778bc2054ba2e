"""The trainer's speed switches take the step the plain path takes (one gloo rank, real FSDP2, the tiny model).

Each switch changes how the step is computed, never what: fused AdamW (`trainer.optimizer_impl`), one
gradient reduction per mini-batch (`trainer.grad_reduce`), the first mini-batch's proximal log-probs from its
own forward (`trainer.proximal_forward`), entropy left out when nothing reads it, flex attention's document
mask for packed rows and compiled layers (`trainer.attn_implementation`, `trainer.compile`), and the
micro-batch loop's freedom from host syncs. Two ranks with the switches on: tests/integration/trainer/
test_fsdp_equivalence.py. Speed itself: `asyncrl bench trainer --speed` (on a GPU through scripts/gpu_check.sh).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

from asyncrl.config import AlgorithmConfig, TrainerConfig
from asyncrl.trainer.engine import TrainerEngine
from asyncrl.trainer.synthetic import synthetic_batch

VOCAB = 100
ROOT = Path(__file__).resolve().parents[3]


def _engine(path: str, algorithm: AlgorithmConfig | None = None, **trainer) -> TrainerEngine:
    settings = dict(micro_batch_size=3, lr=1e-3, total_steps=10, minibatches=2, threads=1)
    return TrainerEngine(path, trainer=TrainerConfig(**{**settings, **trainer}), algorithm=algorithm or AlgorithmConfig())


def _batch(engine: TrainerEngine, seed: int = 1, rows: int = 8):
    batch = synthetic_batch(rows, vocab_size=VOCAB, seed=seed)
    # behaviour log-probs off the current policy's, so the decoupled correction's weights are not all 1
    return batch.replace(old_logprobs=(engine.compute_logprobs(batch) - 0.1) * batch.loss_mask)


def _steps(path: str, steps: int = 2, algorithm: AlgorithmConfig | None = None, **trainer) -> tuple[list[dict], dict, int]:
    """(metrics of each step, full weights after them, proximal scoring passes) of `steps` trainer steps."""
    engine = _engine(path, algorithm, **trainer)
    passes = 0
    score = engine.scorer.score_local

    def counted(model, rows):  # noqa: ANN001, ANN202
        nonlocal passes
        passes += model is engine.model
        return score(model, rows)

    try:
        batch = _batch(engine)
        engine.scorer.score_local = counted  # after the batch's own log-probs: count the step's passes only
        metrics = [engine.train_step(batch) for _ in range(steps)]
        return metrics, dict(engine.iter_full_params()), passes
    finally:
        engine.close()


def _max_diff(a: dict, b: dict) -> float:
    assert set(a) == set(b)
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_fused_adamw_one_reduction_and_the_reused_proximal_take_the_plain_step(tiny_model_path):
    plain, plain_w, plain_passes = _steps(tiny_model_path, optimizer_impl="foreach", grad_reduce="micro_batch",
                                          proximal_forward="always")
    fast, fast_w, fast_passes = _steps(tiny_model_path, optimizer_impl="fused", grad_reduce="mini_batch",
                                       proximal_forward="auto")
    for m1, m2 in zip(plain, fast, strict=True):
        for key in ("loss", "pg_loss", "entropy", "grad_norm", "correction/is_weight_mean", "ratio_max", "tokens"):
            assert abs(m1[key] - m2[key]) < 1e-5, (key, m1[key], m2[key])
    assert plain[0]["correction/is_weight_mean"] != 1.0  # the proximal log-probs mattered
    assert _max_diff(plain_w, fast_w) < 1e-5
    # 2 steps x 2 mini-batches: every mini-batch scored first, against only the second of each step
    assert (plain_passes, fast_passes) == (4, 2)


def test_each_switch_alone_equals_the_plain_step(tiny_model_path):
    plain, plain_w, _ = _steps(tiny_model_path, steps=1, proximal_forward="always")
    for switch in ({"optimizer_impl": "fused"}, {"grad_reduce": "mini_batch"}, {"proximal_forward": "auto"}):
        got, got_w, _ = _steps(tiny_model_path, steps=1, **switch)
        assert abs(got[0]["loss"] - plain[0]["loss"]) < 1e-6, switch
        assert _max_diff(plain_w, got_w) < 1e-5, switch


def test_entropy_is_not_computed_when_nothing_reads_it(tiny_model_path):
    off = AlgorithmConfig(entropy_coef=0.0, entropy_target=0.0)
    (without,), weights_without, _ = _steps(tiny_model_path, steps=1, algorithm=off)
    (with_it,), weights_with, _ = _steps(tiny_model_path, steps=1)  # the default adaptive control reads it
    assert "entropy" not in without and with_it["entropy"] > 0
    assert abs(without["loss"] - with_it["loss"]) < 1e-6  # a bonus weight of 0 either way
    assert _max_diff(weights_without, weights_with) < 1e-6


class _HostSyncs(TorchFunctionMode):
    """Counts the calls that make the host wait for the device (a value, a shape that depends on values), outside
    the model's own forward (transformers' internals are not the engine's)."""

    SYNCS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__float__, torch.Tensor.__int__,
             torch.Tensor.nonzero, torch.nonzero, torch.Tensor.cpu, torch.masked_select, torch.Tensor.masked_select,
             torch.unique, torch.Tensor.numpy}

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []
        self.in_model = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        if not self.in_model:
            indexed_by_mask = func is torch.Tensor.__getitem__ and isinstance(args[1], torch.Tensor) and args[1].dtype == torch.bool
            to_host = func is torch.Tensor.to and args[0].device.type != "cpu" and "cpu" in map(str, args[1:])  # a GPU's copy back
            if func in self.SYNCS or indexed_by_mask or to_host:
                self.seen.append(getattr(func, "__name__", str(func)))
        return func(*args, **kwargs)


def test_the_micro_batch_loop_never_waits_on_the_device(tiny_model_path):
    engine = _engine(tiny_model_path, packing=True, max_tokens_per_micro_batch=40, minibatches=1)
    try:
        batch = _batch(engine)
        mode = _HostSyncs()
        engine.model.register_forward_pre_hook(lambda *_: setattr(mode, "in_model", mode.in_model + 1))
        engine.model.register_forward_hook(lambda *_: setattr(mode, "in_model", mode.in_model - 1))
        micro_step, steps = engine._micro_step, []

        def watched(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            steps.append(1)
            with mode:
                return micro_step(*args, **kwargs)

        engine._micro_step = watched
        metrics = engine.train_step(batch)
    finally:
        engine.close()
    assert len(steps) > 1 and metrics["tokens"] > 0  # several micro-batches ran, each watched
    assert mode.seen == [], mode.seen
    # the detector itself sees a sync where there is one
    with _HostSyncs() as probe:
        torch.ones(3)[torch.tensor([True, False, True])].sum().item()
    assert probe.seen == ["__getitem__", "item"]


def kernels_check(path: str) -> dict[str, float]:
    """Flex attention's and compiled layers' figures against the plain path's (run in a process of its own by the
    test below: torch.compile must be on there, and other test modules turn it off in theirs)."""
    plain = _engine(path, packing=True)
    try:
        batch = _batch(plain, rows=6)
        want = plain.compute_logprobs(batch)
    finally:
        plain.close()
    flex = _engine(path, packing=True, attn_implementation="flex_attention")
    try:
        kernel = flex.model.config._attn_implementation
        flex_diff = (flex.compute_logprobs(batch) - want).abs().max().item()
    finally:
        flex.close()
    (eager_m,), eager_w, _ = _steps(path, steps=1, packing=True)
    from torch._dynamo.utils import counters

    graphs = counters["stats"]["unique_graphs"]
    (comp_m,), comp_w, _ = _steps(path, steps=1, packing=True, compile=True)
    return {"layer_graphs_compiled": float(counters["stats"]["unique_graphs"] - graphs), "kernel_is_flex": float(kernel == "flex_attention"), "flex_logprob_diff": flex_diff,
            "compile_loss_diff": abs(eager_m["loss"] - comp_m["loss"]), "compile_grad_norm_diff": abs(eager_m["grad_norm"] - comp_m["grad_norm"]),
            "compile_weight_diff": _max_diff(eager_w, comp_w), "grad_norm": comp_m["grad_norm"]}


def test_flex_attention_and_compiled_layers_score_as_sdpa(tiny_model_path):
    """Packed rows through flex attention's document mask, and through compiled decoder layers, give the
    plain path's log-probs. On CPU flex attention has no backward (torch raises), so its training step is
    checked on a GPU only (scripts/gpu_check.sh); compiled layers also train here. In a fresh process without
    TORCH_COMPILE_DISABLE (vLLM's test modules set it in the worker that imports them)."""
    env = {k: v for k, v in os.environ.items() if k != "TORCH_COMPILE_DISABLE"}
    code = ("import json, sys; from tests.unit.trainer.test_speed_switches import kernels_check; "
            "print('RESULT ' + json.dumps(kernels_check(sys.argv[1])))")
    done = subprocess.run([sys.executable, "-c", code, tiny_model_path], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    got = json.loads(next(l for l in done.stdout.splitlines() if l.startswith("RESULT "))[7:])
    assert got["kernel_is_flex"] == 1.0 and got["flex_logprob_diff"] < 1e-5, got
    assert got["layer_graphs_compiled"] >= 1, got  # the layers really ran compiled
    assert got["compile_loss_diff"] < 1e-6 and got["compile_grad_norm_diff"] < 1e-5 and got["grad_norm"] > 0, got
    assert got["compile_weight_diff"] < 1e-4, got  # one AdamW step: lr x sign where a gradient is ~0 either way


def test_flex_attention_without_torch_compile_is_an_error_naming_the_key(tiny_model_path, monkeypatch):
    import pytest

    monkeypatch.setenv("TORCH_COMPILE_DISABLE", "1")
    with pytest.raises(ValueError, match="trainer.attn_implementation=flex_attention needs torch.compile"):
        _engine(tiny_model_path, packing=True, attn_implementation="flex_attention")
