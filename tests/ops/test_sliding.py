"""Exact sliding-window softmax (``ops/sliding.py``): a model's sliding layers kept exact, against the naive
definition (every query row over every key, masked), across query tiles, with a decoding state, in half precision."""

from __future__ import annotations

import math

import pytest
import torch

from hf_polyattn.ops.sliding import TILE, SlidingWindowSoftmax, sliding_window_softmax


def _naive(q, k, v, window, causal, scale, softcap=None, mask=None):
    """softmax over the allowed keys of each query (bottom-right aligned), float64, 0 for a row without keys."""
    b, h, lq, d = q.shape
    g = h // k.shape[1]
    out = torch.zeros(b, h, lq, d, dtype=torch.float64)
    lk = k.shape[2]
    for bi in range(b):
        for hi in range(h):
            for i in range(lq):
                pos = lk - lq + i if causal else i
                keys = [j for j in range(lk) if (0 <= pos - j < window if causal else abs(pos - j) < window)
                        and (mask is None or bool(mask[bi, j]))]
                if not keys:
                    continue
                s = torch.stack([(q[bi, hi, i].double() @ k[bi, hi // g, j].double()) * scale for j in keys])
                if softcap is not None:
                    s = torch.tanh(s / softcap) * softcap
                w = torch.softmax(s, 0)
                out[bi, hi, i] = sum(w[n] * v[bi, hi // g, j].double() for n, j in enumerate(keys))
    return out


def _qkv(b=2, h=4, hkv=2, lq=9, lk=9, d=8, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(b, h, lq, d, generator=gen, dtype=dtype),
            torch.randn(b, hkv, lk, d, generator=gen, dtype=dtype),
            torch.randn(b, hkv, lk, d, generator=gen, dtype=dtype))


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("window", [1, 3, 20])
def test_equals_the_naive_definition(causal, window):
    q, k, v = _qkv()
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[1, :3] = False  # padded keys (left padding when causal)
    for softcap in (None, 2.0):
        out = sliding_window_softmax(q, k, v, window=window, causal=causal, scale=0.3, softcap=softcap,
                                     key_padding_mask=mask)
        torch.testing.assert_close(out.double(), _naive(q, k, v, window, causal, 0.3, softcap, mask), rtol=1e-5,
                                   atol=1e-6)


def test_queries_after_a_past_are_bottom_right_aligned():
    q, k, v = _qkv(lq=3, lk=10)
    out = sliding_window_softmax(q, k, v, window=4, causal=True, scale=0.5)
    torch.testing.assert_close(out.double(), _naive(q, k, v, 4, True, 0.5), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("causal", [True, False])
def test_tiles_join_without_seams(causal):
    """More queries than one tile: every query sees the keys of the tile before it within its window."""
    n = TILE + 45
    q, k, v = _qkv(b=1, h=2, hkv=1, lq=n, lk=n, d=4)
    out = sliding_window_softmax(q, k, v, window=37, causal=causal, scale=0.5)
    # the same rows one tile-free query at a time (a 1-query causal call over its window's keys is the definition)
    for i in (0, 36, TILE - 1, TILE, TILE + 1, n - 1):
        lo, hi = max(0, i - 36), (i + 1 if causal else min(n, i + 37))
        s = (q[:, :, i:i + 1] @ k[:, :, lo:hi].transpose(-1, -2)) * 0.5
        ref = torch.softmax(s, -1) @ v[:, :, lo:hi]
        torch.testing.assert_close(out[:, :, i:i + 1], ref, rtol=1e-5, atol=1e-6)


def test_decoding_state_keeps_the_last_window_minus_one_keys():
    """Chunked prefill then token-by-token decoding through the state equals one call on the whole sequence, rows
    left-padded; the state never holds more than window - 1 keys."""
    window = 5
    q, k, v = _qkv(lq=16, lk=16)
    mask = torch.ones(2, 16, dtype=torch.bool)
    mask[1, :4] = False
    layer = SlidingWindowSoftmax(window)
    full = layer(q, k, v, causal=True, scaling=0.25, key_padding_mask=mask)
    state, outs = layer.init_state(), []
    for lo, hi in [(0, 2), (2, 9), *((t, t + 1) for t in range(9, 16))]:
        out, state = layer(q[:, :, lo:hi], k[:, :, lo:hi], v[:, :, lo:hi], causal=True, scaling=0.25,
                           key_padding_mask=mask[:, lo:hi], state=state)
        outs.append(out)
        assert state.k.shape[2] == min(hi, window - 1) and state.length == hi
    torch.testing.assert_close(torch.cat(outs, 2), full, rtol=1e-5, atol=1e-6)
    assert state.nbytes() == 2 * (2 * 2 * 4 * 8 * 4) + 2 * 4  # k, v (B, Hkv, 4, D) float32 + the (B, 4) mask


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_is_finite_and_close(dtype):
    q, k, v = _qkv(dtype=dtype)
    q = q * 30  # large scores: exp overflows float16 without float32 math
    out = sliding_window_softmax(q, k, v, window=4, causal=True, scale=1.0)
    assert out.dtype == dtype and bool(torch.isfinite(out).all())
    ref = sliding_window_softmax(q.float(), k.float(), v.float(), window=4, causal=True, scale=1.0)
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)


def test_a_row_without_keys_is_zero_with_finite_gradients():
    q, k, v = (t.requires_grad_() for t in _qkv(b=1))
    mask = torch.zeros(1, 9, dtype=torch.bool)
    mask[0, 5:] = True
    out = sliding_window_softmax(q, k, v, window=3, causal=True, scale=1.0, key_padding_mask=mask)
    assert bool((out[0, :, :5] == 0).all())
    out.sum().backward()
    assert all(bool(torch.isfinite(t.grad).all()) for t in (q, k, v))


def test_causality():
    """A later key never changes an earlier query's output."""
    q, k, v = _qkv(b=1)
    base = sliding_window_softmax(q, k, v, window=4, causal=True, scale=1.0)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 6:] += 5.0
    v2[:, :, 6:] -= 5.0
    moved = sliding_window_softmax(q, k2, v2, window=4, causal=True, scale=1.0)
    torch.testing.assert_close(moved[:, :, :6], base[:, :, :6])
    assert (moved[:, :, 6:] - base[:, :, 6:]).abs().max() > 1e-2


@pytest.mark.parametrize("bad", [0, -1, 2.5, True])
def test_bad_window_refused(bad):
    with pytest.raises(ValueError, match="window must be an int >= 1"):
        SlidingWindowSoftmax(bad)


@pytest.mark.parametrize("bad", [0.0, -1.0, math.inf, "50"])
def test_bad_softcap_refused(bad):
    with pytest.raises(ValueError, match="softcap must be None or a finite number > 0"):
        SlidingWindowSoftmax(4, bad)


def test_bidirectional_needs_aligned_queries_and_keys():
    q, k, v = _qkv(lq=3, lk=9)
    with pytest.raises(ValueError, match="q_len == kv_len"):
        sliding_window_softmax(q, k, v, window=4, causal=False, scale=1.0)
