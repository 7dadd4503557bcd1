"""The test session's interpreter computes bf16 dots and fp32 -> bf16 rounding as CUDA does (triton_interpreter.py)."""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "") in ("", "0"),
                                reason="the interpreter runs only without a GPU")


@triton.jit
def _dot_kernel(a_ptr, b_ptr, o_ptr, CAST: tl.constexpr):
    i = tl.arange(0, 16)
    a = tl.load(a_ptr + i[:, None] * 16 + i[None, :])
    b = tl.load(b_ptr + i[:, None] * 16 + i[None, :])
    if CAST:
        a, b = a.to(tl.bfloat16), b.to(tl.bfloat16)
    tl.store(o_ptr + i[:, None] * 16 + i[None, :], tl.dot(a, b))


@triton.jit
def _store_kernel(x_ptr, o_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(o_ptr + i, tl.load(x_ptr + i))


@pytest.mark.parametrize("cast", [False, True], ids=["bf16-inputs", "cast-in-kernel"])
def test_bf16_dot_is_the_product_of_the_values(cast):
    """Exact products of the bf16 values, fp32 accumulation (unmended: 2.96e10 off)."""
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(16, 16, generator=gen), torch.randn(16, 16, generator=gen)
    want = a.bfloat16().double() @ b.bfloat16().double()
    out = torch.empty(16, 16)
    _dot_kernel[(1,)](a if cast else a.bfloat16(), b if cast else b.bfloat16(), out, CAST=cast)
    torch.testing.assert_close(out.double(), want, rtol=1e-6, atol=1e-5)


def test_bf16_store_rounds_to_nearest_even():
    """fp32 -> bf16 as torch (and CUDA's cvt.rn) rounds, bit for bit (unmended: 512 of 1024 one ulp low)."""
    x = torch.randn(1024, generator=torch.Generator().manual_seed(1))
    x[:4] = torch.tensor([1.0 + 2**-8, 1.0 + 3 * 2**-8, float("inf"), float("nan")])  # two ties to even, inf, nan
    out = torch.empty(1024, dtype=torch.bfloat16)
    _store_kernel[(1,)](x, out, N=1024)
    want = x.to(torch.bfloat16)
    assert torch.equal(out[:3], want[:3]) and torch.isnan(out[3])
    assert torch.equal(out[4:], want[4:])
