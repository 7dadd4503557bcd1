"""recipes/experiments/retrieval/probe_nofar.py: while installed, a sparse-cache call runs with window_mix 0 (the
kernel part off): its output equals the same layer's with window_mix set to 0 by hand."""

from __future__ import annotations

import pytest
import torch

from hf_polyattn import PolyAttnConfig
from hf_polyattn.ops import PolyAttention, sparse
from recipes.experiments.retrieval import probe_nofar


def test_the_kernel_part_is_off(monkeypatch):
    monkeypatch.setattr(sparse.SparseMixin, "_sparse_call", sparse.SparseMixin._sparse_call)
    torch.manual_seed(0)
    cfg = PolyAttnConfig(kind="linear", window=4, sinks=1, decay="gate", window_mix=True, window_mix_init=0.5,
                         sparse_cache=2, sparse_chunk=4)
    layer = PolyAttention(cfg, head_dim=8, num_heads=2, num_kv_heads=1)
    q, k, v = torch.randn(1, 2, 24, 8), torch.randn(1, 1, 24, 8), torch.randn(1, 1, 24, 8)
    with torch.no_grad():
        with_far = layer(q, k, v, causal=True)
        layer.window_mix.zero_()
        off = layer(q, k, v, causal=True)
        layer.window_mix.fill_(0.5)
        probe_nofar.install()
        probed = layer(q, k, v, causal=True)
    assert not torch.allclose(with_far, off)
    torch.testing.assert_close(probed, off)
    assert float(layer.window_mix.detach().abs().max()) == 0.0


def test_a_layer_without_window_mix_is_refused(monkeypatch):
    monkeypatch.setattr(sparse.SparseMixin, "_sparse_call", sparse.SparseMixin._sparse_call)
    layer = PolyAttention(PolyAttnConfig(kind="linear", window=4, sparse_cache=2, sparse_chunk=4), head_dim=8,
                          num_heads=2, num_kv_heads=1)
    probe_nofar.install()
    with pytest.raises(NotImplementedError, match="window_mix"):
        layer(*(torch.randn(1, h, 12, 8) for h in (2, 1, 1)), causal=True)
