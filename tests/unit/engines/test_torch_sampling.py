"""torch_sampling.sample: exact frequencies from a uniform grid, filtering by top-k / top-p, and the
log-prob definition (before filtering, temperature-scaled; raw for greedy)."""

from __future__ import annotations

import torch

from asyncrl.engines.torch_sampling import draw_uniforms, sample

N = 4000


def _grid_sample(logits: torch.Tensor, temperature: float, top_k: int, top_p: float):
    """Sample one row N times with uniforms (i + 0.5) / N: token counts / N = its sampling probability."""
    rows = logits.expand(N, -1)
    uniforms = (torch.arange(N, dtype=torch.float64) + 0.5) / N
    return sample(rows, torch.full((N,), temperature), torch.full((N,), top_k), torch.full((N,), top_p), uniforms)


def _logits() -> torch.Tensor:
    return torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, 3.0]])


def test_plain_sampling_follows_the_tempered_distribution_and_reports_its_logprob():
    tokens, logprobs = _grid_sample(_logits(), 0.7, -1, 1.0)
    logp = torch.log_softmax(_logits()[0] / 0.7, -1)
    freq = torch.bincount(tokens, minlength=6).double() / N
    assert (freq - logp.exp().double()).abs().max() <= 1.5 / N * 6
    assert torch.allclose(logprobs, logp[tokens], atol=1e-6)


def test_top_k_and_top_p_filter_but_logprobs_stay_unfiltered():
    logp = torch.log_softmax(_logits()[0], -1)
    tokens, logprobs = _grid_sample(_logits(), 1.0, 2, 1.0)
    assert set(tokens.tolist()) == {5, 0}  # the two largest logits
    freq5 = (tokens == 5).double().mean()
    assert abs(freq5 - logp[5].exp() / (logp[5].exp() + logp[0].exp())) <= 2.0 / N
    assert torch.allclose(logprobs, logp[tokens], atol=1e-6)

    probs = logp.exp()  # sorted: 5 (.60), 0 (.22), 1 (.08), ...: top_p 0.75 keeps 5 and 0
    tokens, _ = _grid_sample(_logits(), 1.0, -1, 0.75)
    kept = set(tokens.tolist())
    assert kept == {5, 0} and float(probs[5]) < 0.75 < float(probs[5] + probs[0])

    tokens, _ = _grid_sample(_logits(), 1.0, 1, 1.0)
    assert set(tokens.tolist()) == {5}


def test_greedy_rows_take_argmax_and_report_raw_logprob_beside_sampled_rows():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    temperature = torch.tensor([0.0, 1.0, 0.0, 2.0, 0.0, 0.5])
    tokens, logprobs = sample(logits, temperature, torch.full((6,), -1), torch.ones(6), torch.rand(6, dtype=torch.float64))
    greedy = temperature == 0
    assert torch.equal(tokens[greedy], logits[greedy].argmax(-1))
    raw = torch.log_softmax(logits, -1).gather(1, tokens.unsqueeze(1)).squeeze(1)
    assert torch.allclose(logprobs[greedy], raw[greedy])
    scaled = torch.log_softmax(logits / temperature.clamp(min=1e-9).unsqueeze(1), -1)
    assert torch.allclose(logprobs[~greedy], scaled[~greedy].gather(1, tokens[~greedy].unsqueeze(1)).squeeze(1), atol=1e-6)


def test_draw_uniforms_depends_on_seed_only():
    assert draw_uniforms(3, 5) == draw_uniforms(3, 5) and draw_uniforms(3, 5) != draw_uniforms(4, 5)
    assert draw_uniforms(3, 8)[:5] == draw_uniforms(3, 5)  # a longer request starts the same way
    assert all(0 <= u < 1 for u in draw_uniforms(9, 100))
