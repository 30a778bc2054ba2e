"""`asyncrl plan --validate --json` against the real cost-model bench (quick loads, ~20 s)."""

from __future__ import annotations

import json

import pytest

from asyncrl.cli import main


@pytest.mark.timeout(120)
def test_validate_prints_every_case_with_its_error(capsys):
    assert main(["plan", "--validate", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    rows = out["validation"]
    assert len(rows) == 6 and {r["kind"] for r in rows} == {"cost_model_bench"}
    for r in rows:
        assert {"case", "predicted", "measured", "rel_error"} <= set(r) and r["measured"] > 0
        assert r["rel_error"] == pytest.approx(abs(r["predicted"] - r["measured"]) / r["measured"], abs=1e-3)
    assert out["max_rel_error"] == max(r["rel_error"] for r in rows)
    assert out["max_rel_error"] < 0.5  # the 2-core host is noisy; the target (0.10) is reported, not asserted
