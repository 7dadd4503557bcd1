"""The normaliser of a kernel layer's output (``ops.common.normalised_sum``) in one Triton pass each way.

num = loc + far_scale * far over rows of d + 1 columns (d values and the normaliser's column), y = num[:d] /
(num[d] + offset), 0 where that denominator is <= 0. The PyTorch composition (``common._NormalisedSum``, which
stays the reference and the path everywhere else) makes about ten passes over n x d fp32 tensors: at n = 32k, H = 16
on an H100 the linear elu+1 layer's divisions (0.40 ms), zeroing (0.30 ms), row sums and elementwise passes took
about 1.1 of its 4.6 ms of GPU time (forward + backward, recipes/results/gpu_h100_scan/run1/scan_rows.txt); these
kernels take 0.11 ms forward and 0.13 ms backward there, and the layer went from 4.66-4.70 to 3.73-3.75 ms (run2).
Here the forward reads far (and loc) once and writes y (fp32, kept for backward), the output in its dtype and the
per-row denominator; the backward reads g, y and the denominator (far too, for the gradient of far_scale) and writes
dfar and dloc in the same pass.

Taken only for what the kernels cover (``fused_ok``): CUDA tensors, fp32 far of contiguous rows, loc None or of far's
shape, far_scale None or one value a row (far's shape with 1 column), d <= 256. Divisions are IEEE-rounded
(``div_rn``) as torch's; sums run in a different order than torch's reduction: the same values to fp32 rounding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .causal import _pow2

__all__ = ["fused_ok", "normalised_sum_backward", "normalised_sum_forward"]

MAX_D = 256
# rows per program: 32 rows x 64 columns of fp32 is 8 KB a tensor, 16 values a thread at 4 warps
_ROWS = 32


def fused_ok(far: torch.Tensor, loc: torch.Tensor | None, far_scale: torch.Tensor | None) -> bool:
    """Whether the kernels take this call (the module doc's cases)."""
    d = far.shape[-1] - 1
    if far.dtype != torch.float32 or not far.is_contiguous() or not 1 <= d <= MAX_D:
        return False
    if loc is not None and (loc.shape != far.shape or loc.dtype != torch.float32 or not loc.is_contiguous()):
        return False
    if far_scale is not None and (far_scale.shape != (*far.shape[:-1], 1) or far_scale.dtype != torch.float32
                                  or not far_scale.is_contiguous()):
        return False
    return True


@triton.jit
def _rows(rows_n, d, BR: tl.constexpr, BD: tl.constexpr):
    """This program's rows (int64) and their mask, the column range and the (rows x d) mask."""
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    rmask = rows < rows_n
    cols = tl.arange(0, BD)
    return rows, rmask, cols, rmask[:, None] & (cols < d)[None, :]


@triton.jit
def _forward_kernel(far_ptr, loc_ptr, scale_ptr, y_ptr, out_ptr, den_ptr, rows_n, d, offset, HAS_LOC: tl.constexpr,
                    HAS_SCALE: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr):
    rows, rmask, cols, m = _rows(rows_n, d, BR, BD)
    e = d + 1
    num = tl.load(far_ptr + rows[:, None] * e + cols[None, :], mask=m, other=0.0)
    den = tl.load(far_ptr + rows * e + d, mask=rmask, other=0.0)
    if HAS_SCALE:
        s = tl.load(scale_ptr + rows, mask=rmask, other=0.0)
        num = num * s[:, None]
        den = den * s
    if HAS_LOC:
        num = num + tl.load(loc_ptr + rows[:, None] * e + cols[None, :], mask=m, other=0.0)
        den = den + tl.load(loc_ptr + rows * e + d, mask=rmask, other=0.0)
    den = den + offset
    ok = den > 0
    y = tl.where(ok[:, None], tl.math.div_rn(num, tl.where(ok, den, 1.0)[:, None]), 0.0)
    tl.store(y_ptr + rows[:, None] * d + cols[None, :], y, mask=m)
    tl.store(out_ptr + rows[:, None] * d + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=m)
    tl.store(den_ptr + rows, tl.where(ok, den, 0.0), mask=rmask)


@triton.jit
def _backward_kernel(g_ptr, y_ptr, den_ptr, far_ptr, scale_ptr, dfar_ptr, dloc_ptr, dscale_ptr, rows_n, d,
                     HAS_SCALE: tl.constexpr, NEED_FAR: tl.constexpr, NEED_LOC: tl.constexpr,
                     NEED_SCALE: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr):
    rows, rmask, cols, m = _rows(rows_n, d, BR, BD)
    e = d + 1
    g = tl.load(g_ptr + rows[:, None] * d + cols[None, :], mask=m, other=0.0).to(tl.float32)
    y = tl.load(y_ptr + rows[:, None] * d + cols[None, :], mask=m, other=0.0)
    den = tl.load(den_ptr + rows, mask=rmask, other=0.0)
    ok = den > 0
    den1 = tl.where(ok, den, 1.0)[:, None]
    dnum = tl.where(ok[:, None], tl.math.div_rn(g, den1), 0.0)
    dden = tl.where(ok, -tl.sum(tl.math.div_rn(y, den1) * g, axis=1), 0.0)
    if NEED_LOC:
        tl.store(dloc_ptr + rows[:, None] * e + cols[None, :], dnum, mask=m)
        tl.store(dloc_ptr + rows * e + d, dden, mask=rmask)
    if NEED_FAR:
        if HAS_SCALE:
            s = tl.load(scale_ptr + rows, mask=rmask, other=0.0)
            tl.store(dfar_ptr + rows[:, None] * e + cols[None, :], dnum * s[:, None], mask=m)
            tl.store(dfar_ptr + rows * e + d, dden * s, mask=rmask)
        else:
            tl.store(dfar_ptr + rows[:, None] * e + cols[None, :], dnum, mask=m)
            tl.store(dfar_ptr + rows * e + d, dden, mask=rmask)
    if NEED_SCALE:
        far = tl.load(far_ptr + rows[:, None] * e + cols[None, :], mask=m, other=0.0)
        far_d = tl.load(far_ptr + rows * e + d, mask=rmask, other=0.0)
        tl.store(dscale_ptr + rows, tl.sum(dnum * far, axis=1) + dden * far_d, mask=rmask)


def normalised_sum_forward(far, loc, far_scale, offset: float, out_dtype):
    """(y in out_dtype, y in fp32, the per-row denominator with 0 where it is <= 0 (far's shape, 1 column))."""
    d = far.shape[-1] - 1
    rows_n = far.numel() // (d + 1)
    y = torch.empty(*far.shape[:-1], d, dtype=torch.float32, device=far.device)
    out = y if out_dtype == torch.float32 else torch.empty_like(y, dtype=out_dtype)
    den = torch.empty(*far.shape[:-1], 1, dtype=torch.float32, device=far.device)
    if rows_n:
        _forward_kernel[(triton.cdiv(rows_n, _ROWS),)](
            far, far if loc is None else loc, far if far_scale is None else far_scale, y, out, den, rows_n, d,
            float(offset), HAS_LOC=loc is not None, HAS_SCALE=far_scale is not None, BR=_ROWS, BD=_pow2(d))
    return out, y, den


def normalised_sum_backward(g, y, den, far, far_scale, need_far: bool, need_loc: bool, need_scale: bool):
    """(dfar, dloc, dscale), None where not needed; ``far`` is read only for dscale."""
    d = y.shape[-1]
    rows_n = y.numel() // d if d else 0
    g = g.contiguous()
    shape = (*y.shape[:-1], d + 1)
    dfar = torch.empty(shape, dtype=torch.float32, device=y.device) if need_far else None
    dloc = torch.empty(shape, dtype=torch.float32, device=y.device) if need_loc else None
    dscale = torch.empty(*y.shape[:-1], 1, dtype=torch.float32, device=y.device) if need_scale else None
    if rows_n and (need_far or need_loc or need_scale):
        dummy = y
        _backward_kernel[(triton.cdiv(rows_n, _ROWS),)](
            g, y, den, dummy if far is None else far, dummy if far_scale is None else far_scale,
            dummy if dfar is None else dfar, dummy if dloc is None else dloc, dummy if dscale is None else dscale,
            rows_n, d, HAS_SCALE=far_scale is not None, NEED_FAR=need_far, NEED_LOC=need_loc,
            NEED_SCALE=need_scale, BR=_ROWS, BD=_pow2(d))
    return dfar, dloc, dscale
