"""Linformer (hf_polyattn/kinds/linformer.py) against its naive per-row reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hf_polyattn import PolyAttnConfig
from hf_polyattn.kinds.linformer import LinformerAttention, linformer_reference, segment_mean_projection
from hf_polyattn.registry import get_kind

from .inputs import padding_mask, qkv

D = 8

# (id, batch, heads, kv_heads, q_len, kv_len, padding)
SHAPES = [
    ("n1", 1, 2, 2, 1, 1, None),
    ("n29-gqa", 2, 4, 2, 29, 29, None),
    ("n32-full", 2, 2, 2, 32, 32, None),
    ("n23-padleft", 2, 2, 2, 23, 23, "left"),
    ("n23-padright-gqa", 2, 4, 2, 23, 23, "right"),
    ("n20-holes-mqa", 2, 4, 1, 20, 20, "holes"),
    ("q5-kv21-padleft", 2, 4, 2, 5, 21, "left"),
    ("n9-allpad-row", 2, 2, 2, 9, 9, "all"),
]


def _config(k=6, length=32):
    return PolyAttnConfig(kind="linformer", options={"projection_length": k, "max_length": length})


def _module(heads, kv_heads, k=6, length=32, dense=False):
    mod = LinformerAttention(_config(k, length), heads, D, kv_heads, layer_idx=1).double()
    with torch.no_grad():  # move E, F off the segment means (dense: every entry; else keep the zero pattern)
        for p in mod.parameters():
            noise = 0.2 * torch.randn_like(p)
            p.add_(noise if dense else noise * (p != 0))
    return mod


@pytest.mark.parametrize("dense", [False, True], ids=["segment-pattern", "dense"])
@pytest.mark.parametrize("shape", SHAPES, ids=[s[0] for s in SHAPES])
def test_matches_reference_with_gradients(shape, dense):
    _, b, h, hkv, lq, lk, pad = shape
    mod = _module(h, hkv, dense=dense)
    q, k, v = qkv(b, h, hkv, lq, lk, D, seed=lq * 31 + lk, grad=True)
    mask = padding_mask(b, lk, pad)
    out = mod(q, k, v, causal=False, key_padding_mask=mask, scaling=0.4)
    ref = linformer_reference(mod, q, k, v, causal=False, key_padding_mask=mask, scaling=0.4)
    assert out.shape == (b, h, lq, D)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    if pad == "all":
        assert not out[0].abs().any()  # no real key: nothing to read
    g = torch.randn_like(out)
    params = list(mod.parameters())
    assert len(params) == 2
    got = torch.autograd.grad((out * g).sum(), (q, k, v, *params))
    want = torch.autograd.grad((ref * g).sum(), (q, k, v, *params))
    for name, a, e in zip(("dq", "dk", "dv", "dE", "dF"), got, want):
        assert torch.isfinite(a).all(), name
        torch.testing.assert_close(a, e, rtol=1e-9, atol=1e-11, msg=name)
    assert got[4].abs().sum() > 0  # F learns; E too once a query weighs two projected keys
    if lk > 5 and pad != "all":
        assert got[3].abs().sum() > 0


@pytest.mark.parametrize("side", ["left", "right", "holes"])
def test_padded_row_equals_unpadded_row(side):
    """Real keys meet E, F at their unpadded positions and padded ones are zeroed: a padded row's
    outputs at its real positions equal the row alone, whatever the padded tokens hold."""
    mod = _module(4, 2)
    n, extra = 13, 5
    q, k, v = qkv(1, 4, 2, n, n, D, seed=3, grad=False)
    alone = mod(q, k, v, causal=False)
    mask = torch.zeros(1, n + extra, dtype=torch.bool)
    real = {"left": torch.arange(extra, n + extra), "right": torch.arange(n),
            "holes": torch.tensor([i for i in range(n + extra) if i % 4 != 1][:n])}[side]
    mask[0, real] = True
    for fill in (0.0, 1e3):
        qp, kp, vp = (torch.full((1, t.shape[1], n + extra, D), fill, dtype=torch.float64) for t in (q, k, v))
        for src, dst in ((q, qp), (k, kp), (v, vp)):
            dst[:, :, real] = src
        padded = mod(qp, kp, vp, causal=False, key_padding_mask=mask)
        torch.testing.assert_close(padded[:, :, real], alone, rtol=1e-12, atol=1e-12)


def test_segment_mean_init_is_softmax_on_segment_constant_inputs():
    """Segment means: a projected key / value is the mean of max_length / k consecutive ones. When keys
    and values are constant inside each segment, softmax over the n tokens weights a segment by
    (size) exp(q.k), the same for every segment, so the converted layer equals softmax attention
    exactly, also for a shorter sequence (its empty segments are masked, not given weight exp(0))."""
    k_proj, length, seg = 8, 32, 4
    mod = LinformerAttention(_config(k_proj, length), 2, D).double()
    torch.testing.assert_close(mod.key_projection.detach(), segment_mean_projection(k_proj, length))
    assert torch.equal(mod.key_projection, mod.value_projection)
    for n in (32, 20):
        gen = torch.Generator().manual_seed(n)
        q = torch.randn(1, 2, n, D, generator=gen, dtype=torch.float64)
        k, v = (torch.randn(1, 2, n // seg, D, generator=gen, dtype=torch.float64).repeat_interleave(seg, 2)
                for _ in range(2))
        out = mod(q, k, v, causal=False)
        torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v), rtol=1e-12, atol=1e-12)
    # and on generic inputs, k = max_length = n (segments of one token) is softmax attention itself
    full = LinformerAttention(_config(16, 16), 2, D).double()
    q, k, v = qkv(2, 2, 2, 16, 16, D, seed=5, grad=False)
    torch.testing.assert_close(full(q, k, v, causal=False), F.scaled_dot_product_attention(q, k, v))


def test_segment_mean_projection_uneven():
    p = segment_mean_projection(3, 10)  # segments [0, 3), [3, 6), [6, 10)
    torch.testing.assert_close(p.sum(1), torch.ones(3, dtype=torch.float64))
    assert (p != 0).sum(1).tolist() == [3, 3, 4]
    assert ((p != 0).sum(0) == 1).all()  # every position in exactly one segment


def test_longer_than_max_length_is_refused():
    mod = LinformerAttention(_config(4, 16), 2, D)
    q, k, v = qkv(1, 2, 2, 17, 17, D, seed=0, grad=False, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"17 keys.*max_length=16"):
        mod(q, k, v, causal=False)
    mod(q[:, :, :16], k[:, :, :16], v[:, :, :16], causal=False)  # the limit itself is fine


def test_causal_is_refused():
    mod = LinformerAttention(_config(), 2, D)
    q, k, v = qkv(1, 2, 2, 5, 5, D, seed=0, grad=False, dtype=torch.float32)
    with pytest.raises(ValueError, match="bidirectional only"):
        mod(q, k, v, causal=True)
    with pytest.raises(ValueError, match="bidirectional only"):
        mod(q, k, v, causal=True, state=mod.init_state())


@pytest.mark.parametrize("options, name", [
    ({"projection_length": 0}, "projection_length"),
    ({"projection_length": 2.5}, "projection_length"),
    ({"max_length": 0}, "max_length"),
    ({"projection_length": 64, "max_length": 32}, "projection_length"),
    ({"window": 3}, "window"),
])
def test_bad_options(options, name):
    with pytest.raises(ValueError, match=name):
        PolyAttnConfig(kind="linformer", options=options)


def test_shared_fields_stay_default():
    for name, value in (("window", 4), ("qk_norm", True)):
        with pytest.raises(ValueError, match=name):
            PolyAttnConfig(kind="linformer", **{name: value})


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_is_finite(dtype):
    mod = LinformerAttention(_config(8, 64), 4, D, 2).to(dtype)
    q, k, v = qkv(2, 4, 2, 40, 40, D, seed=1, dtype=dtype, grad=True)
    mask = padding_mask(2, 40, "left")
    out = mod(q, k, v, causal=False, key_padding_mask=mask)
    assert out.dtype == dtype and torch.isfinite(out).all()
    out.float().sum().backward()
    for t in (q, k, v, *mod.parameters()):
        assert torch.isfinite(t.grad).all()


def test_meta_device_then_reset_parameters():
    with torch.device("meta"):
        mod = LinformerAttention(_config(5, 20), 2, D)
    assert mod.key_projection.is_meta
    mod = mod.to_empty(device="cpu")
    mod.reset_parameters()
    fresh = LinformerAttention(_config(5, 20), 2, D)
    for a, b in zip(mod.parameters(), fresh.parameters()):
        assert torch.equal(a, b)
    with torch.no_grad():
        mod.key_projection.add_(1.0)
    mod.reset_parameters()
    assert torch.equal(mod.key_projection, fresh.key_projection)


def test_spec():
    spec = get_kind("linformer")
    assert spec.module_class() is LinformerAttention and spec.reference_function() is linformer_reference
    assert not spec.causal and spec.bidirectional and "2006.04768" in spec.title
    cfg = PolyAttnConfig.for_kind("linformer", projection_length=128)
    assert cfg.options == {"projection_length": 128, "max_length": 4096}
    assert spec.table_label(cfg) == "linformer (k=128, max_length=4096)"
    for row in spec.bench.values():
        cfg = PolyAttnConfig(**row)
        LinformerAttention(cfg, 4, 64)
