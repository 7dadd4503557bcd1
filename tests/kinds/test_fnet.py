"""FNet Fourier mixing (hf_polyattn/kinds/fnet.py) against its naive cos / sin reference."""

from __future__ import annotations

import math

import pytest
import torch

from hf_polyattn import PolyAttnConfig
from hf_polyattn.kinds.fnet import FNetAttention, fnet_reference
from hf_polyattn.registry import get_kind

from .inputs import padding_mask, qkv

D = 8

# (id, batch, heads, kv_heads, len, padding)
SHAPES = [
    ("n1", 1, 2, 2, 1, None),
    ("n29-gqa", 2, 4, 2, 29, None),
    ("n23-padleft", 2, 2, 2, 23, "left"),
    ("n23-padright-gqa", 2, 4, 2, 23, "right"),
    ("n20-holes-mqa", 3, 4, 1, 20, "holes"),
    ("n9-allpad-row", 2, 2, 2, 9, "all"),
]


def _module(heads, kv_heads):
    return FNetAttention(PolyAttnConfig(kind="fnet"), heads, D, kv_heads, layer_idx=1).double()


@pytest.mark.parametrize("shape", SHAPES, ids=[s[0] for s in SHAPES])
def test_matches_reference_with_gradients(shape):
    _, b, h, hkv, n, pad = shape
    mod = _module(h, hkv)
    assert not list(mod.parameters())
    q, k, v = qkv(b, h, hkv, n, n, D, seed=n, grad=True)
    mask = padding_mask(b, n, pad)
    out = mod(q, k, v, causal=False, key_padding_mask=mask)
    ref = fnet_reference(mod, q, k, v, causal=False, key_padding_mask=mask)
    assert out.shape == (b, h, n, D)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    if mask is not None:
        assert not out.masked_select(~mask[:, None, :, None]).any()  # padded query positions return 0
    g = torch.randn_like(out)
    got = torch.autograd.grad((out * g).sum(), (q, k, v), allow_unused=True)
    want = torch.autograd.grad((ref * g).sum(), v)[0]
    assert got[0] is None and got[1] is None  # queries and keys are unused
    torch.testing.assert_close(got[2], want, rtol=1e-10, atol=1e-12)


def test_definition_and_scaling():
    """Re of the orthonormal 2-D DFT: a constant c over n x d maps to sqrt(n d) c at frequency (0, 0)
    and 0 elsewhere (the same energy at every n); the transform never increases the Frobenius norm;
    the heads of one kv group agree."""
    mod = _module(4, 2)
    for n in (5, 64):
        v = torch.full((1, 2, n, D), 3.0, dtype=torch.float64)
        out = mod(torch.zeros(1, 4, n, D, dtype=torch.float64), v, v, causal=False)
        want = torch.zeros_like(out)
        want[:, :, 0, 0] = 3.0 * math.sqrt(n * D)
        torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
        assert torch.allclose(out[:, 0].norm(), v[:, 0].norm())
    q, k, v = qkv(2, 4, 2, 37, 37, D, seed=5, grad=False)
    out = mod(q, k, v, causal=False)
    assert (out.norm(dim=(2, 3)) <= v.repeat_interleave(2, 1).norm(dim=(2, 3)) + 1e-12).all()
    torch.testing.assert_close(out[:, 0], out[:, 1])
    assert not torch.allclose(out[:, 1], out[:, 2])


@pytest.mark.parametrize("side", ["left", "right", "holes"])
def test_padded_row_equals_unpadded_row(side):
    """The DFT of a row runs over its real tokens only: its outputs at the real positions equal the row
    alone, whatever the padded tokens hold, next to rows of other lengths."""
    mod = _module(2, 2)
    n, extra = 13, 5
    q, k, v = qkv(1, 2, 2, n, n, D, seed=3, grad=False)
    alone = mod(q, k, v, causal=False)
    mask = torch.ones(3, n + extra, dtype=torch.bool)
    real = {"left": torch.arange(extra, n + extra), "right": torch.arange(n),
            "holes": torch.tensor([i for i in range(n + extra) if i % 4 != 1][:n])}[side]
    mask[0] = False
    mask[0, real] = True
    mask[2, :4] = False  # a third length in the batch
    for fill in (0.0, 1e3):
        qp, kp, vp = (torch.full((3, 2, n + extra, D), fill, dtype=torch.float64) for _ in range(3))
        for src, dst in ((q, qp), (k, kp), (v, vp)):
            dst[0:1, :, real] = src
            dst[1:] = torch.randn_like(dst[1:])
        padded = mod(qp, kp, vp, causal=False, key_padding_mask=mask)
        torch.testing.assert_close(padded[0:1, :, real], alone, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(padded[1:2], mod(qp[1:2], kp[1:2], vp[1:2], causal=False), rtol=1e-12,
                                   atol=1e-12)


def test_causal_and_cross_lengths_are_refused():
    mod = _module(2, 2).float()
    q, k, v = qkv(1, 2, 2, 5, 5, D, seed=0, grad=False, dtype=torch.float32)
    with pytest.raises(ValueError, match="bidirectional only"):
        mod(q, k, v, causal=True)
    with pytest.raises(ValueError, match="q_len == kv_len"):
        mod(q[:, :, :3], k, v, causal=False)


def test_no_options():
    with pytest.raises(ValueError, match="num_landmarks"):
        PolyAttnConfig(kind="fnet", options={"num_landmarks": 8})
    with pytest.raises(ValueError, match="window"):
        PolyAttnConfig(kind="fnet", window=4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_is_finite(dtype):
    mod = _module(4, 2).to(dtype)
    q, k, v = qkv(2, 4, 2, 40, 40, D, seed=1, dtype=dtype, grad=True)
    out = mod(q, k, v, causal=False, key_padding_mask=padding_mask(2, 40, "left"))
    assert out.dtype == dtype and torch.isfinite(out).all()
    out.float().sum().backward()
    assert torch.isfinite(v.grad).all()


def test_spec():
    spec = get_kind("fnet")
    assert spec.module_class() is FNetAttention and spec.reference_function() is fnet_reference
    assert not spec.causal and spec.bidirectional and "2105.03824" in spec.title
    cfg = PolyAttnConfig.for_kind("fnet")
    assert cfg.options == {} and spec.table_label(cfg) == "fnet"
    for row in spec.bench.values():
        FNetAttention(PolyAttnConfig(**row), 4, 64)
