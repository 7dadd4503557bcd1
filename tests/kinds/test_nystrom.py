"""Nystromformer (hf_polyattn/kinds/nystrom.py) against its naive per-row reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hf_polyattn import PolyAttnConfig
from hf_polyattn.kinds.nystrom import NystromAttention, iterative_pinv, nystrom_reference
from hf_polyattn.registry import get_kind

from .inputs import padding_mask, qkv

D = 8
M = 4

# (id, batch, heads, kv_heads, q_len, kv_len, padding); M = 4 landmarks
SHAPES = [
    ("n1-exact", 1, 2, 2, 1, 1, None),
    ("n4-exact-gqa", 2, 4, 2, 4, 4, None),
    ("n16-multiple", 2, 2, 2, 16, 16, None),
    ("n29-uneven-gqa", 2, 4, 2, 29, 29, None),
    ("n23-padleft", 2, 2, 2, 23, 23, "left"),
    ("n23-padright-gqa", 2, 4, 2, 23, 23, "right"),
    ("n20-holes-mqa", 2, 4, 1, 20, 20, "holes"),
    ("n9-short-row", 2, 4, 2, 9, 9, "short"),  # row 0 keeps 3 <= M keys: exact there, Nystrom in row 1
    ("n9-allpad-row", 2, 2, 2, 9, 9, "all"),
    ("q6-kv21-padleft", 2, 4, 2, 6, 21, "left"),  # q_len != kv_len: query landmarks over all queries
]


def _config(m=M, iters=6):
    return PolyAttnConfig(kind="nystrom", options={"num_landmarks": m, "pinv_iterations": iters})


@pytest.mark.parametrize("iters", [6, 2])
@pytest.mark.parametrize("shape", SHAPES, ids=[s[0] for s in SHAPES])
def test_matches_reference_with_gradients(shape, iters):
    _, b, h, hkv, lq, lk, pad = shape
    mod = NystromAttention(_config(iters=iters), h, D, hkv, layer_idx=1).double()
    assert not list(mod.parameters())
    q, k, v = qkv(b, h, hkv, lq, lk, D, seed=lq * 31 + lk, grad=True)
    mask = padding_mask(b, lk, pad)
    out = mod(q, k, v, causal=False, key_padding_mask=mask, scaling=0.7)
    ref = nystrom_reference(mod, q, k, v, causal=False, key_padding_mask=mask, scaling=0.7)
    assert out.shape == (b, h, lq, D)
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-11)
    if pad == "all":
        assert not out[0].abs().any()
    g = torch.randn_like(out)
    got = torch.autograd.grad((out * g).sum(), (q, k, v))
    want = torch.autograd.grad((ref * g).sum(), (q, k, v))
    for name, a, e in zip(("dq", "dk", "dv"), got, want):
        assert torch.isfinite(a).all(), name
        torch.testing.assert_close(a, e, rtol=1e-8, atol=1e-10, msg=name)


@pytest.mark.parametrize("pad", [None, "left", "holes"])
def test_at_most_num_landmarks_keys_is_exact_softmax(pad):
    """n_real <= num_landmarks: every segment holds at most one key, the landmarks are the keys, and
    the output is softmax attention itself (also for a padded row, against SDPA with the mask)."""
    mod = NystromAttention(_config(m=8), 4, D, 2).double()
    n = 8 if pad is None else 11  # the padded rows keep <= 8 keys
    q, k, v = qkv(2, 4, 2, n, n, D, seed=2, grad=True)
    mask = None if pad is None else torch.ones(2, n, dtype=torch.bool)
    if pad == "left":
        mask[:, :3] = False
    elif pad == "holes":
        mask[:, 1::4] = False
    out = mod(q, k, v, causal=False, key_padding_mask=mask)
    attn_mask = None if mask is None else mask[:, None, None, :]
    want = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                          attn_mask=attn_mask)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    got = torch.autograd.grad(out.sum(), (q, k, v))
    exp = torch.autograd.grad(want.sum(), (q, k, v))
    for a, e in zip(got, exp):
        torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("side", ["left", "right", "holes"])
def test_padded_row_equals_unpadded_row(side):
    """Landmarks are means over a row's real tokens and the pseudo-inverse is per matrix: a padded
    row's outputs at its real positions equal the row alone, whatever the padded tokens hold."""
    mod = NystromAttention(_config(m=5), 4, D, 2).double()
    n, extra = 17, 6
    q, k, v = qkv(1, 4, 2, n, n, D, seed=3, grad=False)
    alone = mod(q, k, v, causal=False)
    mask = torch.zeros(2, n + extra, dtype=torch.bool)
    real = {"left": torch.arange(extra, n + extra), "right": torch.arange(n),
            "holes": torch.tensor([i for i in range(n + extra) if i % 4 != 1][:n])}[side]
    mask[0, real] = True
    mask[1] = True  # a second, unpadded row in the batch changes nothing for row 0
    for fill in (0.0, 1e3):
        qp, kp, vp = (torch.full((2, t.shape[1], n + extra, D), fill, dtype=torch.float64) for t in (q, k, v))
        for src, dst in ((q, qp), (k, kp), (v, vp)):
            dst[0:1, :, real] = src
            dst[1:2] = 5.0 * torch.randn_like(dst[1:2])
        padded = mod(qp, kp, vp, causal=False, key_padding_mask=mask)
        torch.testing.assert_close(padded[0:1, :, real], alone, rtol=1e-10, atol=1e-12)


def test_iterative_pinv():
    gen = torch.Generator().manual_seed(4)
    a = torch.softmax(torch.randn(3, 6, 6, generator=gen, dtype=torch.float64), -1)
    want = torch.linalg.pinv(a)
    torch.testing.assert_close(iterative_pinv(a, 40), want, rtol=1e-8, atol=1e-8)
    errors = [(iterative_pinv(a, i) - want).norm().item() for i in (1, 3, 6, 12)]
    assert errors == sorted(errors, reverse=True) and errors[-1] < errors[0] * 1e-3
    # rank deficient (two equal rows): the Moore-Penrose conditions A Z A = A and Z A Z = Z
    a = a.clone()
    a[:, 1] = a[:, 0]
    z = iterative_pinv(a, 60)
    torch.testing.assert_close(a @ z @ a, a, rtol=1e-7, atol=1e-7)
    torch.testing.assert_close(z @ a @ z, z, rtol=1e-7, atol=1e-7)
    assert not iterative_pinv(torch.zeros(2, 4, 4), 6).any()  # all-zero matrix: zero, not NaN


def test_approximation_improves_with_landmarks():
    """On smooth inputs (a random walk along the sequence) the error against softmax attention falls
    as landmarks are added, and m = n is exact."""
    gen = torch.Generator().manual_seed(0)
    n = 128
    walk = torch.arange(1, n + 1, dtype=torch.float64)[:, None] ** 0.5
    q, k = (torch.randn(1, 2, n, D, generator=gen, dtype=torch.float64).cumsum(2) / walk for _ in range(2))
    v = torch.randn(1, 2, n, D, generator=gen, dtype=torch.float64)
    exact = F.scaled_dot_product_attention(q, k, v)
    errors = []
    for m in (4, 16, 64, 128):
        out = NystromAttention(_config(m=m), 2, D).double()(q, k, v, causal=False)
        errors.append(((out - exact).norm() / exact.norm()).item())
    assert errors[0] > errors[1] > errors[2] > errors[3] and errors[2] < 0.15 and errors[3] < 1e-12, errors


def test_causal_is_refused():
    mod = NystromAttention(_config(), 2, D)
    q, k, v = qkv(1, 2, 2, 5, 5, D, seed=0, grad=False, dtype=torch.float32)
    with pytest.raises(ValueError, match="bidirectional only"):
        mod(q, k, v, causal=True)


@pytest.mark.parametrize("options, name", [
    ({"num_landmarks": 0}, "num_landmarks"),
    ({"num_landmarks": "64"}, "num_landmarks"),
    ({"pinv_iterations": 0}, "pinv_iterations"),
    ({"pinv_iterations": 1.5}, "pinv_iterations"),
    ({"landmarks": 8}, "landmarks"),
])
def test_bad_options(options, name):
    with pytest.raises(ValueError, match=name):
        PolyAttnConfig(kind="nystrom", options=options)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_is_finite(dtype):
    mod = NystromAttention(_config(m=8), 4, D, 2).to(dtype)
    q, k, v = qkv(2, 4, 2, 40, 40, D, seed=1, dtype=dtype, grad=True)
    out = mod(q, k, v, causal=False, key_padding_mask=padding_mask(2, 40, "left"))
    assert out.dtype == dtype and torch.isfinite(out).all()
    out.float().sum().backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()


def test_spec():
    spec = get_kind("nystrom")
    assert spec.module_class() is NystromAttention and spec.reference_function() is nystrom_reference
    assert not spec.causal and spec.bidirectional and "2102.03902" in spec.title
    cfg = PolyAttnConfig.for_kind("nystrom")
    assert cfg.options == {"num_landmarks": 64, "pinv_iterations": 6}
    assert spec.table_label(cfg) == "nystrom (m=64, pinv_iterations=6)"
    for row in spec.bench.values():
        NystromAttention(PolyAttnConfig(**row), 4, 64)
