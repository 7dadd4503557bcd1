"""The normaliser's Triton passes (``ops/triton/normalise.py``) against the PyTorch composition they replace on CUDA
(``common._NormalisedSum`` with ``FUSED_NORMALISER = False``): values, every gradient, zeroed rows, output dtypes.

Without a GPU the kernels run in Triton's interpreter (tests/ops/triton_setup.py) and the fused path is forced onto
CPU tensors here (``normalised_sum`` takes it on CUDA only); with a GPU, on CUDA.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from hf_polyattn.ops import common
from tests.ops.triton_setup import DEVICE  # sets TRITON_INTERPRET before the kernels load

# imported after the interpreter switch above (it loads the kernels)
normalise = importlib.import_module("hf_polyattn.ops.triton.normalise")


def _inputs(shape, d, loc, scale, seed):
    gen = torch.Generator().manual_seed(seed)
    far = torch.randn(*shape, d + 1, generator=gen)
    far[..., d] = far[..., d].abs() + 0.5
    far[..., 1, d] = -2.0  # a row whose denominator is <= 0: zero output, zero gradients
    xs = [far, torch.randn(*shape, d + 1, generator=gen) * 0.1 if loc else None,
          torch.rand(*shape, 1, generator=gen) + 0.5 if scale else None]
    return [None if x is None else x.to(DEVICE).requires_grad_() for x in xs]


def _run(fused: bool, xs, offset, out_dtype, monkeypatch):
    monkeypatch.setattr(common, "FUSED_NORMALISER", fused)
    if fused and DEVICE == "cpu":  # the interpreter: the dispatch takes CUDA tensors only
        monkeypatch.setattr(common, "_fused_normaliser",
                            lambda far, loc, s: common.FUSED_NORMALISER and normalise.fused_ok(far, loc, s))
    out = common.normalised_sum(*xs, offset=offset, out_dtype=out_dtype)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).to(DEVICE, out_dtype)
    live = [x for x in xs if x is not None]
    return out, torch.autograd.grad((out.float() * g.float()).sum(), live)


@pytest.mark.parametrize("d", [64, 5])
@pytest.mark.parametrize("loc,scale", [(False, False), (True, False), (True, True), (False, True)])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_fused_normaliser_matches_the_composition(d, loc, scale, out_dtype, monkeypatch):
    xs = _inputs((2, 3, 37), d, loc, scale, seed=d + 2 * loc + scale)
    offset = 0.25 if loc else 0.0
    out, grads = _run(True, xs, offset, out_dtype, monkeypatch)
    ref, ref_grads = _run(False, xs, offset, out_dtype, monkeypatch)
    assert out.dtype == ref.dtype == out_dtype and out.shape == ref.shape
    assert torch.isfinite(out).all()
    assert (out[..., 1, :] == 0).all(), "a row whose denominator is <= 0 outputs 0"
    # fp32 arithmetic in another order (row sums): a few ulps; bf16 outputs round the same fp32 values
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    # the gradients' row sums (the denominator column, far_scale's) cancel: up to d + 1 = 65 terms of size <= ~10
    # summed in another order differ by up to 65 x 10 x 2^-24 = 4e-5 absolute (1e-6 to 6e-6 seen)
    names = [name for name, x in zip(("far", "loc", "far_scale"), xs) if x is not None]
    for name, a, b in zip(names, grads, ref_grads):
        assert a.shape == b.shape and torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=1e-5, atol=4e-5, msg=lambda m, name=name: f"d{name}: {m}")
    assert (grads[0][..., 1, :] == 0).all(), "no gradient through a zeroed row"


def test_fused_ok_refuses_what_the_kernels_do_not_cover():
    far = torch.randn(2, 5, 65)
    assert normalise.fused_ok(far, None, None)
    assert normalise.fused_ok(far, far.clone(), torch.rand(2, 5, 1))
    assert not normalise.fused_ok(far.double(), None, None)
    assert not normalise.fused_ok(far.transpose(0, 1), None, None)  # rows not contiguous
    assert not normalise.fused_ok(far, far[:1], None)  # a broadcast loc
    assert not normalise.fused_ok(far, None, torch.rand(1, 5, 1))  # a broadcast far_scale
    assert not normalise.fused_ok(torch.randn(2, 5, normalise.MAX_D + 2), None, None)


def test_the_fused_path_is_taken_on_cuda_only(monkeypatch):
    """``normalised_sum`` takes the kernels for CUDA tensors and never for CPU ones (no interpreter in a CPU model)."""
    calls = []
    fwd = normalise.normalised_sum_forward
    monkeypatch.setattr(normalise, "normalised_sum_forward", lambda *a: calls.append(1) or fwd(*a))
    far = torch.randn(1, 4, 9, device=DEVICE).abs()
    common.normalised_sum(far)
    assert len(calls) == (1 if DEVICE == "cuda" else 0)
