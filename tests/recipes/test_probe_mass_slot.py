"""recipes/experiments/retrieval/probe_mass_slot.py and probe_position_loss.py.

The slot's exactness check: when every key is the same vector, every key gets the same softmax weight, so one slot
holding the evicted keys' mean key and [sum v, n] gives them exactly the weight they would have had exact; with the
kernel part off (window_mix 0) each query's output is then the mean of every value up to it. The library's bounded
cache (no slot) is not: its queries past the first eviction average the kept keys alone."""

from __future__ import annotations

import pytest
import torch

from hf_polyattn import PolyAttnConfig
from hf_polyattn.ops import PolyAttention, sparse
from recipes.experiments.retrieval import probe_mass_slot
from recipes.experiments.retrieval.probe_position_loss import BUCKETS, bucket_means


@pytest.fixture(autouse=True)
def _restore(monkeypatch):
    monkeypatch.setattr(sparse.SparseMixin, "_sparse_call", sparse.SparseMixin._sparse_call)
    monkeypatch.setattr(sparse.SparseMixin, "fused_rows", sparse.SparseMixin.fused_rows)


def _layer(**kw):
    cfg = PolyAttnConfig(kind="linear", window=4, sinks=1, decay="gate", window_mix=True, window_mix_init=0.5,
                         sparse_cache=2, sparse_chunk=4, **kw)
    return PolyAttention(cfg, head_dim=8, num_heads=2, num_kv_heads=1)


def _constant_keys(n=40):
    torch.manual_seed(0)
    q = torch.randn(1, 2, n, 8)
    k = torch.randn(1, 1, 1, 8).expand(1, 1, n, 8).contiguous()
    v = torch.randn(1, 1, n, 8)
    return q, k, v


def test_the_slot_gives_evicted_keys_their_exact_weight():
    layer = _layer()
    q, k, v = _constant_keys()
    running_mean = v.cumsum(2) / torch.arange(1, v.shape[2] + 1).view(1, 1, -1, 1)
    with torch.no_grad():
        layer.window_mix.zero_()  # the kernel part off: the exact part and the slot alone
        library = layer(q, k, v, causal=True)
        probe_mass_slot.install(slot=True)
        slotted = layer(q, k, v, causal=True)
    expected = running_mean.expand(1, 2, *running_mean.shape[2:])
    torch.testing.assert_close(slotted, expected, rtol=1e-5, atol=1e-5)
    # the library's rows are exact up to query w + C - 2 = 6 (every earlier key is a sink, in the window or in the
    # pending block); from query 7 on its 2-key cache has evicted keys, whose weight it drops (the kernel part off)
    torch.testing.assert_close(library[:, :, :7], expected[:, :, :7], rtol=1e-5, atol=1e-5)
    assert ((library - expected).abs().amax(-1)[:, :, 7:] > 0.1).all()


def test_without_the_slot_the_rewrite_is_the_library():
    layer = _layer()
    torch.manual_seed(1)
    q, k, v = torch.randn(1, 2, 40, 8), torch.randn(1, 1, 40, 8), torch.randn(1, 1, 40, 8)
    with torch.no_grad():
        sparse.SparseMixin.fused_rows = False
        library = layer(q, k, v, causal=True)
        probe_mass_slot.install(slot=False)
        rewritten = layer(q, k, v, causal=True)
        probe_mass_slot.install(slot=True)
        slotted = layer(q, k, v, causal=True)
    torch.testing.assert_close(rewritten, library, rtol=0, atol=0)
    assert not torch.allclose(slotted, library)


def test_the_slot_is_causal():
    layer = _layer()
    torch.manual_seed(2)
    q, k, v = torch.randn(1, 2, 40, 8), torch.randn(1, 1, 40, 8), torch.randn(1, 1, 40, 8)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 30:] += 1.0
    v2[:, :, 30:] -= 1.0
    probe_mass_slot.install(slot=True)
    with torch.no_grad():
        a, b = layer(q, k, v, causal=True), layer(q, k2, v2, causal=True)
    torch.testing.assert_close(a[:, :, :30], b[:, :, :30], rtol=0, atol=0)
    assert not torch.allclose(a[:, :, 30:], b[:, :, 30:])


def test_a_moved_anchor_is_refused(monkeypatch):
    def _sparse_call(self, *args):  # a method without the anchors
        return None

    monkeypatch.setattr(sparse.SparseMixin, "_sparse_call", _sparse_call)
    with pytest.raises(SystemExit, match="anchor not found"):
        probe_mass_slot.install()


def test_bucket_means():
    nll = torch.arange(3000, dtype=torch.float32)
    means = bucket_means(nll)
    assert list(means) == ["0-256", "256-1024", "1024-2048", "2048-3000"]
    assert means["0-256"] == pytest.approx(127.5)
    assert means["2048-3000"] == pytest.approx((2048 + 2999) / 2)
    assert BUCKETS[0] == 0
