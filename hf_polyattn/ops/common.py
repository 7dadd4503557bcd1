"""Small tensor helpers every attention path uses."""

from __future__ import annotations

import math

import torch
from torch.nn import functional as F

__all__ = ["ACTIVATIONS", "_int_power", "_safe_divide", "_with_normaliser", "check_softcap", "head_layer_norm",
           "normalised_sum", "read_state", "row_chunks", "rowwise_recompute", "soft_cap", "to_work", "work_dtype"]

HALF = (torch.bfloat16, torch.float16)

# the elementwise feature maps (ops/feature_maps.py's 'elu' and 'relu'), by the name lt_product's ``activation``
# takes: the Triton kernels apply the same functions on chip (ops/triton/_kernels.py ``_act``)
ACTIVATIONS = {"elu": lambda x: F.elu(x) + 1.0, "relu": F.relu}


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the PyTorch math computes in for inputs of ``dtype``: float64 stays, everything else float32
    (degree-4..8 weights of O(10) scores reach 1e4..1e8, past float16's 65504)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def to_work(*xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``xs`` in their working dtype (``work_dtype``): half-precision tensors upcast, the others as they are (not
    passed to ``Tensor.to``, which returns them too but is a dispatched operation: 3 of a decoding step's softmax
    heads per layer)."""
    return tuple(x if x.dtype in _WORK else x.to(work_dtype(x.dtype)) for x in xs)


_WORK = (torch.float32, torch.float64)


def head_layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """LayerNorm over the last dim with per-head affine parameters (broadcast against x), in x's dtype."""
    y = F.layer_norm(x, x.shape[-1:], eps=eps)
    return y * weight.to(y.dtype) + bias.to(y.dtype)


def check_softcap(value) -> float | None:
    """A logit soft-cap as stored: None (no capping) or a finite float > 0; ValueError naming ``softcap`` else."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"softcap must be None or a finite number > 0 (the cap c of c tanh(score / c)), got {value!r}")
    return float(value)


def soft_cap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """Logit soft-capping of scores x = s q.k: c tanh(x / c) (Gemma 2's ``attn_logit_softcapping``, applied before
    the mask and the softmax as its ``eager_attention_forward`` does); ``x`` itself for ``cap`` None."""
    return x if cap is None else torch.tanh(x / cap) * cap


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


def read_state(features: torch.Tensor, kv: torch.Tensor, logs: torch.Tensor | None = None) -> torch.Tensor:
    """What queries read from a recurrent state ``kv`` = sum phi(k)^T [v 1] (B, Hkv, 1, F, e): features @ kv, with
    decay times exp(G_i) per query row, ``logs`` = G (B, Hkv, 1, L) the cumulative log-decays of the call's keys
    from the state's reference (its last folded key), the query rows bottom-right aligned to the last ones."""
    out = torch.matmul(features, kv)
    if logs is not None:
        out = out * torch.exp(logs[..., logs.shape[-1] - out.shape[-2] :]).unsqueeze(-1)
    return out


def _safe_divide(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """num / den, 0 where den == 0 (a query that sees no key, or relu's all-zero rows)."""
    ok = den > 0
    return torch.where(ok, num / torch.where(ok, den, torch.ones_like(den)), torch.zeros_like(num))


def _numerator(far, loc, far_scale, cols: slice) -> tuple[torch.Tensor, bool]:
    """loc + far_scale * far over the columns ``cols``, and whether that is a new tensor (not a view of far)."""
    t = far[..., cols]
    if far_scale is not None:
        t = t * far_scale
    if loc is not None:
        part = loc[..., cols]
        in_place = far_scale is not None and torch.broadcast_shapes(t.shape, part.shape) == t.shape
        t = t.add_(part) if in_place else part + t  # the same sum either way (addition commutes exactly)
    return t, far_scale is not None or loc is not None


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
        ctx.has_loc = loc is not None
        ctx.shapes = (far.shape, None if loc is None else loc.shape, None if far_scale is None else far_scale.shape)
        keep_far = far_scale is not None and ctx.needs_input_grad[2]
        ctx.fused = _fused_normaliser(far, loc, far_scale)
        if ctx.fused:  # one Triton pass (ops/triton/normalise.py): the same values to fp32 rounding
            from .triton.normalise import normalised_sum_forward

            out, y, den = normalised_sum_forward(far, loc, far_scale, offset, out_dtype)
            ctx.save_for_backward(y, den, far_scale, far if keep_far else None)
            return out
        d = far.shape[-1] - 1
        den = _numerator(far, loc, far_scale, slice(d, None))[0] + offset
        ok = den > 0
        # y formed in the numerator's own columns: the n x (d + 1) sum and a second n x d tensor for the zeroing
        # were 4.03 of a bf16 polysketch-local layer's 13.16 units at its peak, in this forward (n = 1024, H = 4,
        # counted storages, recipes/memory_layers.py); without them it peaks in backward at 11.09
        num, owned = _numerator(far, loc, far_scale, slice(None, d))
        den1 = torch.where(ok, den, 1.0)
        y = (num.div_(den1) if owned else torch.div(num, den1)).masked_fill_(~ok, 0.0)
        del num
        ctx.save_for_backward(y, torch.where(ok, den, 0.0), far_scale, far if keep_far else None)
        return y.to(out_dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):  # noqa: D102
        y, den, far_scale, far = ctx.saved_tensors
        if ctx.fused:
            from .triton.normalise import normalised_sum_backward

            need_far, need_loc, need_scale = ctx.needs_input_grad[:3]
            return (*normalised_sum_backward(g, y, den, far, far_scale, need_far, need_loc and ctx.has_loc,
                                             need_scale and far is not None), None, None)
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
        # the row sums a quarter of the rows at a time (from 1024 rows, ``row_chunks``): their n x d temporary was
        # 2 of a bf16 polysketch layer's 9.18 units at its peak (n = 1024, H = 4, counted storages); each row's
        # sum is the same either way
        for sl in _row_slices(y.shape[-2], row_chunks(y.shape[-2])):
            t = (y[..., sl, :] / den[..., sl, :]).mul_(g[..., sl, :])
            dnum[..., sl, d:] = torch.where(ok[..., sl, :], -t.sum(-1, keepdim=True), 0.0)
            del t
        del g
        far_shape, loc_shape, scale_shape = ctx.shapes
        dloc = dnum.sum_to_size(loc_shape) if ctx.has_loc and ctx.needs_input_grad[1] else None
        dscale = (dnum * far).sum_to_size(scale_shape) if far is not None else None
        dfar = None
        if ctx.needs_input_grad[0]:
            dfar = (dnum if far_scale is None else dnum * far_scale).sum_to_size(far_shape)
        return dfar, dloc, dscale, None, None


# the normaliser in one Triton pass each way on CUDA (``ops/triton/normalise.py``, what it covers: ``fused_ok``);
# False runs the PyTorch composition below everywhere, as before (the before/after rows of
# recipes/profile_gpu_kernels.py ``scan_rows``)
FUSED_NORMALISER = True


def _fused_normaliser(far: torch.Tensor, loc: torch.Tensor | None, far_scale: torch.Tensor | None) -> bool:
    if not (FUSED_NORMALISER and far.is_cuda):
        return False
    from .triton import is_available

    if not is_available():
        return False
    from .triton.normalise import fused_ok

    return fused_ok(far, loc, far_scale)


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


class _RowwiseRecompute(torch.autograd.Function):
    """outputs = fn(x) for a row-wise ``fn`` (each row along dim -2 of its outputs depends on that row of x alone),
    formed chunk by chunk of rows and recomputed so in backward; nothing of ``fn`` is kept but x.

    ``torch.utils.checkpoint`` recomputes the whole of ``fn`` before its backward: every intermediate of every row
    lives at once. A learned polysketch's side (r = 32, d = 64) held 11 bf16 query units of them where the bf16
    polysketch-local layer peaked (15.34 units, n = 1024, H = 4, counted storages, recipes/memory_layers.py); chunk
    by chunk they are a chunk's share (in 4 chunks that layer's peak moved to its forward, 13.16 units).
    ``params``: the parameters ``fn`` reads that need gradients, summed over the chunks in float32 (half-precision
    parameters get their sum rounded once)."""

    @staticmethod
    def forward(ctx, fn, chunks, x, *params):  # noqa: D102
        ctx.fn, ctx.slices = fn, _row_slices(x.shape[-2], chunks)
        ctx.save_for_backward(x, *params)
        if len(ctx.slices) == 1:  # no copies into whole-size buffers (the demo's n = 256 layers)
            base = x.untyped_storage().data_ptr()
            outs = [o.clone() if o.untyped_storage().data_ptr() == base else o for o in fn(x)]  # never x itself
        else:
            outs = None
            for sl in ctx.slices:
                parts = fn(x[..., sl, :])
                if outs is None:
                    outs = [p.new_empty(*p.shape[:-2], x.shape[-2], p.shape[-1]) for p in parts]
                for o, p in zip(outs, parts):
                    o[..., sl, :] = p
                del parts
        ctx.mark_non_differentiable(*outs[1:])
        return tuple(outs)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g, *_):  # noqa: D102
        x, *params = ctx.saved_tensors
        want_x = ctx.needs_input_grad[2]
        want = [p for p, w in zip(params, ctx.needs_input_grad[3:]) if w]

        def chunk_grads(sl):  # fn recomputed on rows sl; gradients of x's rows (or None) and of ``want``
            with torch.enable_grad():
                xc = x[..., sl, :].detach().requires_grad_(want_x)
                grads = torch.autograd.grad(ctx.fn(xc)[0], ([xc] if want_x else []) + want, g[..., sl, :],
                                            allow_unused=True)
            return (grads[0] if want_x else None), grads[int(want_x):]

        if len(ctx.slices) == 1:  # the gradients as they are: nothing to gather or sum
            dx, sums = chunk_grads(ctx.slices[0])
        else:
            dx = torch.empty_like(x) if want_x else None
            sums: list[torch.Tensor | None] = [None] * len(want)
            for sl in ctx.slices:
                gx, gps = chunk_grads(sl)
                if want_x:
                    dx[..., sl, :] = 0.0 if gx is None else gx
                for i, gp in enumerate(gps):
                    if gp is not None:
                        sums[i] = gp.to(work_dtype(gp.dtype)) if sums[i] is None else sums[i].add_(gp)
        it = iter(None if s is None else s.to(p.dtype) for s, p in zip(sums, want))
        return (None, None, dx, *(next(it) if w else None for w in ctx.needs_input_grad[3:]))


def row_chunks(n: int, chunks: int = 4, min_rows: int = 256) -> int:
    """How many chunks n rows are processed in to bound a temporary: ``chunks``, fewer so that each holds at least
    ``min_rows`` rows, 1 below 2 * min_rows (short sequences skip the per-chunk launches and copies)."""
    return max(1, min(chunks, n // min_rows))


def _row_slices(n: int, chunks: int) -> list[slice]:
    step = -(-n // max(1, chunks))
    return [slice(i, min(n, i + step)) for i in range(0, n, step)] or [slice(0, n)]


def rowwise_recompute(fn, x: torch.Tensor, params, chunks: int) -> tuple[torch.Tensor, ...]:
    """``fn(x)`` (a tuple of tensors, the first differentiable, rows along dim -2; ``None`` entries pass through),
    computed in ``chunks`` chunks of rows and recomputed chunk by chunk in backward (``_RowwiseRecompute``).
    ``params``: every parameter ``fn`` reads (those without ``requires_grad`` are left out)."""
    shape = []

    def tensors(xc):
        parts = fn(xc)
        if not shape:
            shape.extend(p is not None for p in parts)
        return tuple(p for p in parts if p is not None)

    outs = iter(_RowwiseRecompute.apply(tensors, chunks, x, *(p for p in params if p.requires_grad)))
    return tuple(next(outs) if present else None for present in shape)
