"""`asyncrl bench trainer --shape`: full and chunked log-probs agree, and chunking lowers the step's peak memory."""

from __future__ import annotations

import json

import pytest

from asyncrl.bench import trainer, trainer_memory


def test_tiny_shape_chunked_equals_full_and_peaks_lower(capsys):
    """`tiny`: vocabulary 16384 at hidden 64, so the logits dominate the step; 4096 tokens in chunks of 1024, fp32."""
    assert trainer.main(["--shape", "tiny", "--tokens", "4096", "--check", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert (res["shape"], res["dtype"], res["tokens"]) == ("tiny", "float32", 4096)
    full, chunked = res["rows"]
    assert (full["variant"], chunked["variant"]) == ("full", "chunked")
    assert full["peak_step_mb"] > 0 and chunked["peak_step_mb"] > 0
    assert full["logits_fp32_mb"] == 4096 * 16384 * 4 / 2**20
    assert chunked["peak_step_mb"] < full["peak_step_mb"]  # measured 0.28 of it
    assert res["peak_ratio_chunked_vs_full"] == round(chunked["peak_step_mb"] / full["peak_step_mb"], 3)
    assert res["logprob_max_abs_diff"] < 1e-5 and res["grad_max_abs_diff"] < 1e-5


def test_quick_fills_only_what_is_not_given():
    args, case = trainer_memory.parse(["--shape", "qwen2.5-7b", "--quick", "--tokens", "256"])
    assert args.check and (case.layers, case.tokens, case.logit_chunk_tokens, case.dtype) == (1, 256, 128, "float32")
    _, case = trainer_memory.parse(["--shape", "qwen2.5-7b"])
    assert (case.layers, case.tokens, case.logit_chunk_tokens, case.dtype) == (28, 4096, 1024, "bfloat16")
    assert (case.shape.hidden, case.shape.vocab, case.shape.tied) == (3584, 152064, False)


@pytest.mark.parametrize("argv, option", [(["--shape", "nope"], "--shape"), (["--shape", "tiny", "--tokens", "5"], "--tokens"),
                                          (["--shape", "tiny", "--logit-chunk-tokens", "0"], "--logit-chunk-tokens")])
def test_a_bad_option_is_a_usage_error_naming_it(argv, option, capsys):
    with pytest.raises(SystemExit) as e:
        trainer.main(argv)
    assert e.value.code == 2 and option in capsys.readouterr().err


def test_the_trainer_bench_without_shape_keeps_its_options(capsys):
    with pytest.raises(SystemExit):
        trainer.main(["--help"])
    out = capsys.readouterr().out
    assert "--shape NAME" in out and "--quick" in out and "--json" in out
