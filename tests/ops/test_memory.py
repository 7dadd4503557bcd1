"""The memory-saving paths of the ops compute what they replace: half inputs upcast where the math needs it, the
normalised sum and the row-wise recomputation equal their direct forms, features in chunks equal one chunk. Their
peak memory, counted by tensor storages, is bounded in tests/recipes/test_memory.py."""

from __future__ import annotations

import os

import pytest
import torch

from hf_polyattn import PolyAttnConfig
from hf_polyattn.ops import PolyAttention, attention
from hf_polyattn.ops.backend import lt_product, triton_available
from hf_polyattn.ops.common import _safe_divide, _with_normaliser, normalised_sum, rowwise_recompute
from hf_polyattn.ops.sketches import PolynomialSketch


def test_pytorch_backends_upcast_half_values():
    """lt_product with bf16 values on 'loop' / 'batched' equals the fp32 values (the PyTorch backends compute in
    the features' dtype)."""
    gen = torch.Generator().manual_seed(5)
    a, b = (torch.randn(1, 2, 1, 40, 4, generator=gen) for _ in range(2))
    c = torch.randn(1, 2, 1, 40, 9, generator=gen).to(torch.bfloat16)
    for backend in ("loop", "batched"):
        got = lt_product(a, b, c, 16, True, True, backend)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, lt_product(a, b, c.float(), 16, True, True, backend), rtol=0, atol=0)


def test_pytorch_local_blocks_upcast_half_inputs():
    """The PyTorch exact blocks and window (the fallback of the Triton ones) given bf16 q, k, [v, 1] compute what
    they compute from their fp32 copies."""
    gen = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(1, 2, g, 40, 8, generator=gen).to(torch.bfloat16) for g in (2, 1, 1))
    vext = _with_normaliser(v, None)
    for opts, method in ((dict(kind="polysketch", local_exact=True), "_local_exact"),
                         (dict(kind="linear", window=8), "_window_local")):
        mod = PolyAttention(PolyAttnConfig(block_size=16, backend="loop", **opts), 4, 8, 2)
        args = (None, True, 0.3) + (("polynomial",) if method == "_local_exact" else ())
        got = getattr(mod, method)(q, k, vext, *args)[0]
        want = getattr(mod, method)(q.float(), k.float(), vext.float(), *args)[0]
        assert got.dtype == torch.float32 and torch.equal(got, want)


def _interpreted_triton() -> bool:
    """The Triton kernels run here on CPU tensors: triton is installed and in its interpreter (tests/conftest.py
    sets TRITON_INTERPRET=1 without a GPU)."""
    return triton_available() and os.environ.get("TRITON_INTERPRET", "") not in ("", "0")


triton_only = pytest.mark.skipif(not _interpreted_triton(), reason="needs triton in its interpreter (CPU tensors)")


def _composition(far, loc, far_scale, offset):
    """What PolyAttention computed before normalised_sum: the sum, then _safe_divide on its slices."""
    num = far if far_scale is None else far * far_scale
    num = num if loc is None else loc + num
    d = num.shape[-1] - 1
    return _safe_divide(num[..., :d], num[..., d:] + offset)


def _sum_inputs(case: str, dtype):
    gen = torch.Generator().manual_seed(3)
    far = torch.randn(2, 2, 1, 9, 6, generator=gen, dtype=dtype)  # one kv group slot, broadcast over 2 groups
    far[..., -1] = far[..., -1].abs() + 0.2
    far[0, 1, 0, 4, -1] = -5.0  # a denominator <= 0: that row is 0 and passes no gradient
    loc = None if case == "far" else torch.randn(2, 2, 2, 9, 6, generator=gen, dtype=dtype)
    scale = {"far": None, "loc": None, "rows": torch.rand(2, 2, 2, 9, 1, generator=gen, dtype=dtype) + 0.5,
             "mix": torch.rand(2, 2, 1, 1, generator=gen, dtype=dtype) + 0.5}[case]  # mix: window_mix's shape
    return [None if t is None else t.requires_grad_() for t in (far, loc, scale)]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("case", ["far", "loc", "rows", "mix"])
def test_normalised_sum_equals_the_composition(case, dtype):
    """Values and gradients equal to the bit to the composition it replaces (its backward computes the same
    operations), with a denominator <= 0 in one row; and gradcheck in float64."""
    xs = _sum_inputs(case, dtype)
    got, want = normalised_sum(*xs, 0.5), _composition(*xs, 0.5)
    assert got.dtype == dtype and torch.equal(got, want)
    assert (got[0, 1, :, 4] == 0).all()
    g = torch.randn(got.shape, generator=torch.Generator().manual_seed(4), dtype=dtype)
    live = [x for x in xs if x is not None]
    for a, b in zip(torch.autograd.grad(got, live, g), torch.autograd.grad(want, live, g)):
        assert torch.equal(a, b)
    if dtype == torch.float64:
        assert torch.autograd.gradcheck(lambda *t: normalised_sum(*t, 0.5), tuple(xs))


def test_normalised_sum_half_output_and_bad_offset():
    """A bf16 output (what a bf16 layer returns): the composition's value cast to bf16, and its gradients for a
    bf16 incoming gradient (an expanded one, as from .sum(), and a dense one), to the bit. A tensor offset is
    refused by name."""
    far, loc, scale = _sum_inputs("rows", torch.float32)
    out = normalised_sum(far, loc, scale, 0.0, torch.bfloat16)
    want = _composition(far, loc, scale, 0.0).to(torch.bfloat16)
    assert out.dtype == torch.bfloat16 and torch.equal(out, want)
    dense = torch.randn(out.shape, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    for g in (torch.ones((), dtype=torch.bfloat16).expand(out.shape), dense):
        for a, b in zip(torch.autograd.grad(out, (far, loc, scale), g, retain_graph=True),
                        torch.autograd.grad(want, (far, loc, scale), g, retain_graph=True)):
            assert torch.equal(a, b)
    with pytest.raises(ValueError, match="offset"):
        normalised_sum(far, loc, None, torch.zeros(1))


def _learned_side(dtype=torch.float64, heads=2, d=16, r=8):
    """A trained-looking learned degree-2 sketch (polysketch p = 4's side) as ``rowwise_recompute``'s fn, with a
    per-row log scale as a second, non-differentiable output and a None third."""
    sk = PolynomialSketch(heads, d, 2, r, "learned", seed=3).to(dtype)
    with torch.no_grad():
        for i, p in enumerate(sk.parameters()):
            p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(i), dtype=dtype))

    def fn(x):
        z = sk(x)
        return z, z.detach().amax(-1, keepdim=True), None

    return sk, fn


@pytest.mark.parametrize("chunks", [1, 3, 4, 40])
def test_rowwise_recompute_equals_the_direct_computation(chunks):
    """Values, the second output and the gradients of x and of every parameter equal fn's own autograd (float64,
    n = 10 rows: chunks that do not divide n, and more chunks than rows), whatever the chunk count."""
    sk, fn = _learned_side()
    x = torch.randn(1, 2, 3, 10, 16, generator=torch.Generator().manual_seed(1), dtype=torch.float64,
                    requires_grad=True)
    params = list(sk.parameters())
    z, c, none = rowwise_recompute(fn, x, params, chunks)
    z_ref, c_ref, _ = fn(x)
    assert none is None and not c.requires_grad and z.requires_grad
    torch.testing.assert_close(z, z_ref, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(c, c_ref, rtol=1e-13, atol=1e-13)
    g = torch.randn(z.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    for a, b in zip(torch.autograd.grad(z, [x, *params], g), torch.autograd.grad(z_ref, [x, *params], g)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    small = x[..., :4, :].detach().requires_grad_()
    assert torch.autograd.gradcheck(lambda t, *ps: rowwise_recompute(fn, t, ps, 3)[0], (small, *params))


def test_rowwise_recompute_parameters_only_and_half_parameters():
    """x without a gradient (attention transfer: only the polyattn parameters train) gets none; bf16 parameters
    get bf16 gradients summed over the chunks in fp32, within bf16 rounding of the unchunked ones."""
    sk, fn = _learned_side(torch.float32)
    sk.to(torch.bfloat16)
    x = torch.randn(2, 2, 1, 64, 16, generator=torch.Generator().manual_seed(5))
    params = list(sk.parameters())
    z = rowwise_recompute(fn, x, params, 4)[0]
    grads = torch.autograd.grad(z.square().sum(), params)
    want = torch.autograd.grad(fn(x)[0].square().sum(), params)
    for a, b in zip(grads, want):
        assert a.dtype == torch.bfloat16
        assert (a.float() - b.float()).norm() <= 2**-7 * b.float().norm()
    frozen = [p.detach() for p in params]  # no parameter needs a gradient: nothing to recompute for
    assert not rowwise_recompute(fn, x, frozen, 4)[0].requires_grad


@pytest.mark.parametrize("chunks", [1, 2])
def test_rowwise_recompute_of_the_identity(chunks):
    """A map that returns its input (one chunk hands fn's outputs over as they are): a new tensor, never x itself,
    with x's values and an identity gradient."""
    x = torch.randn(2, 6, 3, requires_grad=True)
    (y,) = rowwise_recompute(lambda t: (t,), x, [], chunks)
    assert torch.equal(y, x) and y.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
    g = torch.randn(2, 6, 3)
    assert torch.equal(torch.autograd.grad(y, x, g)[0], g)


def test_feature_chunks_rule():
    """The layer's chunk count: FEATURE_CHUNKS chunks of at least FEATURE_CHUNK_ROWS rows, one for short inputs."""
    rows = attention.FEATURE_CHUNK_ROWS
    assert attention.feature_chunks(rows - 1) == 1
    assert attention.feature_chunks(2 * rows) == min(2, attention.FEATURE_CHUNKS)
    assert attention.feature_chunks(10**6) == attention.FEATURE_CHUNKS


@pytest.mark.parametrize("opts", [dict(kind="polysketch", sketch="learned", sketch_size=8, local_exact=True),
                                  dict(kind="polysketch", sketch_size=8, window=16, feature_proj=8, qk_norm=True),
                                  dict(kind="performer", num_features=16, local_exact=True),
                                  dict(kind="linear", feature_map="hedgehog")])
def test_layer_features_in_chunks_equal_one_chunk(opts, monkeypatch):
    """A float64 layer (GQA 4/2, n = 300, backend 'loop') gives the same output and q, k, v and parameter gradients
    with its features recomputed in 4 chunks of rows as in one."""
    monkeypatch.setattr(attention, "FEATURE_CHUNK_ROWS", 16)
    mod = PolyAttention(PolyAttnConfig(block_size=32, backend="loop", **opts), 4, 8, 2).double()
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in mod.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    q = torch.randn(1, 4, 300, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(1, 2, 300, 8, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(2))
    leaves = [q, k, v, *mod.parameters()]
    results = []
    for chunks in (4, 1):
        monkeypatch.setattr(attention, "FEATURE_CHUNKS", chunks)
        out = mod(q, k, v, causal=True)
        results.append((out, torch.autograd.grad(out.square().sum(), leaves, allow_unused=True)))
    (out, grads), (out1, grads1) = results
    torch.testing.assert_close(out, out1, rtol=1e-12, atol=1e-12)
    for a, b in zip(grads, grads1):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
