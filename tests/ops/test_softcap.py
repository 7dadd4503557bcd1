"""Logit soft-capping (Gemma 2's ``attn_logit_softcapping``) in a converted layer's exact parts.

Every score an exact part forms (the sliding window, the sinks and learned slots, local_exact blocks, the sparse
cache's exact keys, softmax heads, the polynomial kind's quadratic path) becomes c tanh(s q.k / c); the kernel part
phi(q).phi(k) forms none and is left as it is (``PolyAttnConfig.softcap_mode='exact_parts'``). Checked against the
naive references (``ops/reference.py``, ``hybrid_reference``), which apply the cap in their own code, with a cap of
1.0 on scores of a few units, so that a dropped cap changes every output (asserted too).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from hf_polyattn import PolyAttnConfig
from hf_polyattn.ops import HybridAttention, build_attention
from hf_polyattn.ops.hybrid import hybrid_reference, softcap_refusal, softmax_attention
from hf_polyattn.ops.sliding import sliding_window_softmax

from .test_attention import _padding_mask
from .test_window import recurrent_outputs

D = 8
CAP = 1.0
EXACT = "exact_parts"
CONFIGS = [
    ("window-sinks-gate", dict(kind="linear", window=5, sinks=2, decay="gate", decay_horizon=4.0, softcap_mode=EXACT)),
    ("window-slots-mix", dict(kind="linear", window=4, learned_sinks=2, window_mix=True, softcap_mode=EXACT)),
    ("performer-window", dict(kind="performer", num_features=16, window=4, softcap_mode=EXACT)),
    ("polysketch-blocks", dict(kind="polysketch", local_exact=True, sketch_size=6, softcap_mode=EXACT)),
    ("sparse-cache", dict(kind="linear", window=4, sinks=1, sparse_cache=3, sparse_chunk=4, softcap_mode=EXACT)),
    ("streaming", dict(kind="sliding_window", window=5, sinks=2)),  # every weight exact: the default suffices
    ("polynomial", dict(kind="polynomial", degree=2)),  # the quadratic path forms every score
    ("softmax-heads-window", dict(kind="linear", window=4, sinks=1, softmax_heads=((1, 0),), softcap_mode=EXACT)),
    ("softmax-heads-kernel", dict(kind="linear", softmax_heads=((1, 0),), softcap_mode=EXACT)),
    ("every-head-softmax", dict(kind="linear", softmax_heads=((1, 0), (1, 1)))),
]
# the configurations that serve bidirectional attention too (no sinks, decay or sparse cache)
BIDIRECTIONAL = {"window-slots-mix", "performer-window", "polysketch-blocks", "polynomial", "every-head-softmax",
                 "softmax-heads-kernel"}
NAMED = [pytest.param(name, opts, id=name) for name, opts in CONFIGS]


def _build(opts, cap=CAP):
    mod = build_attention(PolyAttnConfig(block_size=4, **opts), 4, D, 2, layer_idx=1)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # learnable tensors off their initial values: mixing, slots and gates matter
        for p in mod.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=gen))
    mod.softcap = cap
    return mod


def _reference(mod, q, k, v, causal, mask):
    """The naive definition on a float64 copy of ``mod`` (its cap included)."""
    ref = copy.deepcopy(mod).double()
    fn = hybrid_reference if isinstance(ref, HybridAttention) else ref.config.spec.reference_function()
    with torch.no_grad():
        return fn(ref, *(x.double() for x in (q, k, v)), causal=causal, key_padding_mask=mask)


def _qkv(n, seed=0, b=2, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    # scores s q.k of a few units (s = 1/sqrt(8), |q.k| ~ 8 * 3^2 / sqrt(8)): well past the cap of 1
    return [(3.0 * torch.randn(b, h, n, D, generator=gen)).to(dtype) for h in (4, 2, 2)]


@pytest.mark.parametrize("grad", [False, True], ids=["inference", "grad"])
@pytest.mark.parametrize("pad", [None, "left"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
@pytest.mark.parametrize("name,opts", NAMED)
def test_capped_layer_matches_reference(name, opts, causal, pad, grad):
    if not causal and name not in BIDIRECTIONAL:
        pytest.skip("causal only (sinks, decay, sparse cache)")
    if not causal and pad == "left":
        pad = "right"
    mod = _build(opts)
    q, k, v = _qkv(19)
    mask = _padding_mask(2, 19, pad)
    with torch.set_grad_enabled(grad):  # inference: the CPU's fused window kernel would run, were the layer uncapped
        out = mod(q, k, v, causal=causal, key_padding_mask=mask)
    ref = _reference(mod, q, k, v, causal, mask)
    torch.testing.assert_close(out.detach().double(), ref, rtol=2e-5, atol=2e-5)
    uncapped = copy.deepcopy(mod)
    uncapped.softcap = None
    # the cap matters here: a path that dropped it would be this far off
    assert (_reference(uncapped, q, k, v, causal, mask) - ref).abs().max() > 0.05


@pytest.mark.parametrize("name,opts", NAMED)
def test_decoding_equals_prefill(name, opts):
    """A prompt, then one token at a time through the layer's state (the window ring where it serves), equals the
    whole sequence in one call, capped, with left padding."""
    mod = _build(opts)
    q, k, v = _qkv(17, seed=2)
    mask = _padding_mask(2, 17, "left")
    with torch.no_grad():
        whole = mod(q, k, v, causal=True, key_padding_mask=mask)
        steps = recurrent_outputs(mod, q, k, v, [(0, 9)] + [(t, t + 1) for t in range(9, 17)], mask)
    torch.testing.assert_close(steps, whole, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name,opts", NAMED)
def test_causal(name, opts):
    """Changing the keys and values from position 11 on changes no output before it."""
    mod = _build(opts)
    q, k, v = _qkv(17, seed=3)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 11:] += 5.0
    v2[:, :, 11:] -= 5.0
    with torch.no_grad():
        a, b = mod(q, k, v, causal=True), mod(q, k2, v2, causal=True)
    torch.testing.assert_close(a[:, :, :11], b[:, :, :11], rtol=0, atol=1e-6)
    assert (a[:, :, 11:] - b[:, :, 11:]).abs().max() > 1e-3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name,opts", NAMED)
def test_half_precision(name, opts, dtype):
    """Half inputs (scores of a few units, capped at 1): finite, and near the float32 layer."""
    mod = _build(opts)
    q, k, v = _qkv(19, seed=4)
    mask = _padding_mask(2, 19, "left")
    with torch.no_grad():
        ref = mod(q, k, v, causal=True, key_padding_mask=mask)
        out = mod.to(dtype)(*(x.to(dtype) for x in (q, k, v)), causal=True, key_padding_mask=mask)
    assert out.dtype == dtype and torch.isfinite(out).all()
    # bf16 keeps 8 bits of q and k: scores of |x| ~ 10 move by ~0.04, and the polysketch blocks' degree-4 weights
    # by 4x that relatively (one element of polysketch-blocks was 0.09 off); float16 keeps 11 bits
    tol = 0.1 if dtype == torch.bfloat16 else 0.05
    torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol)


def test_window_kind_equals_the_exact_sliding_layer():
    """kind='sliding_window' with a cap is what a sliding layer kept exact computes (``ops/sliding.py``, written
    apart): the same capped softmax over the last w keys."""
    mod = _build(dict(kind="sliding_window", window=5))
    q, k, v = _qkv(23, seed=5)
    mask = _padding_mask(2, 23, "left")
    with torch.no_grad():
        out = mod(q, k, v, causal=True, key_padding_mask=mask)
    want = sliding_window_softmax(q, k, v, window=5, causal=True, scale=D**-0.5, softcap=CAP, key_padding_mask=mask)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("lq", [1, 3, 12])
def test_capped_softmax_heads_equal_the_naive_softmax(lq):
    """``softmax_attention`` with a cap: causal rows bottom-right aligned (a decoding step, a chunk after a past),
    key padding, a row without keys at 0, as the explicit formula."""
    q = 3 * torch.randn(2, 4, lq, D)
    k, v = 3 * torch.randn(2, 2, 12, D), torch.randn(2, 2, 12, D)
    mask = torch.ones(2, 12, dtype=torch.bool)
    mask[0, :11] = False  # row 0: one real key, the last
    out = softmax_attention(q, k, v, causal=True, scale=0.4, key_padding_mask=mask, softcap=2.0)
    x = 2.0 * torch.tanh((q @ k.repeat_interleave(2, 1).transpose(-1, -2)) * 0.4 / 2.0)
    keep = (torch.arange(12)[None, :] <= torch.arange(12 - lq, 12)[:, None]) & mask[:, None, None, :]
    w = torch.softmax(x.masked_fill(~keep, -math.inf), -1).nan_to_num(0.0)
    torch.testing.assert_close(out, w @ v.repeat_interleave(2, 1), rtol=1e-5, atol=1e-5)
    plain = softmax_attention(q, k, v, causal=True, scale=0.4, key_padding_mask=mask)
    assert (plain - out).abs().max() > 0.05


def test_refusals_name_the_option_and_the_reason():
    window = PolyAttnConfig(kind="linear", window=4)
    with pytest.raises(ValueError, match=r"kernel part phi\(q\)\.phi\(k\).*softcap_mode='exact_parts'"):
        build_attention(window, 4, D, 2).softcap = 50.0
    bare = PolyAttnConfig(kind="linear", softcap_mode=EXACT)  # nothing exact: the option does not help
    with pytest.raises(ValueError, match=r"no exact part in layer 0.*not even with softcap_mode='exact_parts'"):
        build_attention(bare, 4, D, 2).softcap = 50.0
    assert softcap_refusal(PolyAttnConfig(kind="linear"), 0, 2).startswith("kind='linear' has no exact part")
    with pytest.raises(ValueError, match=r"exact_path='tensor'.*use exact_path='quadratic' or 'auto'"):
        build_attention(PolyAttnConfig(kind="polynomial", degree=2, exact_path="tensor"), 4, D, 2).softcap = 50.0
    with pytest.raises(ValueError, match=r"kind='linformer' does not apply attention logit soft-capping"):
        build_attention(PolyAttnConfig(kind="linformer"), 4, D, 2).softcap = 50.0
    with pytest.raises(ValueError, match=r"softcap must be None or a finite number > 0.*got -1"):
        build_attention(window.replace(softcap_mode=EXACT), 4, D, 2).softcap = -1
    with pytest.raises(ValueError, match=r"softcap_mode.*'refuse'.*'exact_parts'"):
        PolyAttnConfig(kind="linear", window=4, softcap_mode="kernel")
    # accepted: every kv head softmax (default mode), softmax heads beside a bare kernel (the option)
    assert softcap_refusal(PolyAttnConfig(kind="linear", softmax_heads=((0, 0), (0, 1))), 0, 2) is None
    assert softcap_refusal(PolyAttnConfig(kind="linear", softmax_heads=((0, 0),), softcap_mode=EXACT), 0, 2) is None
    assert "softcap_mode='exact_parts'" in softcap_refusal(PolyAttnConfig(kind="linear", softmax_heads=((0, 0),)), 0, 2)
