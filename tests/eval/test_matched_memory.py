"""The matched-memory baseline (eval/long_context.matched_memory_config): the sparse cache on a softmax model's own
attention is exact softmax over the sinks, the window and the selected keys (against a naive softmax over the keys
the sparse cache's definition keeps), its memory is bounded, and the eval rows build it and StreamingLLM with as
many keys."""

from __future__ import annotations

import math

import pytest
import torch

import hf_polyattn  # noqa: F401  (registers the kinds)
from hf_polyattn.eval.long_context import (
    BASELINES,
    LongContextSettings,
    _matched,
    _streaming_matched,
    matched_memory_config,
)
from hf_polyattn.ops import build_attention
from hf_polyattn.ops.reference import _kernel_inputs, _sink_keys, _sparse_exact

D, N = 8, 64


def _module(cfg, heads=4, kv_heads=2):
    return build_attention(cfg, heads, D, kv_heads, layer_idx=0).to(torch.float64)


def _naive(pa, q, k, v):
    """softmax(q k^T / sqrt(d)) v over the keys the definition keeps: causal and (window, sinks or the sparse cache,
    its pending block included), nothing else: no kernel, no other normaliser."""
    cfg = pa.config
    q5, k5, _ = _kernel_inputs(pa, q, k, None)
    fk = pa.feature_map(k5, False)
    s = 1.0 / math.sqrt(D)
    g = q.shape[1] // k.shape[1]
    x_obs = (q5 @ k5.transpose(-1, -2)) * s  # (B, Hkv, G, L, L)
    kept = _sparse_exact(pa, fk, v, None, q.shape[2], x_obs)[:, :, 0]  # (B, Hkv, L, L)
    pos = torch.arange(N)
    dist = pos[:, None] - pos[None, :]
    window = (dist >= 0) & (dist < cfg.window)
    sinks = _sink_keys(cfg, None, q.shape[0], N, q.device)[:, :, 0, 0]  # (B, 1, L)
    keep = (window | kept | sinks[:, :, None, :]) & (dist >= 0)
    keep = keep.repeat_interleave(g, dim=1)
    x = (q @ k.repeat_interleave(g, dim=1).transpose(-1, -2)) * s
    w = torch.softmax(x.masked_fill(~keep, float("-inf")), dim=-1)
    return w @ v.repeat_interleave(g, dim=1), keep


@pytest.mark.parametrize("selection", [{}, {"sparse_observe": 8, "sparse_observe_pool": 3},
                                       {"sparse_observe": 8, "sparse_value_keys": 2, "sparse_value_pool": 3}])
def test_the_sparse_cache_on_softmax_is_exact_softmax_over_its_keys(selection):
    cfg = matched_memory_config(6, sinks=2, window=8, sparse_chunk=4, **selection)
    pa = _module(cfg)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, N, D, generator=gen, dtype=torch.float64) for h in (4, 2, 2))
    with torch.no_grad():
        got = pa(q, k, v, causal=True)
    want, keep = _naive(pa, q, k, v)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    # bounded: beyond the sinks and the window, at most the budget + a pending block of sparse_chunk - 1 keys
    beyond = keep.sum(-1) - torch.minimum(torch.arange(N) + 1, torch.tensor(8)) - 2
    assert beyond.max() <= 6 + 4 - 1 and beyond.max() >= 6  # and the cache is used
    # not a window in disguise: a smaller budget changes the output
    small = _module(matched_memory_config(2, sinks=2, window=8, sparse_chunk=4, **selection))
    with torch.no_grad():
        assert (small(q, k, v, causal=True) - got).abs().max() > 1e-3


def test_matched_config_copies_the_evaluated_models_rules_and_takes_the_budget():
    like = hf_polyattn.PolyAttnConfig.for_kind("linear", window=64, sinks=4, sink_position="own", sparse_cache=512,
                                               sparse_chunk=32, sparse_score="attention", sparse_observe=16)
    cfg = matched_memory_config(256, like=like)
    assert (cfg.kind, cfg.window_mix, cfg.window_mix_init) == ("linear", True, 0.0)
    assert (cfg.window, cfg.sinks, cfg.sink_position, cfg.sparse_chunk, cfg.sparse_observe) == (64, 4, "own", 32, 16)
    assert cfg.sparse_cache == 256
    s = LongContextSettings(contexts=(64,), baselines=("sparse", "streaming_matched"))
    assert _matched(s, like)[0] == 512 and _streaming_matched(s, like) == (4, 64 + 512)
    s2 = LongContextSettings(contexts=(64,), matched_cache=100, streaming_window=32)
    assert _matched(s2, None)[1].sparse_cache == 100 and _streaming_matched(s2, None) == (4, 132)
    assert "132-token window" in BASELINES["streaming_matched"](s2) and "100 selected keys" in BASELINES["sparse"](s2)
    with pytest.raises(ValueError, match="sparse_cache must be an int >= 1"):
        matched_memory_config(0)
    with pytest.raises(ValueError, match="like must be a PolyAttnConfig with sparse_cache"):
        matched_memory_config(8, like=hf_polyattn.PolyAttnConfig.for_kind("linear", window=8))
    with pytest.raises(ValueError, match="matched_cache"):
        LongContextSettings(contexts=(64,), matched_cache=0)


def test_sliding_window_refusing_a_sparse_cache_names_the_matched_builder():
    with pytest.raises(ValueError, match=r"does not read sparse_cache .*matched_memory_config"):
        hf_polyattn.PolyAttnConfig.for_kind("sliding_window", window=8, sparse_cache=4)
