"""`asyncrl bench trainer --speed`: the model-FLOPs formula, and the real `--quick --json` run on CPU."""

from __future__ import annotations

import doctest
import json

import pytest

from asyncrl.bench import trainer, trainer_speed
from asyncrl.bench.trainer_speed import model_flops_per_token, step_flops


def test_model_flops_per_token_by_hand():
    # hidden 8, 2 heads of 4, 1 kv head (kv width 4), intermediate 16, vocab 100, 2 layers, a sequence of 10 tokens:
    # per layer q, o 64 + 64, k, v 32 + 32, gate, up, down 3 x 128 = 576; x 2 layers + head 800 = 1952 matmul params
    # 6 x 1952 = 11712; attention 6 x 2 layers x 8 x 10 = 960
    assert model_flops_per_token(hidden=8, intermediate=16, heads=2, kv_heads=1, vocab=100, layers=2, seq_len=10) == 11712 + 960
    shape = trainer_speed.MODELS["0.5b"]
    # packing: each sequence attends to its own tokens only, so a step is the sum over sequences
    one = step_flops(shape, 24, [100])
    assert step_flops(shape, 24, [100, 300]) == one + step_flops(shape, 24, [300])
    # at the 0.5B shape: 358M in the layers' matmuls + the head (tied to the embeddings, still a matmul) 136M
    assert one / 100 == pytest.approx(6 * (358e6 + 136e6) + 6 * 24 * 896 * 100, rel=0.01)


def test_the_doctest():
    assert doctest.testmod(trainer_speed).failed == 0


def test_a_bad_switch_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        trainer.main(["--speed", "--switches", "nope"])
    assert e.value.code == 2 and "--switches" in capsys.readouterr().err


def test_quick_on_cpu(capsys):
    """Every case on the tiny model in fp32: the switches that run here give the baseline's losses."""
    assert trainer.main(["--speed", "--quick", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    for key in ("device", "model", "peak_flops_nominal", "gemm_flops_measured", "cases", "speedup_vs_baseline"):
        assert key in res, key
    assert (res["device"], res["model"], res["peak_flops_nominal"]) == ("cpu", "tiny", None)
    assert res["gemm_flops_measured"] > 0
    cases = res["cases"]
    base = cases["baseline"]
    assert "skipped" not in base and base["tokens_per_s"] > 0 and base["mfu"] is None and base["mfu_of_measured_gemm"] > 0
    assert base["max_abs_loss_diff_vs_baseline"] == 0 and res["speedup_vs_baseline"]["baseline"] == 1
    assert "backward" in cases["flex_attention"]["skipped"]
    assert cases["flash_attention_2"]["skipped"] and cases["compile"]["skipped"]
    for name in ("fused_adamw", "grad_reduce_mini_batch", "proximal_reuse"):
        c = cases[name]
        assert "skipped" not in c, (name, c)
        assert c["tokens_per_s"] > 0 and c["peak_memory_mib"] > 0 and res["speedup_vs_baseline"][name] > 0
        assert c["max_abs_loss_diff_vs_baseline"] < 1e-4, (name, c["losses"], base["losses"])
    assert cases["all"]["switches"] == ["grad_reduce_mini_batch", "fused_adamw", "proximal_reuse"]
    assert cases["all"]["max_abs_loss_diff_vs_baseline"] < 1e-4
