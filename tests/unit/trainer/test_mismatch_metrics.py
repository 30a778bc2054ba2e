"""`mismatch/*`: what a step shows about training-inference mismatch, on tensors whose answer is known by construction,
reduced exactly over micro-batches and ranks, and present in a real `TrainerEngine.train_step`."""

import math

import pytest
import torch

from asyncrl.config import AlgorithmConfig, TrainerConfig
from asyncrl.trainer.corrections import Corrector
from asyncrl.trainer.mismatch import MismatchStats, mismatch_metrics, mismatch_sums
from asyncrl.trainer.rollout_corr import K3RSSettings, k3_rs

KEYS = {"mismatch/logprob_gap_mean", "mismatch/logprob_gap_max", "mismatch/k3_seq_mean", "mismatch/k3_seq_max",
        "mismatch/token_masked_share", "mismatch/token_truncated_share", "mismatch/seq_masked_share", "mismatch/ess"}
# three sequences: 3, 2 and 1 loss tokens (a tool token and padding off the mask carry wild values that must not count)
MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 1.0, 0.0], [0.0, 1.0, 0.0, 0.0]])
GAP = torch.tensor([[0.1, -0.2, 0.3, 9.0], [0.5, 7.0, -0.5, 9.0], [8.0, 0.05, 9.0, 9.0]])
"""log pi_prox - log pi_behav per token."""


def _k3(d: float) -> float:
    return math.exp(d) - 1.0 - d


def _stats(correction: str, gap: torch.Tensor = GAP, mask: torch.Tensor = MASK, **alg) -> dict[str, float]:
    behav = torch.full_like(gap, -2.0) * mask
    out = Corrector(AlgorithmConfig(correction=correction, **alg))(torch.zeros_like(gap), behav, mask, proximal_logprobs=behav + gap * mask)
    stats = MismatchStats()
    stats.add(out, mask)
    return stats.metrics()


def test_the_status_snapshot_carries_every_figure():
    from asyncrl.observe.snapshot import MISMATCH_KEYS

    assert {f"mismatch/{k}" for k in MISMATCH_KEYS} == KEYS


def test_identical_logprobs_show_no_mismatch():
    m = _stats("decoupled_ppo", gap=torch.zeros_like(GAP))
    assert set(m) == KEYS
    assert m["mismatch/ess"] == 1.0
    assert all(m[k] == 0.0 for k in KEYS - {"mismatch/ess"})


def test_a_known_gap_gives_its_figures():
    m = _stats("decoupled_ppo", is_cap=0.0)  # w = rho, nothing dropped
    gaps = [0.1, -0.2, 0.3, 0.5, -0.5, 0.05]
    assert m["mismatch/logprob_gap_mean"] == pytest.approx(sum(abs(g) for g in gaps) / 6)
    assert m["mismatch/logprob_gap_max"] == pytest.approx(0.5)
    seqs = [sum(_k3(g) for g in gaps[:3]) / 3, (_k3(0.5) + _k3(-0.5)) / 2, _k3(0.05)]
    assert m["mismatch/k3_seq_mean"] == pytest.approx(sum(seqs) / 3)
    assert m["mismatch/k3_seq_max"] == pytest.approx(max(seqs))
    w = [math.exp(g) for g in gaps]
    assert m["mismatch/ess"] == pytest.approx(sum(w) ** 2 / (6 * sum(x * x for x in w)))
    assert m["mismatch/token_masked_share"] == m["mismatch/token_truncated_share"] == m["mismatch/seq_masked_share"] == 0.0


def test_truncated_and_masked_shares_count_tokens_and_sequences():
    tis = _stats("tis", is_cap=math.exp(0.25))  # 0.3 and 0.5 capped: 2 of 6 tokens
    assert tis["mismatch/token_truncated_share"] == pytest.approx(2 / 6) and tis["mismatch/token_masked_share"] == 0.0
    w = [math.exp(g) for g in (0.1, -0.2, 0.25, 0.25, -0.5, 0.05)]
    assert tis["mismatch/ess"] == pytest.approx(sum(w) ** 2 / (6 * sum(x * x for x in w)))
    icepop = _stats("icepop", correction_args={"low": math.exp(-0.4), "high": math.exp(0.4)})  # 0.5 and -0.5 dropped: one sequence
    assert icepop["mismatch/token_masked_share"] == pytest.approx(2 / 6) and icepop["mismatch/seq_masked_share"] == pytest.approx(1 / 3)
    everything = _stats("icepop", correction_args={"low": 5.0, "high": 6.0})
    assert everything["mismatch/ess"] == 0.0 and everything["mismatch/seq_masked_share"] == 1.0


def test_k3_per_sequence_is_the_statistic_k3_rs_rejects_on():
    """Same sign and definition as verl's `seq_mean_k3`: the sequences over k3_rs's threshold are the masked ones."""
    behav = torch.full_like(GAP, -2.0) * MASK
    out = Corrector(AlgorithmConfig(correction="k3_rs", correction_args={"threshold": 0.02}))(
        torch.zeros_like(GAP), behav, MASK, proximal_logprobs=behav + GAP * MASK)
    sums, maxima = mismatch_sums(out, MASK)
    m = mismatch_metrics(sums.tolist(), maxima.tolist())
    seqs = [sum(_k3(g) for g in (0.1, -0.2, 0.3)) / 3, (_k3(0.5) + _k3(-0.5)) / 2, _k3(0.05)]  # 0.0165, 0.1276, 0.0013
    assert m["mismatch/seq_masked_share"] == pytest.approx(sum(k > 0.02 for k in seqs) / 3)
    _, _, masked = k3_rs(out.ratio, MASK, log_ratio=GAP * MASK, settings=K3RSSettings(threshold=seqs[1] * 0.999))
    assert masked[1].sum() == 2 and masked[[0, 2]].sum() == 0  # the largest k3 per sequence is the one k3_rs drops first
    assert m["mismatch/k3_seq_max"] == pytest.approx(seqs[1])


def test_halves_add_up_to_the_whole():
    """Micro-batches (or ranks) of a step add their sums and take the larger maxima: the whole batch's figures, exactly."""
    whole = _stats("tis", is_cap=1.2)
    corr = Corrector(AlgorithmConfig(correction="tis", is_cap=1.2))
    stats = MismatchStats()
    for rows in (slice(0, 2), slice(2, 3)):  # 5 loss tokens and 1
        gap, mask = GAP[rows], MASK[rows]
        behav = torch.full_like(gap, -2.0) * mask
        stats.add(corr(torch.zeros_like(gap), behav, mask, proximal_logprobs=behav + gap * mask), mask)
    assert stats.metrics() == pytest.approx(whole, rel=1e-12)
    mean_of_halves = (_stats("tis", GAP[:2], MASK[:2], is_cap=1.2)["mismatch/logprob_gap_mean"]
                      + _stats("tis", GAP[2:], MASK[2:], is_cap=1.2)["mismatch/logprob_gap_mean"]) / 2
    assert mean_of_halves != pytest.approx(whole["mismatch/logprob_gap_mean"])  # why sums, not means of means


def test_no_loss_token_gives_zeros():
    m = _stats("decoupled_ppo", mask=torch.zeros_like(MASK))
    assert all(v == 0.0 for v in m.values())


def _rank(rank: int, init: str, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    corr = Corrector(AlgorithmConfig(correction="tis", is_cap=1.2))
    rows = slice(0, 2) if rank == 0 else slice(2, 3)
    gap, mask = GAP[rows], MASK[rows]
    behav = torch.full_like(gap, -2.0) * mask
    stats = MismatchStats()
    stats.add(corr(torch.zeros_like(gap), behav, mask, proximal_logprobs=behav + gap * mask), mask)
    torch.save(stats.metrics(world=2), f"{out}.{rank}")
    from asyncrl.trainer.setup import close_process_group

    close_process_group()  # in step: a barrier before the teardown


@pytest.mark.timeout(120)
def test_two_gloo_ranks_reduce_to_the_whole(tmp_path):
    import torch.multiprocessing as mp

    out = str(tmp_path / "metrics")
    mp.spawn(_rank, args=(f"file://{tmp_path / 'store'}", out), nprocs=2)
    whole = _stats("tis", is_cap=1.2)
    for r in (0, 1):
        assert torch.load(f"{out}.{r}") == pytest.approx(whole, rel=1e-12)


def test_train_step_reports_the_mismatch_of_the_step(tiny_model_path):
    """Behavior log-probs a known 0.1 below the trainer's: every figure follows, over both mini-batches of the step."""
    from asyncrl.trainer.engine import TrainerEngine
    from asyncrl.trainer.synthetic import synthetic_batch

    batch = synthetic_batch(8, vocab_size=100, seed=4)
    trainer = TrainerConfig(micro_batch_size=3, lr=1e-3, total_steps=10, minibatches=2)
    engine = TrainerEngine(tiny_model_path, trainer=trainer, algorithm=AlgorithmConfig(correction="decoupled_ppo"))
    try:
        same = engine.train_step(batch.replace(old_logprobs=engine.compute_logprobs(batch) * batch.loss_mask))
        shifted = engine.train_step(batch.replace(old_logprobs=(engine.compute_logprobs(batch) - 0.1) * batch.loss_mask))
    finally:
        engine.close()
    assert KEYS <= set(same) and KEYS <= set(shifted)
    assert same["mismatch/logprob_gap_max"] < 1e-5 and same["mismatch/ess"] == pytest.approx(1.0, abs=1e-9)
    assert shifted["mismatch/logprob_gap_mean"] == pytest.approx(0.1, abs=1e-5)
    assert shifted["mismatch/logprob_gap_max"] == pytest.approx(0.1, abs=1e-5)
    assert shifted["mismatch/k3_seq_mean"] == pytest.approx(_k3(0.1), rel=1e-3)
    assert shifted["mismatch/ess"] == pytest.approx(1.0, abs=1e-6)
    assert shifted["mismatch/token_masked_share"] == shifted["mismatch/seq_masked_share"] == 0.0
