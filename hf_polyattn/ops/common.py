"""Small tensor helpers every attention path uses."""

from __future__ import annotations

import torch
from torch.nn import functional as F

__all__ = ["ACTIVATIONS", "_int_power", "_safe_divide", "_with_normaliser", "normalised_sum", "to_work", "work_dtype"]

HALF = (torch.bfloat16, torch.float16)

# the elementwise feature maps (ops/feature_maps.py's 'elu' and 'relu'), by the name lt_product's ``activation``
# takes: the Triton kernels apply the same functions on chip (ops/triton/_kernels.py ``_act``)
ACTIVATIONS = {"elu": lambda x: F.elu(x) + 1.0, "relu": F.relu}


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the PyTorch math computes in for inputs of ``dtype``: float64 stays, everything else float32
    (degree-4..8 weights of O(10) scores reach 1e4..1e8, past float16's 65504)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def to_work(*xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``xs`` in their working dtype (``work_dtype``): half-precision tensors upcast, the others as they are."""
    return tuple(x.to(work_dtype(x.dtype)) for x in xs)


def _int_power(x: torch.Tensor, p: int) -> torch.Tensor:
    """x**p by repeated squaring: 2 multiplies for p=4 instead of aten::pow, which took 180 ms
    (+130 ms backward) on the 8k x 256 x 4 local blocks against ~25 ms for the multiplies."""
    result = None
    base = x
    while p:
        if p & 1:
            result = base if result is None else result * base
        p >>= 1
        if p:
            base = base * base
    return torch.ones_like(x) if result is None else result


def _with_normaliser(v5: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """[v, 1]: values with the normaliser's column of ones, both zeroed at padded keys (mask False)
    so that they add nothing anywhere."""
    vext = torch.cat([v5, torch.ones_like(v5[..., :1])], dim=-1)
    if mask is not None:
        vext = vext * mask[:, None, None, :, None].to(vext.dtype)
    return vext


def _safe_divide(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """num / den, 0 where den == 0 (a query that sees no key, or relu's all-zero rows)."""
    ok = den > 0
    return torch.where(ok, num / torch.where(ok, den, torch.ones_like(den)), torch.zeros_like(num))


class _NormalisedSum(torch.autograd.Function):
    """y = num[..., :d] / (num[..., d] + offset), num = loc + far_scale * far, 0 where the denominator is <= 0.

    The composition (add, multiply, slice, ``_safe_divide``, cast) kept num, its slices and the denominator mask
    for autograd and made five n x d fp32 temporaries in its backward, where the bf16 causal polysketch and linear
    elu+1 layers peaked (n = 1024, H = 4, d = 64, counted storages on a 2-core CPU, recipes/memory_layers.py: 15.09
    and 17.09 bf16 query units; 13.24 and 16.00 with this Function, whose backward makes at most two besides its
    result). Here backward needs only y and the denominator and computes what autograd computed for the
    composition, operation for operation, so the same roundings (reordered as g * (1 / den) and -(g . y) / den,
    a cancelling dq of tests/ops/test_triton.py's d = 16 srht case went from 4.3e-5 to 2.3e-4 off float64):
    dN[..., :d] = g / den, dN[..., d] = sum(-g * (y / den)), zero where den <= 0;
    ``far`` is kept only when ``far_scale`` has a gradient (``window_mix``). y is kept in fp32 even when the
    caller gets it in bf16: read from the bf16 output (as FlashAttention's backward does for the same row sum),
    dq of a bf16 linear elu+1 layer moved from 2.3e-3 to 3.6e-3 off float64 (relative norm, n = 512), whose
    weights are flat enough for the row sum to cancel; this saved y is freed before the causal product's
    backward, where the layers peak, so it costs no peak."""

    @staticmethod
    def forward(ctx, far, loc, far_scale, offset, out_dtype):  # noqa: D102
        num = far if far_scale is None else far * far_scale
        if loc is not None:
            num = loc + num
        d = num.shape[-1] - 1
        den = num[..., d:] + offset
        ok = den > 0
        y = torch.where(ok, num[..., :d] / torch.where(ok, den, torch.ones_like(den)), 0.0)
        del num
        ctx.has_loc = loc is not None
        ctx.shapes = (far.shape, None if loc is None else loc.shape, None if far_scale is None else far_scale.shape)
        keep_far = far_scale is not None and ctx.needs_input_grad[2]
        ctx.save_for_backward(y, torch.where(ok, den, 0.0), far_scale, far if keep_far else None)
        return y.to(out_dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):  # noqa: D102
        y, den, far_scale, far = ctx.saved_tensors
        ok = den > 0
        den = torch.where(ok, den, 1.0)
        # the composition's operations with its roundings (negating a sum is exact), written into one buffer and
        # in place: its backward made five n x d temporaries besides dnum, this one at most one. A half g is
        # promoted exactly inside div and mul (an fp32 copy of it was 2 of a bf16 linear elu+1 layer's 9.18
        # units at its peak, n = 512, H = 2); rows with den <= 0 have y = 0 and are zeroed after the division
        d = y.shape[-1]
        dnum = torch.empty(*g.shape[:-1], d + 1, dtype=den.dtype, device=den.device)
        torch.div(g, den, out=dnum[..., :d])
        dnum[..., :d].masked_fill_(~ok, 0.0)
        t = (y / den).mul_(g)
        dnum[..., d:] = torch.where(ok, -t.sum(-1, keepdim=True), 0.0)
        del t, g
        far_shape, loc_shape, scale_shape = ctx.shapes
        dloc = dnum.sum_to_size(loc_shape) if ctx.has_loc and ctx.needs_input_grad[1] else None
        dscale = (dnum * far).sum_to_size(scale_shape) if far is not None else None
        dfar = None
        if ctx.needs_input_grad[0]:
            dfar = (dnum if far_scale is None else dnum * far_scale).sum_to_size(far_shape)
        return dfar, dloc, dscale, None, None


def normalised_sum(far: torch.Tensor, loc: torch.Tensor | None = None, far_scale: torch.Tensor | None = None,
                   offset: float = 0.0, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """num[..., :d] / (num[..., d] + offset) with num = loc + far_scale * far (loc, far_scale optional), 0 where
    that denominator is <= 0 (a query that sees no key), returned in ``out_dtype`` (default: far's dtype).

    The same values and gradients as ``_safe_divide`` on the sum (equal to the bit in float64 and float32,
    tests/ops/test_memory.py), keeping for backward only the output and the per-row denominator
    (``_NormalisedSum``). ``offset`` is a number."""
    if isinstance(offset, torch.Tensor):
        raise ValueError("normalised_sum takes a number as offset; a per-row tensor needs _safe_divide")
    return _NormalisedSum.apply(far, loc, far_scale, float(offset), out_dtype or far.dtype)
