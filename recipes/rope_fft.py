"""RoPE / relative-position attention through the polynomial method and the FFT.

Seed document 003, "Fast RoPE attention: combining the polynomial method and FFT" (ICLR 2025 submission,
anonymous; Alman and Song's construction). The problem (their Definition 1.1, "ARAttC"): given per-offset matrices
``W_delta`` (d x d, delta = i - j in [-(n-1), n-1]) with a common support ``S`` (|S| = k entries),

    s_ij = scale * q_i^T W_{i-j} k_j,        A = f(s) entry-wise,        out = D^{-1} A V,  D = diag(A 1).

RoPE is the special case where ``W_delta`` is block-diagonal with 2 x 2 rotations (k = 2d nonzero entries).

The algorithm (paper Sections 4-5), as implemented here:

1. Split the score matrix along the support: ``s = sum_{l=(l1,l2) in S} diag(Q[:, l1]) C^l diag(K[:, l2])`` with
   ``C^l_ij = W_{i-j}[l1, l2]`` Toeplitz (Claims 4.6, 4.8). Each summand is a *rescaled Toeplitz* matrix.
2. Replace ``f = exp`` by a polynomial ``P(x) = sum_t c_t x^t`` of degree g (or take P as given).
3. Multinomial expansion (Lemma 5.2): ``P(s) = sum_m alpha_m N^(m)`` over exponent vectors ``m`` in N^k with
   ``|m| = t``, ``c_t != 0``; ``alpha_m = c_t * scale^t * t! / prod(m_l!)``. A Hadamard product of rescaled Toeplitz
   matrices is rescaled Toeplitz (Lemma 3.6): ``N^(m) = diag(prod_l Q[:, l1]^m_l) T^(m) diag(prod_l K[:, l2]^m_l)``
   with ``T^(m)_ij = prod_l W_{i-j}[l]^m_l``.
4. Each ``T^(m) x`` is a circulant product after embedding the n x n Toeplitz matrix in a circulant of size
   L = 2n (the paper writes circulant; a Toeplitz matrix is the top-left block of a 2n circulant), done with
   ``torch.fft.rfft`` / ``irfft`` in O(n log n). ``P(s) V`` and the normaliser ``P(s) 1`` come out of the same pass
   (V gets a ones column).

Causal (lower-triangular) attention: the mask keeps ``j <= i``, i.e. offsets ``delta >= 0``. The mask is itself
Toeplitz, so a Toeplitz matrix restricted to its lower triangle is still Toeplitz: every ``T^(m)`` simply has its
``delta < 0`` entries zeroed. No prefix sums, same cost.

Cost (be honest): the number of rescaled Toeplitz terms is

    terms = sum_{t : c_t != 0} C(k + t - 1, t)      which is C(k + g, g) when every coefficient is nonzero,

with k = |S| (k = 2d for RoPE), e.g. d=4, g=4 -> C(12, 4) = 495; d=4, g=8 -> C(16, 8) = 12870; d=64, g=4 ->
C(132, 4) ~ 1.2e7. Each term costs one length-2n kernel FFT and an O(B * H * (dv + 1) * n) product in the frequency
domain; the (dv + 1)-column FFTs are shared: one forward FFT per distinct K-monomial and one inverse FFT per distinct
Q-monomial (C(d + g, g) each at most, by the FFT's linearity). Time O(terms * n log n + C(d + g, g) * B * H *
(dv + 1) * n log n), memory O(C(d + g, g) * B * H * (dv + 1) * n) for the shared spectra. The paper's
almost-linear bound needs d = O(log n) and g = o(log n); at head sizes used in practice (d = 64, 128) the term count
is astronomically large, so this path is a study of the construction, not a replacement for attention kernels.
A configuration whose term count exceeds ``max_terms`` (default ``DEFAULT_MAX_TERMS``) is refused with a
ValueError before any work starts.

Note on *standard* RoPE: there W_{i-j} = R_i^T R_j, so s = (R Q)(R K)^T has rank <= d and the classic polynomial
method (tensor features of the rotated q, k) applies without any FFT. The FFT route is what the general per-offset
W (Definition 1.1, e.g. learned relative-position matrices with no product structure) needs; for RoPE it is one of
two possible routes, and this module builds RoPE's W explicitly to exercise it.

The exp kernel: ``exp_poly_coefficients(g, R)`` interpolates exp at the g + 1 Chebyshev nodes of [-R, R], where R
bounds every score. With entry bound B (``|q|, |k| <= B`` entry-wise), R = scale * B^2 * d for RoPE (rotations are
orthogonal: |q^T W k| <= |q| |k| <= d B^2) and R = scale * B^2 * max_delta sum_l |W_delta[l]| for a general W.
The bound implemented (``exp_poly_error_bound``):

    |P(x) - e^x| <= eps = R^(g+1) e^R / (2^g (g+1)!)            for |x| <= R   (Chebyshev interpolation remainder)
    eta = eps * e^R  bounds the *relative* error of every entry (e^x >= e^-R);
    |out - out_exact| <= 2 eta / (1 - eta) * max|V|              entry-wise, when eta < 1,

because each row's weights A_ij / D_i move by at most a factor (1 + e_ij) / (1 + e_i) with |e| <= eta. The paper
uses the Aggarwal-Alman polynomial (Lemma 3.1, degree Theta(max(log(1/eps) / log(log(1/eps) / B), B))); the
Chebyshev interpolant's error is at most (1 + Lebesgue constant, < 4.2 for g <= 30) times that of the best
degree-g uniform approximation, and is what is implemented here. A Taylor polynomial (``approx="taylor"``, bound
R^(g+1) e^R / (g+1)!) is available for comparison. Floating-point rounding comes on top: the monomial expansion can
cancel (terms up to e^R' in size, R' the score bound with |W| in place of W, for results as small as e^-R) and FFT
rounding is relative to a whole column, so half-precision inputs are computed in float32 (float64 inputs in
float64) and returned in their own dtype.

Shapes: q, k (B, H, n, d); v (B, H, n, dv); the output (B, H, n, dv). One sequence length n for queries and keys
(self-attention; the relative offsets i - j need it).

A study of the construction, not part of the installed package (no attention kind uses it): measured by
``recipes/rope_fft_accuracy.py``, tested by ``tests/recipes/test_rope_fft.py``.
"""

from __future__ import annotations

import itertools
import math
import numbers
from collections.abc import Sequence

import torch

__all__ = [
    "DEFAULT_MAX_TERMS",
    "exp_poly_coefficients",
    "exp_poly_error_bound",
    "rope_attention_reference",
    "rope_fft_attention",
    "rope_fft_products",
    "rope_relative_matrices",
    "rope_rotate",
    "score_radius",
    "term_count",
]

# The cap on rescaled-Toeplitz terms: d = 4 RoPE reaches it at g = 7 (C(15, 7) = 6435; g = 6 has 3003 terms),
# d = 2 at g = 17 (C(21, 17) = 5985), d = 8 at g = 5 (C(21, 5) = 20349; g = 4 has 4845). A term costs at least one
# length-2n FFT plus O(B*H*(dv+1)*n) work, so the cap keeps a call at seconds, not hours, for n ~ 1e4-1e5.
DEFAULT_MAX_TERMS = 5000
# elements of the per-chunk intermediates (B*H * chunk * (dv + 1) * 2n); bounds memory, not the result. Small chunks
# stay in cache: d = 4, g = 4, n = 32768, one thread: 0.90 s at 1 << 20, 1.15 s at 1 << 22, 1.82 s at 1 << 24.
_CHUNK_ELEMENTS = 1 << 20

# ----------------------------------------------------------------------------------------------------------------
# validation


def _check_qkv(q, k, v) -> None:
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor of shape (B, H, n, d), got {type(x).__name__}")
        if x.dim() != 4:
            raise ValueError(f"{name} must have 4 dimensions (B, H, n, d), got shape {tuple(x.shape)}")
        if not x.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")
    if q.shape != k.shape:
        raise ValueError(f"q and k must have the same shape (B, H, n, d), got q {tuple(q.shape)} and k "
                         f"{tuple(k.shape)}")
    if v.shape[:3] != q.shape[:3]:
        raise ValueError(f"v must have shape (B, H, n, dv) with (B, H, n) = {tuple(q.shape[:3])} of q, got "
                         f"{tuple(v.shape)}")
    if q.shape[2] < 1 or q.shape[3] < 1 or v.shape[3] < 1:
        raise ValueError(f"n, d and dv must be >= 1, got q {tuple(q.shape)}, v {tuple(v.shape)}")


def _check_positive_real(name: str, x, *, allow_none: bool = False) -> float | None:
    if x is None and allow_none:
        return None
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise TypeError(f"{name} must be a positive finite real number{' or None' if allow_none else ''}, "
                        f"got {x!r}")
    x = float(x)
    if not math.isfinite(x) or x <= 0:
        raise ValueError(f"{name} must be a positive finite real number{' or None' if allow_none else ''}, "
                         f"got {x!r}")
    return x


def _check_int(name: str, x, lo: int) -> int:
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise TypeError(f"{name} must be an integer >= {lo}, got {x!r}")
    if not isinstance(x, numbers.Integral):
        if not (math.isfinite(x) and float(x).is_integer()):
            raise ValueError(f"{name} must be an integer >= {lo}, got {x!r}")
        x = int(x)
    if int(x) < lo:
        raise ValueError(f"{name} must be an integer >= {lo}, got {x!r}")
    return int(x)


def _check_bool(name: str, x) -> bool:
    if not isinstance(x, bool):
        raise TypeError(f"{name} must be True or False, got {x!r}")
    return x


def _coefficients(kernel) -> list[float] | None:
    """None for 'exp', else the polynomial's monomial coefficients c_0..c_g (trailing zeros dropped)."""
    if isinstance(kernel, str):
        if kernel != "exp":
            raise ValueError(f"kernel must be 'exp' or a sequence of polynomial coefficients c_0..c_g, got {kernel!r}")
        return None
    if isinstance(kernel, torch.Tensor):
        if kernel.dim() != 1:
            raise ValueError(f"kernel coefficients must be 1-D, got shape {tuple(kernel.shape)}")
        kernel = kernel.detach().cpu().tolist()
    if not isinstance(kernel, Sequence):
        raise TypeError(f"kernel must be 'exp' or a sequence of polynomial coefficients c_0..c_g, got {kernel!r}")
    coeffs = []
    for t, c in enumerate(kernel):
        if isinstance(c, bool) or not isinstance(c, numbers.Real) or not math.isfinite(float(c)):
            raise ValueError(f"kernel coefficient c_{t} must be a finite real number, got {c!r}")
        coeffs.append(float(c))
    while coeffs and coeffs[-1] == 0.0:
        coeffs.pop()
    if not coeffs:
        raise ValueError("kernel coefficients must not all be zero (got an empty or all-zero polynomial)")
    return coeffs


def _scale(scale, d: int) -> float:
    return 1.0 / math.sqrt(d) if scale is None else _check_positive_real("scale", scale)


def _check_W(W, n: int, d: int) -> None:
    if not isinstance(W, torch.Tensor):
        raise TypeError(f"W must be a torch.Tensor of shape (2n - 1, d, d) = ({2 * n - 1}, {d}, {d}) or None, "
                        f"got {type(W).__name__}")
    if tuple(W.shape) != (2 * n - 1, d, d):
        raise ValueError(f"W must have shape (2n - 1, d, d) = ({2 * n - 1}, {d}, {d}) (W[n - 1 + delta] = W_delta, "
                         f"delta = i - j), got {tuple(W.shape)}")
    if not W.is_floating_point():
        raise ValueError(f"W must be a floating-point tensor, got dtype {W.dtype}")


def _check_rope(theta, d: int) -> float:
    theta = _check_positive_real("theta", theta)
    if d % 2:
        raise ValueError(f"RoPE (W=None) needs an even head size d, got d={d}; pass W for a general form")
    return theta


# ----------------------------------------------------------------------------------------------------------------
# RoPE's relative-position matrices


def _rope_frequencies(d: int, theta: float, dtype, device) -> torch.Tensor:
    """theta_k = theta^(-2(k-1)/d), k = 1..d/2 (the paper's alpha is our theta; RoFormer Eq. 15)."""
    return theta ** (-torch.arange(0, d, 2, dtype=torch.float64, device=device) / d).to(dtype)


def rope_rotate(x: torch.Tensor, *, theta: float = 10000.0) -> torch.Tensor:
    """RoPE applied to x (B, H, n, d): the pair (x_{2k}, x_{2k+1}) at position i rotated by i * theta_k.

    The interleaved pairing of the paper and RoFormer. Hugging Face's Llama uses the half-split pairing
    (x_k, x_{k+d/2}), a fixed permutation of the channels: permute q and k to use that layout here.
    """
    if not isinstance(x, torch.Tensor) or x.dim() != 4:
        raise ValueError(f"x must be a tensor of shape (B, H, n, d), got {getattr(x, 'shape', type(x))}")
    theta = _check_rope(theta, x.shape[-1])
    n, d = x.shape[-2:]
    freqs = _rope_frequencies(d, theta, torch.float64, x.device)
    ang = torch.arange(n, dtype=torch.float64, device=x.device)[:, None] * freqs[None, :]  # (n, d/2)
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    a, b = x[..., 0::2], x[..., 1::2]
    out = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1)
    return out.flatten(-2)


def rope_relative_matrices(n: int, d: int, *, theta: float = 10000.0, dtype=torch.float64,
                           device=None) -> torch.Tensor:
    """RoPE as the paper's general form: W (2n - 1, d, d) with W[n - 1 + delta] = W_delta, delta = i - j.

    (R_i q)^T (R_j k) = q^T R((j - i) theta_k) k per 2 x 2 block, so W_delta's block k is
    [[cos(delta theta_k), sin(delta theta_k)], [-sin(delta theta_k), cos(delta theta_k)]]: support 2d entries.
    """
    n = _check_int("n", n, 1)
    d = _check_int("d", d, 2)
    theta = _check_rope(theta, d)
    freqs = _rope_frequencies(d, theta, torch.float64, device)
    delta = torch.arange(-(n - 1), n, dtype=torch.float64, device=device)
    ang = delta[:, None] * freqs[None, :]  # (2n-1, d/2)
    cos, sin = ang.cos(), ang.sin()
    W = torch.zeros(2 * n - 1, d, d, dtype=torch.float64, device=device)
    idx = torch.arange(0, d, 2, device=device)
    W[:, idx, idx] = cos
    W[:, idx + 1, idx + 1] = cos
    W[:, idx, idx + 1] = sin
    W[:, idx + 1, idx] = -sin
    return W.to(dtype)


def score_radius(bound: float, d: int, *, scale: float | None = None, W: torch.Tensor | None = None) -> float:
    """R with |s_ij| <= R whenever every entry of q and k is at most ``bound`` in absolute value.

    RoPE (W=None): scale * d * B^2 (|q^T R k| <= |q| |k|, |q| <= sqrt(d) B). General W:
    scale * B^2 * max_delta sum_{l1,l2} |W_delta[l1, l2]|.
    """
    bound = _check_positive_real("bound", bound)
    d = _check_int("d", d, 1)
    s = _scale(scale, d)
    if W is None:
        return s * d * bound**2
    return s * bound**2 * float(W.detach().abs().sum(dim=(-1, -2)).max())


# ----------------------------------------------------------------------------------------------------------------
# the polynomial


def exp_poly_coefficients(degree: int, radius: float, *, approx: str = "chebyshev") -> list[float]:
    """Monomial coefficients c_0..c_g of a degree-g polynomial close to exp on [-radius, radius].

    ``approx="chebyshev"``: the interpolant at the g + 1 Chebyshev nodes (first kind) of [-R, R], converted to the
    monomial basis in float64 (well conditioned for the g <= 30, R <= 30 this module is meant for).
    ``approx="taylor"``: c_t = 1 / t!.
    """
    degree = _check_int("degree", degree, 0)
    radius = _check_positive_real("radius", radius)
    if approx == "taylor":
        return [1.0 / math.factorial(t) for t in range(degree + 1)]
    if approx != "chebyshev":
        raise ValueError(f"approx must be 'chebyshev' or 'taylor', got {approx!r}")
    import numpy as np

    cheb = np.polynomial.Chebyshev.interpolate(np.exp, degree, domain=[-radius, radius])
    poly = cheb.convert(kind=np.polynomial.Polynomial, domain=[-radius, radius], window=[-radius, radius])
    coeffs = [float(c) for c in poly.coef]
    return coeffs + [0.0] * (degree + 1 - len(coeffs))


def exp_poly_error_bound(degree: int, radius: float, *, approx: str = "chebyshev") -> dict:
    """The error bounds this module implements for the exp kernel (see the module docstring).

    Returns ``{"entry_abs": eps, "entry_rel": eta, "output_abs_per_unit_v": 2 eta / (1 - eta) or inf}``:
    |P(x) - e^x| <= eps on [-R, R]; every entry of P(s) within a factor (1 +- eta) of exp(s); the normalised
    output within output_abs_per_unit_v * max|V| of the exact one (entry-wise).
    """
    degree = _check_int("degree", degree, 0)
    radius = _check_positive_real("radius", radius)
    if approx not in ("chebyshev", "taylor"):
        raise ValueError(f"approx must be 'chebyshev' or 'taylor', got {approx!r}")
    g1 = degree + 1
    # logs: R^(g+1) e^R / (2^g (g+1)!) overflows floats for large g, R long before it is interesting
    log_eps = g1 * math.log(radius) + radius - math.lgamma(g1 + 1) - (degree * math.log(2) if approx == "chebyshev"
                                                                    else 0.0)
    eps = math.exp(min(log_eps, 700.0))
    eta = math.exp(min(log_eps + radius, 700.0))
    out = 2 * eta / (1 - eta) if eta < 1 else math.inf
    return {"entry_abs": eps, "entry_rel": eta, "output_abs_per_unit_v": out}


def term_count(support_size: int, kernel) -> int:
    """Rescaled-Toeplitz terms of the expansion: sum over t with c_t != 0 of C(k + t - 1, t), k = |S|.

    ``kernel``: the coefficients c_0..c_g, or an int g (all coefficients nonzero: C(k + g, g)).
    """
    k = _check_int("support_size", support_size, 1)
    if isinstance(kernel, numbers.Integral) and not isinstance(kernel, bool):
        g = _check_int("degree", kernel, 0)
        return math.comb(k + g, g)
    coeffs = _coefficients(kernel)
    if coeffs is None:
        raise ValueError("term_count needs the coefficients or the degree, not 'exp'")
    return sum(math.comb(k + t - 1, t) for t, c in enumerate(coeffs) if c != 0.0)


def _resolve_polynomial(kernel, degree, bound, approx, q, k, W, s) -> list[float]:
    coeffs = _coefficients(kernel)
    if coeffs is not None:
        return coeffs
    degree = _check_int("degree", degree, 0)
    bound = _check_positive_real("bound", bound, allow_none=True)
    observed = float(torch.maximum(q.detach().abs().max(), k.detach().abs().max()))
    if not math.isfinite(observed):
        raise ValueError("q and k must be finite (found NaN or Inf)")
    if bound is None:
        bound = max(observed, 1e-12)
    elif observed > bound * (1 + 1e-6):
        raise ValueError(f"bound={bound} is smaller than the largest |entry| of q and k ({observed:.6g}): the exp "
                         f"polynomial's error bound would not hold; pass bound >= {observed:.6g} or bound=None")
    radius = score_radius(bound, q.shape[-1], scale=s, W=W)
    return exp_poly_coefficients(degree, radius, approx=approx)


# ----------------------------------------------------------------------------------------------------------------
# the quadratic reference


def rope_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, W: torch.Tensor | None = None,
                             theta: float = 10000.0, scale: float | None = None, causal: bool = False,
                             kernel="exp", normalize: bool = True) -> torch.Tensor:
    """The n x n definition: s_ij = scale * q_i^T W_{i-j} k_j, A = f(s), out = D^{-1} A V (or A V).

    Args:
        q, k: (B, H, n, d). v: (B, H, n, dv).
        W: (2n - 1, d, d) with W[n - 1 + delta] = W_delta, delta = i - j; None: RoPE with base ``theta``
            (``rope_relative_matrices``), computed as rotated q . rotated k (the same numbers, O(n^2 d)).
        scale: multiplies the scores; None: 1 / sqrt(d). The paper's Definition 1.1 uses 1 / d.
        causal: keep j <= i only.
        kernel: "exp" (exact softmax attention; rows are max-shifted, which D^{-1} cancels) or the monomial
            coefficients c_0..c_g of a polynomial f.
        normalize: False returns A V itself (for a polynomial whose row sums may vanish).

    Returns (B, H, n, dv) in v's dtype (computed in float32 for half-precision inputs).
    """
    _check_qkv(q, k, v)
    causal = _check_bool("causal", causal)
    normalize = _check_bool("normalize", normalize)
    coeffs = _coefficients(kernel)
    n, d = q.shape[-2:]
    s = _scale(scale, d)
    out_dtype = v.dtype
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    qw, kw, vw = q.to(work), k.to(work), v.to(work)
    if W is None:
        theta = _check_rope(theta, d)
        x = rope_rotate(qw, theta=theta) @ rope_rotate(kw, theta=theta).transpose(-1, -2)
    else:
        _check_W(W, n, d)
        i = torch.arange(n, device=q.device)
        Wij = W.to(work)[(i[:, None] - i[None, :]) + n - 1]  # (n, n, d, d)
        x = torch.einsum("bhia,ijac,bhjc->bhij", qw, Wij, kw)
    x = x * s
    mask = torch.ones(n, n, dtype=torch.bool, device=q.device).tril() if causal else None
    if coeffs is None:
        if mask is not None:
            x = x.masked_fill(~mask, -math.inf)
        a = torch.exp(x - x.amax(dim=-1, keepdim=True))
    else:
        a = sum(c * x**t for t, c in enumerate(coeffs))
        a = a if torch.is_tensor(a) else torch.full_like(x, a)
        if mask is not None:
            a = a.masked_fill(~mask, 0.0)
    out = a @ vw
    if normalize:
        out = out / a.sum(dim=-1, keepdim=True)
    return out.to(out_dtype)


# ----------------------------------------------------------------------------------------------------------------
# the fast algorithm


def _support(W: torch.Tensor) -> list[tuple[int, int]]:
    """S: the (l1, l2) entries nonzero at some offset (Definition 4.2 asks for one support for all offsets)."""
    nz = (W.detach() != 0).any(dim=0)
    return [tuple(x) for x in nz.nonzero().tolist()]


def _terms(coeffs: list[float], support: list[tuple[int, int]], d: int, s: float):
    """Exponents (T, k), Q exponents (T, d), K exponents (T, d) and alpha (T,) of every term of Lemma 5.2."""
    kk = len(support)
    ms, alphas = [], []
    for t, c in enumerate(coeffs):
        if c == 0.0:
            continue
        for combo in itertools.combinations_with_replacement(range(kk), t):
            m = [0] * kk
            for idx in combo:
                m[idx] += 1
            multinomial = math.factorial(t)
            for e in m:
                multinomial //= math.factorial(e)
            ms.append(m)
            alphas.append(c * s**t * multinomial)
    m = torch.tensor(ms, dtype=torch.long).reshape(len(ms), kk)
    l1 = torch.tensor([a for a, _ in support], dtype=torch.long)
    l2 = torch.tensor([b for _, b in support], dtype=torch.long)
    eq = torch.zeros(len(ms), d, dtype=torch.long).index_add_(1, l1, m)
    ek = torch.zeros(len(ms), d, dtype=torch.long).index_add_(1, l2, m)
    return m, eq, ek, torch.tensor(alphas, dtype=torch.float64)


def _monomials(x: torch.Tensor, exps: torch.Tensor) -> torch.Tensor:
    """prod_c x[..., c]^exps[t, c] for every row t: x (..., d), exps (T, d) -> (..., T)."""
    exps = exps.to(x.device)
    out = None
    for c in range(x.shape[-1]):
        col = exps[:, c]
        top = int(col.max()) if col.numel() else 0
        if top == 0:
            continue
        xc = x[..., c: c + 1]
        powers = [torch.ones_like(xc), xc]
        for _ in range(top - 1):
            powers.append(powers[-1] * xc)
        factor = torch.cat(powers, dim=-1).index_select(-1, col)  # (..., T): x_c^e, index_select is ~10x faster
        out = factor if out is None else out * factor  # than advanced indexing here
    if out is None:
        return x.new_ones(*x.shape[:-1], exps.shape[0])
    return out


def rope_fft_products(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, W: torch.Tensor | None = None,
                      theta: float = 10000.0, scale: float | None = None, causal: bool = False, kernel="exp",
                      degree: int = 6, bound: float | None = None, approx: str = "chebyshev",
                      max_terms: int = DEFAULT_MAX_TERMS) -> tuple[torch.Tensor, torch.Tensor]:
    """P(s) V and the normaliser P(s) 1 without forming the n x n matrix (paper Sections 4-5; module docstring).

    Arguments as ``rope_fft_attention``. Returns (num (B, H, n, dv), den (B, H, n, 1)) in the compute dtype
    (float64 for float64 inputs, float32 otherwise).
    """
    _check_qkv(q, k, v)
    causal = _check_bool("causal", causal)
    max_terms = _check_int("max_terms", max_terms, 1)
    b, h, n, d = q.shape
    dv = v.shape[-1]
    s = _scale(scale, d)
    if W is None:
        theta = _check_rope(theta, d)
        W = rope_relative_matrices(n, d, theta=theta, dtype=torch.float64, device=q.device)
        w_for_radius = None
    else:
        _check_W(W, n, d)
        w_for_radius = W
    coeffs = _resolve_polynomial(kernel, degree, bound, approx, q, k, w_for_radius, s)
    support = _support(W)
    if not support:  # W = 0: every score is 0, P(s) = c_0 everywhere (masked in causal mode)
        support = [(0, 0)]
    total = sum(math.comb(len(support) + t - 1, t) for t, c in enumerate(coeffs) if c != 0.0)
    if total > max_terms:
        raise ValueError(f"max_terms={max_terms} is exceeded: the expansion has {total} rescaled-Toeplitz terms "
                         f"(sum over t with c_t != 0 of C(k + t - 1, t), support size k={len(support)}, degree "
                         f"{len(coeffs) - 1}); lower degree or d, or raise max_terms knowingly")
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    qw, kw, vw, Ww = q.to(work), k.to(work), v.to(work), W.to(work)
    m, eq, ek, alpha = _terms(coeffs, support, d, s)
    # Linearity of the FFT: every term is diag(Q^a) T diag(K^b); terms with the same K-monomial b share the forward
    # FFT of K^b * V, terms with the same Q-monomial a share one inverse FFT (their spectra add first), and terms
    # with the same (a, b) share one kernel. FFTs: #distinct b + #distinct a (<= 2 C(d + g, g)) instead of
    # 2 x terms; the per-term work left is an O(n) product-sum in the frequency domain.
    ua, ia = torch.unique(eq, dim=0, return_inverse=True)
    ub, ib = torch.unique(ek, dim=0, return_inverse=True)
    order = torch.argsort(ia, stable=True)  # terms grouped by their Q-monomial
    m, ia, ib, alpha = m[order].to(q.device), ia[order], ib[order], alpha[order].to(device=q.device, dtype=work)
    ua, ub = ua.to(q.device), ub.to(q.device)

    bh = b * h
    L = 2 * n  # Toeplitz (2n - 1 diagonals) inside a 2n circulant: no wrap-around reaches rows 0..n-1
    qf, kf = qw.reshape(bh, n, d), kw.reshape(bh, n, d)
    vext = torch.cat((vw.reshape(bh, n, dv), torch.ones(bh, n, 1, dtype=work, device=q.device)), dim=-1)
    vext = vext.transpose(1, 2)  # (bh, dv+1, n): the FFT runs over the last (contiguous) dimension
    l1 = torch.tensor([a for a, _ in support], device=q.device)
    l2 = torch.tensor([c for _, c in support], device=q.device)
    wl = Ww[:, l1, l2]  # (2n-1, k): W_delta[l] for delta = -(n-1)..n-1
    # circulant column: c[delta mod L] = t_delta; delta >= 0 at 0..n-1, delta < 0 at L-(n-1)..L-1, c[n] = 0
    circ_w = torch.cat((wl[n - 1:], torch.zeros_like(wl[:1]), wl[: n - 1]), dim=0)  # (L, k)
    # which circulant positions hold a kept offset: the mask multiplies each product kernel, not the factors
    # (a factor's zero to the power 0 is 1: the c_0 term would leak into the future)
    keep = torch.zeros(L, dtype=work, device=q.device)
    keep[:n] = 1.0
    if not causal:
        keep[n + 1:] = 1.0  # delta = i - j < 0 only without the causal mask

    # forward: FFT of K^b * [V, 1] for every distinct K-monomial b (memory O(#b * B*H * (dv+1) * n))
    x_f = []
    b_chunk = max(1, _CHUNK_ELEMENTS // max(1, bh * (dv + 1) * L))
    for start in range(0, ub.shape[0], b_chunk):
        right = _monomials(kf, ub[start:start + b_chunk])  # (bh, n, c)
        x_f.append(torch.fft.rfft(right.transpose(1, 2)[:, :, None, :] * vext[:, None, :, :], n=L))
    x_f = torch.cat(x_f, dim=1)  # (bh, #b, dv+1, L/2+1)

    out = torch.zeros(bh, dv + 1, n, dtype=work, device=q.device)
    # chunks of Q-monomials (all of their terms): kernels, frequency-domain sums, one inverse FFT per monomial
    counts = torch.bincount(ia, minlength=ua.shape[0]).tolist()
    per_term = max(1, bh * (dv + 1) * L)
    a_start, t_start = 0, 0
    while a_start < ua.shape[0]:
        a_stop, t_stop = a_start, t_start
        while a_stop < ua.shape[0] and (a_stop == a_start or (t_stop - t_start + counts[a_stop]) * per_term
                                         <= _CHUNK_ELEMENTS):
            t_stop += counts[a_stop]
            a_stop += 1
        sl = slice(t_start, t_stop)
        kern = _monomials(circ_w, m[sl]).transpose(0, 1) * (keep * alpha[sl, None])  # (c, L): alpha prod W^m
        prod = x_f.index_select(1, ib[sl]) * torch.fft.rfft(kern, n=L)[None, :, None, :]  # (bh, c, dv+1, L/2+1)
        spec = torch.zeros(bh, a_stop - a_start, dv + 1, prod.shape[-1], dtype=prod.dtype, device=q.device)
        spec = spec.index_add(1, ia[sl] - a_start, prod)
        y = torch.fft.irfft(spec, n=L)[..., :n]  # (bh, a, dv+1, n)
        left = _monomials(qf, ua[a_start:a_stop])  # (bh, n, a)
        out = out + torch.einsum("bia,bavi->bvi", left, y)
        a_start, t_start = a_stop, t_stop
    out = out.transpose(1, 2).reshape(b, h, n, dv + 1)
    return out[..., :dv], out[..., dv:]


def rope_fft_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, W: torch.Tensor | None = None,
                       theta: float = 10000.0, scale: float | None = None, causal: bool = False, kernel="exp",
                       degree: int = 6, bound: float | None = None, approx: str = "chebyshev",
                       normalize: bool = True, max_terms: int = DEFAULT_MAX_TERMS) -> torch.Tensor:
    """RoPE / general relative-position attention in O(terms * n log n): D^{-1} P(s) V without the n x n matrix.

    Args:
        q, k: (B, H, n, d). v: (B, H, n, dv).
        W: (2n - 1, d, d), W[n - 1 + delta] = W_delta (delta = i - j), the paper's Definition 1.1; its support S
            (entries nonzero at some offset) sets the term count. None: RoPE with base ``theta`` (support 2d).
        theta: RoPE base (the paper's alpha, ~1e4), used when W is None.
        scale: multiplies the scores; None: 1 / sqrt(d) (the paper uses 1 / d).
        causal: lower-triangular (j <= i); the masked Toeplitz factors stay Toeplitz.
        kernel: "exp" (approximated by a degree-``degree`` polynomial on [-R, R], R = ``score_radius(bound)``) or
            the monomial coefficients c_0..c_g of the polynomial to apply exactly (then degree/bound are unused).
        degree: g for the exp kernel.
        bound: B, the entry bound max(|q|, |k|) the exp polynomial is built for; None: the inputs' own maximum
            (detached). A bound below the inputs' maximum is refused (the error bound would not hold).
        approx: "chebyshev" (default) or "taylor" for the exp kernel.
        normalize: False returns P(s) V unnormalised.
        max_terms: refuse (ValueError) when the expansion has more terms than this (``term_count``).

    Returns (B, H, n, dv) in v's dtype. Error for the exp kernel: ``exp_poly_error_bound`` (plus rounding).
    """
    normalize = _check_bool("normalize", normalize)
    num, den = rope_fft_products(q, k, v, W=W, theta=theta, scale=scale, causal=causal, kernel=kernel,
                                 degree=degree, bound=bound, approx=approx, max_terms=max_terms)
    out = num / den if normalize else num
    return out.to(v.dtype)
