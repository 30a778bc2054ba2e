"""`asyncrl bench trainer --quick --json`: the command runs end to end and reports every key with sane values."""

import json
import subprocess
import sys

import pytest


@pytest.mark.timeout(180)
def test_bench_trainer_quick_json_keys():
    out = subprocess.run([sys.executable, "-m", "asyncrl.cli", "bench", "trainer", "--quick", "--json"],
                         capture_output=True, text=True, timeout=170, check=True)
    result = json.loads(out.stdout)  # stdout holds only the JSON object (progress goes to stderr)
    for key in ("packed_vs_padded_tokens_per_s", "packed_vs_padded_peak_memory", "checkpointing_peak_memory_ratio",
                "max_abs_loss_diff", "max_abs_grad_diff"):
        assert isinstance(result[key], float) and result[key] >= 0, key
    assert result["max_abs_loss_diff"] <= 1e-5 and result["max_abs_grad_diff"] <= 1e-5  # packed is the padded step
    assert set(result["cases"]) == {"padded", "packed", "checkpointing"}
    assert all(c["tokens"] == result["cases"]["padded"]["tokens"] > 0 for c in result["cases"].values())
    assert "VmHWM" in result["peak_memory"]  # says how peak memory was measured
