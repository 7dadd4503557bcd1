"""recipes/experiments/retrieval/probe_against_softmax.py's comparison of two models' next-token distributions."""

from __future__ import annotations

import torch

from recipes.experiments.retrieval.probe_against_softmax import divergence


def test_divergence_is_zero_for_equal_logits_and_counts_argmax_agreement():
    torch.manual_seed(0)
    base = torch.randn(5, 11)
    kl, agree = divergence(base + 3.0, base)  # a shift of every logit is the same distribution
    assert torch.allclose(kl, torch.zeros(5), atol=1e-6) and agree == 1.0
    other = base.clone()
    other[2] = -base[2]  # one position's distribution reversed: its argmax moves and its KL is positive
    kl, agree = divergence(other, base)
    assert kl[2] > 0.1 and torch.allclose(kl[[0, 1, 3, 4]], torch.zeros(4), atol=1e-6)
    assert abs(agree - 0.8) < 1e-6
    # KL(base || model) by its definition, in float32 from half-precision logits
    p, q = torch.randn(3, 7).half(), torch.randn(3, 7).half()
    ref = (q.float().softmax(-1) * (q.float().log_softmax(-1) - p.float().log_softmax(-1))).sum(-1)
    assert torch.allclose(divergence(p, q)[0], ref, atol=1e-6)
