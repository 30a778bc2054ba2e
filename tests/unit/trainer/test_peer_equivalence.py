"""asyncrl's verl / AReaL corrections and losses equal the peers' own functions on the peers' inputs.

The numbers in tests/data/peers/*.json were made by running the peers' released code
(tests/data/peers/make_peer_numbers.py; no network here). Each case goes through the trainer's entry points:
`Corrector(AlgorithmConfig(...))`, the `POLICY_LOSSES` entry with the config's settings, and `agg_loss` with
the peer's loss normaliser (verl and AReaL's M2PO leave rejected tokens out of it; asyncrl's engine counts them,
so only that denominator is taken from the peer). Values, per-token weights and terms, and the gradient w.r.t.
the current log-probs agree to 1e-6 in fp64.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from asyncrl.config import AlgorithmConfig
from asyncrl.trainer.corrections import Corrector
from asyncrl.trainer.losses import POLICY_LOSSES, LossInputs, agg_loss

PEERS = Path(__file__).resolve().parents[2] / "data" / "peers"
FILES = sorted(PEERS.glob("*.json"))
CASES = [(f.stem, i, c) for f in FILES for i, c in enumerate(json.loads(f.read_text())["cases"])]
TOL = dict(rtol=1e-6, atol=1e-6)


def run_asyncrl(case: dict) -> dict[str, torch.Tensor]:
    """One micro-batch as `TrainerEngine.forward_backward` computes its policy term."""
    x = {k: torch.tensor(v, dtype=torch.float64) for k, v in case["inputs"].items()}
    alg = AlgorithmConfig(correction=case["correction"], correction_args=case["correction_args"], loss=case["loss"],
                          loss_args=case["loss_args"], clip_ratio_low=0.2, clip_ratio_high=0.2)
    corrector, policy_loss = Corrector(alg), POLICY_LOSSES.get(alg.loss)
    logp = x["logp"].clone().requires_grad_(True)
    mask = x["mask"]
    corr = corrector(logp, x["behav"], mask, proximal_logprobs=x["prox"] if corrector.needs_proximal else None)
    inputs = LossInputs.of(logp, x["behav"], x["adv"], mask, proximal_logprobs=corr.proximal_logprobs,
                           clip_ratio_low=alg.clip_ratio_low, clip_ratio_high=alg.clip_ratio_high)
    if "rng_seed" in case:
        torch.manual_seed(case["rng_seed"])
    out = policy_loss(inputs, alg.loss_settings())
    token_loss = out.loss * corr.weight * mask
    value = agg_loss(out.loss * corr.weight, mask, policy_loss.agg(alg.loss_agg), num_tokens=case["outputs"]["denominator"])
    value.backward()
    return {"weight": corr.weight * mask, "token_loss": token_loss.detach(), "value": value.detach(), "grad": logp.grad}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("peer,index,case", CASES, ids=[f"{p}-{i}-{c['correction']}-{c['loss']}" for p, i, c in CASES])
def test_matches_the_peer(peer: str, index: int, case: dict) -> None:
    got = run_asyncrl(case)
    want = {k: torch.tensor(v, dtype=torch.float64) for k, v in case["outputs"].items() if k != "denominator"}
    for key in ("weight", "token_loss", "value", "grad"):
        torch.testing.assert_close(got[key], want[key], **TOL, msg=lambda m, key=key: f"{case['function']} {key}: {m}")


def test_the_peer_numbers_are_there_and_not_trivial() -> None:
    assert {f.stem for f in FILES} >= {"verl_0.9.1", "areal_1.0.4"}
    assert sum(f.stat().st_size for f in FILES) < 300_000
    names = {c["correction"] for _, _, c in CASES} | {c["loss"] for _, _, c in CASES}
    assert names >= {"token_tis", "seq_tis", "seq_mis", "icepop", "geo_rs", "k3_rs", "m2po", "clip_cov", "kl_cov", "reinforce"}
    for _, _, c in CASES:  # every case exercises its rule: some token weighted below 1 / dropped / clipped, some not
        w = torch.tensor(c["outputs"]["weight"])
        m = torch.tensor(c["inputs"]["mask"]) > 0
        if c["correction"] != "none":
            assert (w[m] != 1).any() and (w[m] != 0).any(), c["function"]
        if c["correction"] in ("seq_mis", "icepop", "geo_rs", "k3_rs", "m2po"):
            assert (w[m] == 0).any(), f"{c['function']}: no token rejected"
    for form in ("decoupled", "bypass"):
        assert any(c["correction_args"].get("form", "decoupled") == form for _, _, c in CASES if c["correction"] != "none")


def test_verl_config_of_each_case_selects_the_same_correction() -> None:
    """A verl recipe's `algorithm.rollout_correction` keys load as the asyncrl entry each case was checked with."""
    from asyncrl.config.algorithm import RolloutCorrectionConfig

    for _, _, c in CASES:
        if c["peer"] != "verl" or c["correction"] == "none":
            continue
        keys = dict(c["peer_settings"])
        if "form" in c["correction_args"]:
            keys["bypass_mode"] = True
        alg = AlgorithmConfig(rollout_correction=RolloutCorrectionConfig(**keys))
        assert (alg.correction, alg.correction_args, alg.loss) == (c["correction"], c["correction_args"], c["loss"]), c["function"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("alg", [
    dict(correction="seq_mis", loss="clip_cov", loss_args={"clip_cov_ratio": 0.1, "clip_cov_lb": 0.0}),
    dict(correction="geo_rs", correction_args={"low": 0.9, "high": 1.1, "tis": "sequence"}, loss="kl_cov"),
    dict(correction="icepop", correction_args={"form": "bypass"}, loss="reinforce"),
    dict(correction="m2po", correction_args={"m2_threshold": 0.01}, proximal="interpolate"),
], ids=["seq_mis-clip_cov", "geo_rs-kl_cov", "icepop-bypass-reinforce", "m2po-interpolate"])
def test_each_runs_in_a_trainer_step(tiny_model_path, alg):
    """Selected by config, the entries run through `TrainerEngine.train_step` and log their correction statistics."""
    from asyncrl.config import TrainerConfig
    from asyncrl.trainer.engine import TrainerEngine
    from asyncrl.trainer.synthetic import synthetic_batch

    batch = synthetic_batch(6, vocab_size=100, seed=5)
    engine = TrainerEngine(tiny_model_path, trainer=TrainerConfig(micro_batch_size=3, total_steps=4),
                           algorithm=AlgorithmConfig(**alg))
    try:
        stale = engine.compute_logprobs(batch) + 0.05 * torch.randn(batch.loss_mask.shape) * batch.loss_mask
        metrics = engine.train_step(batch.replace(old_logprobs=stale, token_versions=torch.zeros_like(batch.loss_mask, dtype=torch.long)))
    finally:
        engine.close()
    assert all(torch.isfinite(torch.tensor(v)) for k, v in metrics.items() if isinstance(v, float)), metrics
    assert any(k.endswith("correction/weight_mean") for k in metrics), sorted(metrics)
