"""The decayed causal product, row i = sum_{j <= i} exp(qlog_i - klog_j) (phi(a_i).phi(b_j)) c_j, on every backend
(``backend.lt_product``: loop, batched, triton; ``causal.lt_multiply_cumsum``) against its naive twin
``ops.reference.reference_lt_product``: values and the gradients of a, b, c, qlog and klog."""

from __future__ import annotations

import pytest
import torch

from hf_polyattn.ops.backend import lt_product
from hf_polyattn.ops.causal import (
    decay_matrix,
    decayed_running_sums,
    lt_multiply,
    lt_multiply_batched,
    lt_multiply_cumsum,
)
from hf_polyattn.ops.reference import reference_lt_product
from hf_polyattn.ops.sketches import symmetric_square
from hf_polyattn.ops.window import shifted_lt

# the Triton kernels accumulate in fp32 (the interpreter's dots are exact fp32 products): fp32 tolerances
FP32_TOL = dict(rtol=1e-4, atol=1e-4)
NAMES = ("a", "b", "c", "qlog", "klog")


def _triton_device() -> str:
    """The device the Triton kernels run on here (a GPU, or the CPU under the interpreter that tests/conftest.py
    sets up); skips the test where they cannot run."""
    pytest.importorskip("triton")
    from tests.ops.triton_setup import DEVICE  # skips the test when the kernels cannot run on this machine

    return DEVICE


def _on(backend, xs):
    """xs as the backend takes them: float64 on the CPU for the PyTorch backends, float32 leaves on the kernels'
    device for 'triton' (float64 is refused there); and the tolerance of the comparison."""
    if backend != "triton":
        return xs, dict(rtol=1e-10, atol=1e-10)
    device = _triton_device()
    return [x.detach().to(device, torch.float32).requires_grad_() for x in xs], FP32_TOL


def _inputs(n, r, e, lead_a, lead_bc, seed, strength=0.3, dtype=torch.float64):
    """a, b, c and log-decays under the contract: klog = cumsum of log-gates in [-strength, 0) per kv head (b's and
    c's leading dims), qlog = klog minus up to 0.3 per query row (a's leading dims: query groups apart); in
    ``dtype``, leaf tensors."""
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(*lead_a, n, r, generator=gen, dtype=torch.float64)
    b = torch.randn(*lead_bc, n, r, generator=gen, dtype=torch.float64)
    c = torch.randn(*lead_bc, n, e, generator=gen, dtype=torch.float64)
    klog = (-strength * torch.rand(*lead_bc, n, generator=gen, dtype=torch.float64)).cumsum(-1)
    qlog = klog - 0.3 * torch.rand(*lead_a, n, generator=gen, dtype=torch.float64)
    return [x.to(dtype).requires_grad_() for x in (a, b, c, qlog, klog)]


def _run(backend, a, b, c, qlog, klog, block, diag, square):
    if backend == "cumsum":  # the per-token path takes features and always includes the diagonal
        fa, fb = (symmetric_square(a), symmetric_square(b)) if square else (a, b)
        return lt_multiply_cumsum(fa, fb, c, 4, decay=(qlog, klog))
    return lt_product(a, b, c, block, diag, square, backend, decay=(qlog, klog))


def _as64(xs):
    """float64 CPU leaf copies of xs: the reference sees the values the backend saw (fp32 log-decays of -1200 are
    rounded by 2^-13, as much as the tolerances)."""
    return [x.detach().cpu().double().requires_grad_() for x in xs]


def _check(out, ref, xs, x64, tol, what=""):
    """out (from xs) against ref (from x64 = _as64(xs)): values and every gradient."""
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.cpu().double(), ref, **tol)
    g = torch.randn(ref.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    got = torch.autograd.grad(out, xs, g.to(out.device, out.dtype))
    want = torch.autograd.grad(ref, x64, g)
    for name, x, y, inp in zip(NAMES, got, want, xs):
        assert x.shape == inp.shape and x.dtype == inp.dtype and torch.isfinite(x).all()
        torch.testing.assert_close(x.cpu().double(), y, **tol, msg=lambda m, nm=name: f"{what} d{nm}: {m}")


CASES = [
    # id, n, block, include_diag, square, lead_a, lead_bc (a size-1 group axis on b, c: grouped-query attention)
    ("n37-b8-gqa", 37, 8, True, False, (2, 2, 2), (2, 2, 1)),
    ("n37-b8-gqa-square", 37, 8, True, True, (2, 2, 2), (2, 2, 1)),
    ("n37-b8-gqa-nodiag", 37, 8, False, False, (2, 2, 2), (2, 2, 1)),
    ("n37-b8-gqa-nodiag-square", 37, 8, False, True, (2, 2, 2), (2, 2, 1)),
    ("n32-b8-multiple", 32, 8, True, True, (1, 3), (1, 1)),
    ("n5-lt-block", 5, 8, True, True, (1, 3), (1, 1)),
    ("n5-lt-block-nodiag", 5, 8, False, False, (3,), (3,)),
    ("b1", 9, 1, True, False, (2, 2), (2, 1)),
    ("b1-nodiag-square", 9, 1, False, True, (2, 2), (2, 1)),
    ("n1", 1, 4, True, True, (2,), (1,)),
    # 69 blocks / Triton chunks: more than one group of the decayed scan over them (causal.SCAN_GROUP = 64)
    ("n1100-b16-scan-groups", 1100, 16, True, False, (2,), (1,)),
]
BACKENDS = ["loop", "batched", "cumsum", "triton"]


@pytest.mark.parametrize("case,backend", [
    pytest.param(case, backend, id=f"{case[0]}-{backend}") for case in CASES for backend in BACKENDS
    if case[3] or backend != "cumsum"  # the per-token path has no dropped diagonal blocks
])
def test_matches_reference(case, backend):
    _, n, block, diag, square, lead_a, lead_bc = case
    xs, tol = _on(backend, _inputs(n, 3, 4, lead_a, lead_bc, seed=n * 10 + block))
    x64 = _as64(xs)
    out = _run(backend, *xs, block, diag, square)
    _check(out, reference_lt_product(*x64[:3], block, diag, square, tuple(x64[3:])), xs, x64, tol, backend)


@pytest.mark.parametrize("fn", [lt_multiply, lt_multiply_batched], ids=["loop", "batched"])
@pytest.mark.parametrize("square", [False, True], ids=["identity", "square"])
@pytest.mark.parametrize("diag", [True, False], ids=["diag", "nodiag"])
def test_gradcheck(fn, diag, square):
    xs = _inputs(11, 3, 2, (1, 2, 2), (1, 2, 1), seed=3)
    assert torch.autograd.gradcheck(lambda a, b, c, q, k: fn(a, b, c, 4, diag, square, (q, k)), tuple(xs))


@pytest.mark.parametrize("backend", ["loop", "batched", "triton"])
def test_shifted_product(backend):
    """A window's far part: row i sums keys j <= i - w with exp(G_i - G_j), G of the keys (window.shifted_lt)."""
    n, w = 29, 5
    a, b, c, _, g = _inputs(n, 3, 4, (2, 2, 2), (2, 2, 1), seed=5)
    xs, tol = _on(backend, [a, b, c, g])
    x64 = _as64(xs)
    a, b, c, g64 = x64
    out = shifted_lt(*xs[:3], w, 4, False, backend, decay=xs[3])
    i = torch.arange(n)
    keep = i[None, :] <= i[:, None] - w
    x = (g64.unsqueeze(-1) - g64.unsqueeze(-2)).masked_fill(~keep, float("-inf"))
    ref = ((a @ b.transpose(-1, -2)) * torch.exp(x)) @ c
    assert torch.isfinite(out).all() and not out[..., :w, :].any()
    torch.testing.assert_close(out.cpu().double(), ref, **tol)
    gr = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    for name, u, v in zip(("a", "b", "c", "G"), torch.autograd.grad(out, xs, gr.to(out.device, out.dtype)),
                          torch.autograd.grad(ref, x64, gr)):
        torch.testing.assert_close(u.cpu().double(), v, **tol, msg=lambda m, nm=name: f"d{nm}: {m}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("square", [False, True], ids=["identity", "square"])
def test_strong_decay_is_finite_and_exact(backend, square):
    """Gates near 0 (log g = -30 a token: G reaches -1200 over 40 tokens, exp(G) underflows) and large features: no
    NaN or Inf anywhere (every exponent taken is <= 0), values and gradients as the reference's."""
    xs, tol = _on(backend, _inputs(40, 3, 4, (2, 2), (2, 1), seed=9, strength=60.0))  # log-gates: mean -30
    x64 = _as64(xs)
    out = _run(backend, *xs, 8, True, square)
    _check(out, reference_lt_product(*x64[:3], 8, True, square, tuple(x64[3:])), xs, x64, tol, backend)


@pytest.mark.parametrize("backend", ["loop", "batched", "triton"])
def test_bf16_inputs(backend):
    """bf16 a, b, c with fp32 log-decays: the PyTorch backends compute in fp32, the kernels accumulate in fp32; the
    result matches the float64 product of the same (bf16-rounded) values; gradients come back in each input's
    dtype, bf16-rounded (relative error <= 2^-9: 2^-8 allowed)."""
    device = _triton_device() if backend == "triton" else "cpu"
    xs = [x.detach().to(device, torch.bfloat16 if i < 3 else torch.float32).requires_grad_()
          for i, x in enumerate(_inputs(37, 4, 5, (2, 2), (2, 1), seed=11))]
    x64 = _as64(xs)
    for square in (False, True):
        ref = reference_lt_product(*x64[:3], 8, True, square, tuple(x64[3:]))
        if backend == "triton":
            # the kernels' dots at fp32 accuracy here (tf32=False): half inputs take tf32 dots by default on a GPU,
            # whose 2^-11 operand rounding bounds a gradient by the sizes of its terms, not by its own, so a
            # cancelling element misses an elementwise bound (dA by 3% at one element on an H100,
            # recipes/results/SECTION_gpu_h100_scan.md); that default is checked normwise below
            out = lt_product(*xs[:3], 8, True, square, backend, tf32=False, decay=tuple(xs[3:]))
            _tf32_normwise(lt_product(*xs[:3], 8, True, square, backend, decay=tuple(xs[3:])), ref, xs, x64)
        else:
            out = _run(backend, *xs, 8, True, square)
        assert out.dtype == torch.float32
        _check(out, ref, xs, x64, dict(rtol=2**-8, atol=1e-3), backend)


def _tf32_normwise(out, ref, xs, x64):
    """out and every gradient within 2^-8 of the float64 reference in relative Frobenius norm: bf16 rounding of
    the gradients (2^-9) plus tf32's operand rounding summed over the terms (tests/ops/test_triton.py's TF32_REL)."""
    g = torch.randn(ref.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    got = (out, *torch.autograd.grad(out, xs, g.to(out.device, out.dtype)))
    want = (ref, *torch.autograd.grad(ref, x64, g, retain_graph=True))  # _check takes ref's gradients again
    for name, x, y in zip(("out", *NAMES), got, want):
        err = (x.cpu().double() - y).norm() / y.norm()
        assert err <= 2**-8, f"tf32 {name}: relative Frobenius error {err:.2e} > {2**-8:.2e}"


@pytest.mark.parametrize("backend", ["loop", "batched", "cumsum", "triton"])
def test_zero_decay_is_the_undecayed_product(backend):
    """decay=(0, 0) (gates 1) gives the product without decay; decay=None is that product's own code path."""
    (a, b, c), tol = _on(backend, _inputs(37, 3, 4, (2, 2), (2, 1), seed=13)[:3])
    a, b, c = (x.detach() for x in (a, b, c))
    zero = torch.zeros(2, 1, 37, dtype=a.dtype, device=a.device)
    with torch.no_grad():
        if backend == "cumsum":
            plain, decayed = lt_multiply_cumsum(a, b, c, 4), lt_multiply_cumsum(a, b, c, 4, decay=(zero, zero))
        else:
            plain = lt_product(a, b, c, 8, True, False, backend)
            decayed = lt_product(a, b, c, 8, True, False, backend, decay=(zero, zero))
    torch.testing.assert_close(decayed, plain, **tol)
    torch.testing.assert_close(plain.cpu().double(), reference_lt_product(*_as64((a, b, c)), 8, True, False), **tol)


@pytest.mark.parametrize("slots,group", [(300, 4), (9, 4), (4, 4), (1, 4), (65, 64)])
def test_decayed_running_sums(slots, group):
    """The grouped scan (batched's blocks, the Triton chunks) equals the one (S x S) matrix of decays it replaces,
    recursion levels and a last group shorter than the others included; strong decays stay finite."""
    gen = torch.Generator().manual_seed(slots)
    x = torch.randn(2, 1, slots, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    logs = (-3.0 * torch.rand(3, slots, generator=gen, dtype=torch.float64)).cumsum(-1).requires_grad_()
    out = decayed_running_sums(x, logs, group)
    ref = torch.matmul(decay_matrix(logs, logs), x)
    assert out.shape == ref.shape == (2, 3, slots, 5) and torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    g = torch.randn(ref.shape, generator=gen, dtype=torch.float64)
    for u, v in zip(torch.autograd.grad(out, (x, logs), g), torch.autograd.grad(ref, (x, logs), g)):
        torch.testing.assert_close(u, v, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("backend", ["loop", "batched", "cumsum", "triton"])
def test_no_decay_never_reaches_the_decay_code(monkeypatch, backend):
    """decay=None runs the undecayed code of before (its results are pinned by test_causal.py, test_backends.py and
    test_triton.py; bit-identical to the commit before decay on 145 outputs and gradients): every decay helper is
    made to fail here, and the product and its gradients still come out."""
    from hf_polyattn.ops import causal

    def refuse(*args, **kwargs):
        raise AssertionError("decay code reached without decay")

    for name in ("check_decay", "decay_matrix", "decayed_running_sums", "_query_decay", "_log_ratio"):
        monkeypatch.setattr(causal, name, refuse)
    if backend == "triton":
        _triton_device()
        from hf_polyattn.ops.triton import causal as triton_causal

        for name in ("check_decay", "decayed_running_sums"):
            monkeypatch.setattr(triton_causal, name, refuse)
        undecayed = triton_causal.running_sums_

        def running_sums_(s, logs=None):
            if logs is not None:
                refuse()
            return undecayed(s)

        monkeypatch.setattr(triton_causal, "running_sums_", running_sums_)
        monkeypatch.setattr(triton_causal._Plan, "log_tables", refuse)
    (a, b, c), _ = _on(backend, _inputs(37, 3, 4, (2, 2), (2, 1), seed=17)[:3])
    for square in (False, True):
        if backend == "cumsum":
            out = lt_multiply_cumsum(a, b, c, 4)
        else:
            out = lt_product(a, b, c, 8, square, square, backend)
        assert all(g is not None for g in torch.autograd.grad(out.square().sum(), (a, b, c)))


def test_bad_decay_arguments():
    a, b, c, q, k = (x.detach() for x in _inputs(10, 3, 4, (2, 2), (2, 1), seed=0))
    with pytest.raises(ValueError, match="pair"):
        lt_product(a, b, c, 4, True, False, "loop", decay=q)
    with pytest.raises(ValueError, match="qlog must have shape"):
        lt_product(a, b, c, 4, True, False, "loop", decay=(q[..., :5], k))
    with pytest.raises(ValueError, match="klog leading dims"):
        lt_product(a, b, c, 4, True, False, "loop", decay=(q, q))  # one decay per query group: not a key's
    with pytest.raises(ValueError, match="float"):
        lt_multiply(a, b, c, 4, True, False, (q, k.long()))
