"""RoPE attention through the polynomial method + FFT (seed 003) against its quadratic definition."""

from __future__ import annotations

import math

import pytest
import torch

from recipes.rope_fft import (
    DEFAULT_MAX_TERMS,
    exp_poly_coefficients,
    exp_poly_error_bound,
    rope_attention_reference,
    rope_fft_attention,
    rope_fft_products,
    rope_relative_matrices,
    rope_rotate,
    score_radius,
    term_count,
)

POLY = [0.5, 1.0, 0.3, -0.2]  # an arbitrary cubic: every degree and a sign change
POSITIVE_POLY = [1.0, 1.0, 0.5]  # 1 + x + x^2/2 > 0: a valid attention kernel to normalise


def _qkv(b, h, n, d, dtype=torch.float64, dv=None, lim=None):
    g = torch.Generator().manual_seed(1000 * n + d)
    if lim is None:
        q, k = torch.randn(2, b, h, n, d, generator=g, dtype=torch.float64)
    else:  # entries uniform in [-lim, lim]: the bounded-entry regime
        q, k = (torch.rand(2, b, h, n, d, generator=g, dtype=torch.float64) * 2 - 1) * lim
    v = torch.randn(b, h, n, dv or d, generator=g, dtype=torch.float64)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _general_W(n, d, dtype=torch.float64, sparse=False):
    """Random per-offset matrices (Definition 1.1), |W| <= 1; sparse: a 3-entry support."""
    g = torch.Generator().manual_seed(7 * n + d)
    W = torch.rand(2 * n - 1, d, d, generator=g, dtype=torch.float64) * 2 - 1
    if sparse:
        keep = torch.zeros(d, d, dtype=torch.bool)
        keep[0, 0] = keep[0, d - 1] = keep[d - 1, 1 % d] = True
        W = W * keep
    return W.to(dtype)


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


# ---------------------------------------------------------------------------------------------------------------
# (a) exact for a polynomial kernel


@pytest.mark.parametrize("causal", [False, True], ids=["bidir", "causal"])
@pytest.mark.parametrize("b,h,n,d", [(2, 3, 17, 2), (1, 2, 64, 4), (2, 1, 1, 2), (1, 1, 33, 4)],
                         ids=lambda x: str(x))
def test_rope_polynomial_exact_fp64(b, h, n, d, causal):
    q, k, v = _qkv(b, h, n, d, dv=3)
    ref = rope_attention_reference(q, k, v, causal=causal, kernel=POLY, normalize=False)
    fast = rope_fft_attention(q, k, v, causal=causal, kernel=POLY, normalize=False)
    assert fast.shape == (b, h, n, 3) and fast.dtype == torch.float64
    assert _rel(fast, ref) < 1e-10


@pytest.mark.parametrize("causal", [False, True], ids=["bidir", "causal"])
@pytest.mark.parametrize("sparse", [False, True], ids=["dense-W", "sparse-W"])
def test_general_W_polynomial_exact_fp64(causal, sparse):
    b, h, n, d = 2, 2, 24, 3  # odd d: the general form needs no 2 x 2 blocks
    q, k, v = _qkv(b, h, n, d)
    W = _general_W(n, d, sparse=sparse)
    ref = rope_attention_reference(q, k, v, W=W, causal=causal, kernel=POLY, normalize=False)
    fast = rope_fft_attention(q, k, v, W=W, causal=causal, kernel=POLY, normalize=False)
    assert _rel(fast, ref) < 1e-10


@pytest.mark.parametrize("causal", [False, True], ids=["bidir", "causal"])
def test_polynomial_normalised_fp32(causal):
    q, k, v = _qkv(2, 2, 64, 4, dtype=torch.float32, lim=1.0)
    ref = rope_attention_reference(q.double(), k.double(), v.double(), causal=causal, kernel=POSITIVE_POLY)
    fast = rope_fft_attention(q, k, v, causal=causal, kernel=POSITIVE_POLY)
    assert fast.dtype == torch.float32
    assert (fast.double() - ref).abs().max().item() < 1e-4
    num, den = rope_fft_products(q, k, v, causal=causal, kernel=POSITIVE_POLY)
    assert num.shape == (2, 2, 64, 4) and den.shape == (2, 2, 64, 1)
    if causal:  # row i sums i + 1 weights, each 1 + x + x^2/2 >= 1/2
        assert (den[..., 0] >= 0.5 * torch.arange(1, 65) - 1e-3).all()


def test_rope_matrices_match_rotation():
    """W_{i-j} from rope_relative_matrices gives the scores of rotated q . rotated k (sign conventions)."""
    n, d = 9, 6
    q, k, _ = _qkv(1, 1, n, d)
    W = rope_relative_matrices(n, d, theta=100.0)
    i = torch.arange(n)
    direct = torch.einsum("ia,ijac,jc->ij", q[0, 0], W[i[:, None] - i[None, :] + n - 1], k[0, 0])
    rotated = rope_rotate(q, theta=100.0)[0, 0] @ rope_rotate(k, theta=100.0)[0, 0].T
    assert torch.allclose(direct, rotated, atol=1e-12)
    assert int((W != 0).any(0).sum()) == 2 * d  # the support: 2 x 2 blocks
    # relative position only: shifting both by one position leaves the scores of the shifted pairs unchanged
    q2 = torch.cat((torch.zeros_like(q[..., :1, :]), q[..., :-1, :]), dim=-2)
    k2 = torch.cat((torch.zeros_like(k[..., :1, :]), k[..., :-1, :]), dim=-2)
    shifted = rope_rotate(q2, theta=100.0)[0, 0] @ rope_rotate(k2, theta=100.0)[0, 0].T
    assert torch.allclose(shifted[1:, 1:], rotated[:-1, :-1], atol=1e-12)


def test_reference_rope_equals_reference_W():
    q, k, v = _qkv(1, 2, 12, 4)
    W = rope_relative_matrices(12, 4)
    for causal in (False, True):
        a = rope_attention_reference(q, k, v, causal=causal)
        b = rope_attention_reference(q, k, v, W=W, causal=causal)
        assert torch.allclose(a, b, atol=1e-12)


def test_identity_W_is_plain_attention():
    """W_delta = I for every delta (the paper's hardness reduction): ordinary softmax attention."""
    q, k, v = _qkv(1, 1, 16, 4)
    W = torch.eye(4, dtype=torch.float64).expand(31, 4, 4).contiguous()
    ref = rope_attention_reference(q, k, v, W=W, causal=True)
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert torch.allclose(ref, sdpa, atol=1e-12)


# ---------------------------------------------------------------------------------------------------------------
# (b) exp kernel: error falls with the degree and stays within the stated bound


@pytest.mark.parametrize("B", [0.5, 1.0])
@pytest.mark.parametrize("causal", [False, True], ids=["bidir", "causal"])
def test_exp_error_decreases_and_within_bound(B, causal):
    d, n = 2, 48
    q, k, v = _qkv(2, 2, n, d, lim=B)
    exact = rope_attention_reference(q, k, v, causal=causal)
    radius = score_radius(B, d)
    errs = []
    for g in range(1, 9):
        fast = rope_fft_attention(q, k, v, causal=causal, degree=g, bound=B)
        err = (fast - exact).abs().max().item()
        bound = exp_poly_error_bound(g, radius)["output_abs_per_unit_v"] * v.abs().max().item()
        assert err <= bound + 1e-12, (g, err, bound)
        errs.append(err)
    assert all(later < earlier for earlier, later in zip(errs[1::2], errs[3::2])), errs
    assert errs[-1] < 1e-3 * errs[0], errs


def test_chebyshev_polynomial_meets_its_bound_on_a_grid():
    for radius in (0.5, 2.0, 4.0):
        x = torch.linspace(-radius, radius, 4001, dtype=torch.float64)
        for g in (2, 5, 8):
            for approx in ("chebyshev", "taylor"):
                c = exp_poly_coefficients(g, radius, approx=approx)
                p = sum(ct * x**t for t, ct in enumerate(c))
                err = (p - x.exp()).abs().max().item()
                bound = exp_poly_error_bound(g, radius, approx=approx)
                assert err <= bound["entry_abs"] * (1 + 1e-9) + 1e-14, (radius, g, approx, err, bound)
                assert ((p - x.exp()).abs() / x.exp()).max().item() <= bound["entry_rel"] * (1 + 1e-9) + 1e-14
    assert exp_poly_error_bound(6, 2.0)["entry_abs"] < exp_poly_error_bound(6, 2.0, approx="taylor")["entry_abs"]


def test_bound_none_uses_the_inputs_maximum():
    q, k, v = _qkv(1, 1, 20, 2, lim=0.7)
    m = max(q.abs().max().item(), k.abs().max().item())
    assert torch.equal(rope_fft_attention(q, k, v, degree=5), rope_fft_attention(q, k, v, degree=5, bound=m))


def test_general_W_exp():
    q, k, v = _qkv(1, 2, 20, 2, lim=0.8)
    W = _general_W(20, 2)
    exact = rope_attention_reference(q, k, v, W=W, causal=True)
    fast = rope_fft_attention(q, k, v, W=W, causal=True, degree=8, bound=0.8)
    radius = score_radius(0.8, 2, W=W)
    assert (fast - exact).abs().max().item() <= (exp_poly_error_bound(8, radius)["output_abs_per_unit_v"]
                                                 * v.abs().max().item())
    assert (fast - exact).abs().max().item() < 1e-5


# ---------------------------------------------------------------------------------------------------------------
# (c) causality


@pytest.mark.parametrize("kernel", ["exp", POLY], ids=["exp", "poly"])
def test_future_tokens_do_not_change_the_past(kernel):
    n, t = 40, 23
    q, k, v = _qkv(2, 2, n, 4, lim=1.0)
    kw = dict(causal=True, kernel=kernel, degree=4, bound=1.5, normalize=kernel == "exp")
    base = rope_fft_attention(q, k, v, **kw)
    g = torch.Generator().manual_seed(5)
    q2, k2, v2 = q.clone(), k.clone(), v.clone()
    for x in (q2, k2, v2):
        x[..., t:, :] = (torch.rand(x[..., t:, :].shape, generator=g, dtype=x.dtype) * 2 - 1) * 1.5
    other = rope_fft_attention(q2, k2, v2, **kw)
    assert torch.allclose(base[..., :t, :], other[..., :t, :], rtol=0, atol=1e-12)
    assert not torch.allclose(base[..., t:, :], other[..., t:, :], atol=1e-3)  # and the future did change
    # without the mask the past sees the future
    kw["causal"] = False
    assert not torch.allclose(rope_fft_attention(q, k, v, **kw)[..., :t, :],
                              rope_fft_attention(q2, k2, v2, **kw)[..., :t, :], atol=1e-3)


# ---------------------------------------------------------------------------------------------------------------
# (d) gradients


@pytest.mark.parametrize("causal", [False, True], ids=["bidir", "causal"])
def test_gradcheck(causal):
    q, k, v = (x.requires_grad_() for x in _qkv(1, 1, 5, 2, lim=0.5))

    def fast(q, k, v):
        return rope_fft_attention(q, k, v, causal=causal, degree=3, bound=1.0)

    assert torch.autograd.gradcheck(fast, (q, k, v), eps=1e-6, atol=1e-7)


@pytest.mark.parametrize("causal", [False, True], ids=["bidir", "causal"])
def test_gradients_match_reference(causal):
    q, k, v = (x.requires_grad_() for x in _qkv(2, 2, 16, 2, lim=1.0))
    W = _general_W(16, 2).requires_grad_()
    grads = []
    for fn in (rope_attention_reference, rope_fft_attention):
        out = fn(q, k, v, W=W, causal=causal, kernel=POSITIVE_POLY)
        grads.append(torch.autograd.grad((out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum(),
                                         (q, k, v, W)))
    for name, a, b in zip("qkvW", *grads):
        assert torch.allclose(a, b, atol=1e-10, rtol=1e-8), name
    # exp: the approximation's gradients approach the exact ones
    out_ref = rope_attention_reference(q, k, v, causal=causal)
    out_fast = rope_fft_attention(q, k, v, causal=causal, degree=10, bound=1.0)
    g_ref = torch.autograd.grad(out_ref.square().sum(), (q, k, v))
    g_fast = torch.autograd.grad(out_fast.square().sum(), (q, k, v))
    for name, a, b in zip("qkv", g_ref, g_fast):
        assert _rel(b, a) < 1e-5, name


# ---------------------------------------------------------------------------------------------------------------
# precision


def test_bf16_and_fp16_inputs():
    q, k, v = _qkv(2, 2, 128, 4, dtype=torch.float32, lim=1.0)
    exact = rope_attention_reference(q.double(), k.double(), v.double(), causal=True)
    for dtype in (torch.bfloat16, torch.float16):
        out = rope_fft_attention(q.to(dtype), k.to(dtype), v.to(dtype), causal=True, degree=6, bound=1.0)
        assert out.dtype == dtype
        assert torch.isfinite(out).all()
        assert (out.double() - exact).abs().max().item() < 0.05  # input rounding (bf16: 3 digits) dominates
        ref = rope_attention_reference(q.to(dtype), k.to(dtype), v.to(dtype), causal=True)
        assert ref.dtype == dtype and torch.isfinite(ref).all()


def test_fp32_exp_matches_fp64():
    q, k, v = _qkv(1, 2, 256, 4, dtype=torch.float32, lim=1.0)
    out32 = rope_fft_attention(q, k, v, causal=True, degree=6, bound=1.0)
    out64 = rope_fft_attention(q.double(), k.double(), v.double(), causal=True, degree=6, bound=1.0)
    assert (out32.double() - out64).abs().max().item() < 1e-4


# ---------------------------------------------------------------------------------------------------------------
# cost


@pytest.mark.parametrize("d,g", [(2, 3), (4, 2), (4, 4)])
def test_term_count_formula_and_cap(d, g):
    k = 2 * d
    assert term_count(k, g) == math.comb(k + g, g)
    assert term_count(k, [1.0] * (g + 1)) == math.comb(k + g, g)
    q, k_, v = _qkv(1, 1, 8, d, lim=1.0)
    rope_fft_attention(q, k_, v, degree=g, max_terms=term_count(2 * d, g))  # exactly at the cap: runs
    with pytest.raises(ValueError, match="max_terms"):
        rope_fft_attention(q, k_, v, degree=g, max_terms=term_count(2 * d, g) - 1)


def test_term_count_skips_zero_coefficients():
    assert term_count(4, [0.0, 0.0, 1.0]) == math.comb(5, 2)  # only t = 2: C(k + 1, 2)
    assert term_count(4, [1.0, 0.0, 1.0]) == 1 + math.comb(5, 2)


def test_default_cap_refuses_large_head_size():
    q, k, v = _qkv(1, 1, 4, 64)
    with pytest.raises(ValueError, match=r"max_terms=5000 is exceeded.*\d+ rescaled-Toeplitz terms"):
        rope_fft_attention(q, k, v, degree=4)
    assert term_count(128, 4) > DEFAULT_MAX_TERMS


# ---------------------------------------------------------------------------------------------------------------
# (e) bad inputs


def _good():
    return _qkv(1, 2, 8, 4, lim=1.0)


@pytest.mark.parametrize("fn", [rope_fft_attention, rope_attention_reference], ids=["fast", "reference"])
def test_shape_errors(fn):
    q, k, v = _good()
    with pytest.raises(ValueError, match=r"q must have 4 dimensions \(B, H, n, d\)"):
        fn(q[0], k, v)
    with pytest.raises(ValueError, match="q and k must have the same shape"):
        fn(q, k[..., :4, :], v)
    with pytest.raises(ValueError, match=r"v must have shape \(B, H, n, dv\)"):
        fn(q, k, v[:, :1])
    with pytest.raises(TypeError, match="k must be a torch.Tensor"):
        fn(q, k.tolist(), v)
    with pytest.raises(ValueError, match="v must be a floating-point tensor"):
        fn(q, k, v.long())
    with pytest.raises(ValueError, match=r"W must have shape \(2n - 1, d, d\) = \(15, 4, 4\)"):
        fn(q, k, v, W=torch.zeros(8, 4, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="even head size"):
        fn(q[..., :3], k[..., :3], v)
    with pytest.raises(ValueError, match="kernel must be 'exp' or a sequence"):
        fn(q, k, v, kernel="softmax")
    with pytest.raises(ValueError, match="kernel coefficient c_1 must be a finite real number"):
        fn(q, k, v, kernel=[1.0, float("nan")])
    with pytest.raises(ValueError, match="theta must be a positive finite real number"):
        fn(q, k, v, theta=-1.0)
    with pytest.raises(TypeError, match="causal must be True or False"):
        fn(q, k, v, causal="yes")


def test_parameter_errors():
    q, k, v = _good()
    with pytest.raises(ValueError, match="degree must be an integer >= 0, got nan"):
        rope_fft_attention(q, k, v, degree=float("nan"))
    with pytest.raises(ValueError, match="degree must be an integer >= 0, got 2.5"):
        rope_fft_attention(q, k, v, degree=2.5)
    with pytest.raises(TypeError, match="degree must be an integer >= 0, got '4'"):
        rope_fft_attention(q, k, v, degree="4")
    with pytest.raises(ValueError, match="degree must be an integer >= 0, got -1"):
        rope_fft_attention(q, k, v, degree=-1)
    with pytest.raises(ValueError, match="bound must be a positive finite real number or None, got -1.0"):
        rope_fft_attention(q, k, v, bound=-1.0)
    with pytest.raises(ValueError, match="bound must be a positive finite real number or None, got inf"):
        rope_fft_attention(q, k, v, bound=float("inf"))
    with pytest.raises(ValueError, match=r"bound=0.5 is smaller than the largest \|entry\|"):
        rope_fft_attention(q, k, v, bound=0.5)
    with pytest.raises(ValueError, match="scale must be a positive finite real number, got 0.0"):
        rope_fft_attention(q, k, v, scale=0.0)
    with pytest.raises(ValueError, match="approx must be 'chebyshev' or 'taylor'"):
        rope_fft_attention(q, k, v, approx="remez")
    with pytest.raises(TypeError, match="max_terms must be an integer >= 1"):
        rope_fft_attention(q, k, v, max_terms=None)
    with pytest.raises(ValueError, match="q and k must be finite"):
        rope_fft_attention(q * float("nan"), k, v)
    assert torch.equal(rope_fft_attention(q, k, v, degree=3.0), rope_fft_attention(q, k, v, degree=3))
