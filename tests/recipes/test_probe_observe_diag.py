"""recipes/experiments/retrieval/probe_observe_diag.py's ``--evict``: the streaming selection keeps the candidates the
library would evict ('reverse') or a seeded random draw ('random'), and nothing else of the selection changes."""

from __future__ import annotations

import pytest
import torch

from hf_polyattn.ops import sparse
from recipes.experiments.retrieval.probe_observe_diag import install_eviction


def _candidates():
    torch.manual_seed(0)
    kv = torch.rand(1, 1, 6, 5)  # an empty state would give |v| as the error: a real one ranks by recall
    feats, vext = torch.rand(1, 1, 8, 6), torch.randn(1, 1, 8, 5)
    vext[..., -1] = 1.0
    valid = torch.ones(1, 1, 8, dtype=torch.bool)
    return kv, feats, vext, valid


def _kept(budget=3):
    kv, feats, vext, valid = _candidates()
    return sparse.select_and_fold(kv, feats, vext, valid, budget)[1].flatten().tolist()


def test_reverse_keeps_what_the_library_evicts(monkeypatch):
    monkeypatch.setattr(sparse, "recall_error", sparse.recall_error)
    kv, feats, vext, _ = _candidates()
    err = sparse.recall_error(kv, feats, vext).flatten()
    library = _kept()
    assert library == sorted(err.topk(3).indices.tolist())
    install_eviction("reverse")
    assert _kept() == sorted(err.neg().topk(3).indices.tolist())
    assert not set(_kept()) & set(library)


def test_random_is_seeded_and_differs_from_the_library(monkeypatch):
    monkeypatch.setattr(sparse, "recall_error", sparse.recall_error)  # restored after the test
    original = sparse.recall_error
    library = _kept()
    draws = []
    for _ in range(2):
        sparse.recall_error = original
        install_eviction("random", seed=3)
        draws.append([_kept() for _ in range(4)])
    assert draws[0] == draws[1]  # the same seed, the same draws
    assert any(kept != library for kept in draws[0])


def test_an_unknown_mode_is_refused(monkeypatch):
    monkeypatch.setattr(sparse, "recall_error", sparse.recall_error)
    with pytest.raises(ValueError, match="mode must be"):
        install_eviction("lola")
