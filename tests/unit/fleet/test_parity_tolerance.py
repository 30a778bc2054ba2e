"""The parity probe's tolerance by dtype: float32 on both sides is a flat 0.01; a 16-bit side (a bfloat16
`rollout.dtype` against a float32 trainer, or 16-bit both) allows 0.25 plus 2^-6 of the trainer's |log-prob|
per token, since rounding error grows with the value: a gap that is rounding on an unlikely token (-20)
passes, the same gap on a likely one (-0.5) is a corruption."""

from __future__ import annotations

from asyncrl.config import RolloutConfig, load
from asyncrl.rollout.parity import ParityCheck
from checkpoint_engine import WeightsConfig


def _check(*overrides: str) -> ParityCheck:
    cfg = load(None, list(overrides))
    check = ParityCheck.from_config(cfg.weights, cfg.model.dtype, 100, cfg.rollout)
    assert check is not None
    return check


def test_tolerance_follows_the_least_precise_side():
    assert (_check().tol, _check().rel_tol) == (0.01, 0.0)
    for overrides in (["rollout.dtype=bfloat16"], ["model.dtype=bfloat16"], ["rollout.dtype=float16", "model.dtype=float32"],
                      ["rollout.fleets=[{name: cheap, dtype: bfloat16}]"]):
        assert (_check(*overrides).tol, _check(*overrides).rel_tol) == (0.25, 2**-6), overrides
    explicit = _check("rollout.dtype=bfloat16", "weights.parity_tol=0.5")
    assert (explicit.tol, explicit.rel_tol) == (0.5, 0.0)  # a given tolerance is an absolute bound alone
    assert ParityCheck.from_config(WeightsConfig(), "float32", 100, RolloutConfig()).tol == 0.01


def test_a_16bit_gap_is_judged_against_the_log_prob_it_rounds():
    check = _check("rollout.dtype=bfloat16", "model.dtype=float32")
    assert check.judge("main-0", 1, [-20.0, -0.5], [-20.5, -0.5]) is None  # 0.5 <= 0.25 + 20 / 64
    verdict = check.judge("main-0", 2, [-20.0, -0.5], [-20.0, -1.0])  # 0.5 > 0.25 + 0.5 / 64
    assert verdict and "main-0" in verdict and "weights.parity_tol=0.25" in verdict and check.failures == 1
    assert check.judge("main-0", 3, [-20.0], [float("nan")]) is not None  # junk still fails
    flat = _check()
    assert flat.judge("main-0", 1, [-20.0], [-20.02]) is not None  # float32 both: 0.02 > 0.01
