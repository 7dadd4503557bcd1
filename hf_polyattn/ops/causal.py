"""Causal (lower-triangular) products lt(phi(A) phi(B)^T) C without an n x n matrix.

``lt_multiply`` is the block algorithm of PolySketchFormer Section 3 (Theorem 3.1) fused
into one autograd Function that walks the sequence block by block:

    out_j = phi(A_j) P_{j-1}  (+ tril(phi(A_j) phi(B_j)^T) C_j),   P_j = P_{j-1} + phi(B_j)^T C_j

with phi the identity or, for ``square=True``, the symmetric tensor square (polysketch's
z -> z^{(2)}, r(r+1)/2 features). Why a loop over blocks rather than one batched matmul
over all blocks: on the 2-core CPU one elementwise pass over an (n x r^2) feature tensor
costs about as much as its matmuls (memory bound: ~56 ms per pass over 32k x 528 floats,
3.7 GB/s measured), so the features of a block are built, used and dropped while they sit
in cache, and never stored for backward.

Backward rematerialises: it keeps only A, B, C (n x r inputs for polysketch, not n x r^2
features) and walks the blocks twice, forward order for dA (needs the prefix P_{j-1}) and
reverse order for dB, dC (needs the suffix R_j = sum_{i>j} phi(A_i)^T dY_i). No per-block
(r^2 x d) state is stored: peak extra memory is one state plus one block of features.

``lt_multiply_batched`` is the same block algorithm with no Python loop over blocks, for
accelerators where each kernel launch costs more than its work (an H100 ran the loop's
~8,300 launches per forward+backward at 32k in 170 ms, 87 ms of it GPU time): all block
states phi(B_j)^T C_j in one batched matmul, an exclusive prefix sum over blocks (float32
or float64, as the inputs), every block's far part in one matmul, the diagonal blocks in
one more; autograd differentiates it. It materialises the (n x F) features and the
(n/b x F x e) prefix states (PolySketchFormer's ``tensor_lt_multiply`` does the same), so
on the CPU, where memory traffic dominates, the loop stays faster: a polysketch layer's
forward+backward took 1.3x (n=4k) to 1.8x (16k) longer batched, 2.4-2.6x with exact local
blocks; elu+1 linear 0.9x-1.2x (recipes/results/benchmark_backends/cpu-fp32.md, 2 cores).

``lt_multiply_cumsum`` is the per-token cumulative-sum algorithm (Performer), kept for
comparison and as a second reference.

Shapes: A (..., n, fa), B (..., n, fb), C (..., n, e), broadcastable in the leading dims
(grouped-query attention passes B, C with a size-1 group axis that A expands).
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from .sketches import symmetric_power_indices, symmetric_square

__all__ = ["lt_multiply", "lt_multiply_batched", "lt_multiply_cumsum"]


def _check_block(block_size: int) -> None:
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")


class _Features:
    """Per-block features in feature-major layout (..., F, t).

    Identity: a transposed view. Square: the symmetric tensor square z -> [w_ab z_a z_b]_{a<=b}
    built from *rows* of z^T: gathering contiguous rows is ~6x faster on CPU than gathering
    columns of z (13.6 vs 88 ms for 32 blocks of 4 x 256 x 528, one thread), and its backward
    is two row index_adds (45 ms) instead of a scatter into an r x r matrix (340 ms).
    """

    def __init__(self, r: int, square: bool, device, dtype):
        self.square, self.r = square, r
        if square:
            idx, w = symmetric_power_indices(r, 2)
            self.i0 = idx[:, 0].to(device)
            self.i1 = idx[:, 1].to(device)
            self.w = w.to(device=device, dtype=dtype)[:, None]
            self.num_features = r * (r + 1) // 2
        else:
            self.num_features = r

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        xt = x.transpose(-1, -2)
        if not self.square:
            return xt
        xt = xt.contiguous()
        return xt.index_select(-2, self.i0).mul_(xt.index_select(-2, self.i1)).mul_(self.w)

    def backward(self, x: torch.Tensor, g_t: torch.Tensor) -> torch.Tensor:
        """Gradient w.r.t. x (..., t, r) from the gradient of the features (..., F, t)."""
        if not self.square:
            return g_t.transpose(-1, -2)
        xt = x.transpose(-1, -2).contiguous()
        wg = g_t * self.w
        dxt = torch.zeros(*wg.shape[:-2], self.r, wg.shape[-1], dtype=wg.dtype, device=wg.device)
        dxt.index_add_(-2, self.i0, wg * xt.index_select(-2, self.i1))
        dxt.index_add_(-2, self.i1, wg * xt.index_select(-2, self.i0))
        return dxt.transpose(-1, -2)


def check_lt_arguments(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, block_size: int) -> None:
    """The checks every implementation of lt(phi(A) phi(B)^T) C makes (ValueError naming the argument)."""
    _check_block(block_size)
    if a.shape[-2] != b.shape[-2] or b.shape[-2] != c.shape[-2]:
        raise ValueError(f"a, b, c need the same length, got {a.shape[-2]}, {b.shape[-2]}, {c.shape[-2]}")
    if a.shape[-1] != b.shape[-1]:
        raise ValueError(f"a and b need the same feature size, got {a.shape[-1]} and {b.shape[-1]}")


def _blocks(n: int, block: int):
    for s in range(0, n, block):
        yield s, min(s + block, n)


def _tril_(x: torch.Tensor) -> torch.Tensor:
    return x.tril_()


class _LTMultiply(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, c, block: int, include_diag: bool, square: bool):  # noqa: D102
        ctx.save_for_backward(a, b, c)
        ctx.block, ctx.include_diag, ctx.square = block, include_diag, square
        phi = _Features(a.shape[-1], square, a.device, a.dtype)
        n, e = a.shape[-2], c.shape[-1]
        lead = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2], c.shape[:-2])
        out = a.new_empty(*lead, n, e)
        state = a.new_zeros(*torch.broadcast_shapes(b.shape[:-2], c.shape[:-2]), phi.num_features, e)
        for s, t in _blocks(n, block):
            fa, fb, cj = phi(a[..., s:t, :]), phi(b[..., s:t, :]), c[..., s:t, :]
            oj = torch.matmul(fa.transpose(-1, -2), state)
            if include_diag:
                oj = oj + torch.matmul(_tril_(torch.matmul(fa.transpose(-1, -2), fb)), cj)
            out[..., s:t, :] = oj
            state = state + torch.matmul(fb, cj)
        return out

    @staticmethod
    def backward(ctx, grad_out):  # noqa: D102
        a, b, c = ctx.saved_tensors
        block, diag = ctx.block, ctx.include_diag
        phi = _Features(a.shape[-1], ctx.square, a.device, a.dtype)
        need_a, need_b, need_c = ctx.needs_input_grad[:3]
        n, e = a.shape[-2], c.shape[-1]
        da = torch.zeros_like(a) if need_a else None
        db = torch.zeros_like(b) if need_b else None
        dc = torch.zeros_like(c) if need_c else None
        if need_a:
            # forward order: dA_j = dY_j P_{j-1}^T (+ tril(dY_j C_j^T) phi(B_j)), feature-major
            state = a.new_zeros(*torch.broadcast_shapes(b.shape[:-2], c.shape[:-2]), phi.num_features, e)
            for s, t in _blocks(n, block):
                aj, cj, gj = a[..., s:t, :], c[..., s:t, :], grad_out[..., s:t, :]
                fb = phi(b[..., s:t, :])
                dfa = torch.matmul(state, gj.transpose(-1, -2))
                if diag:
                    dfa = dfa + torch.matmul(fb, _tril_(torch.matmul(gj, cj.transpose(-1, -2))).transpose(-1, -2))
                state = state + torch.matmul(fb, cj)
                da[..., s:t, :] = phi.backward(aj, dfa).sum_to_size(aj.shape)
        if need_b or need_c:
            # reverse order: R_j = sum_{i>j} phi(A_i)^T dY_i;  dB_j = C_j R_j^T, dC_j = phi(B_j) R_j
            suffix = None
            for s, t in reversed(list(_blocks(n, block))):
                bj, cj, gj = b[..., s:t, :], c[..., s:t, :], grad_out[..., s:t, :]
                fa, fb = phi(a[..., s:t, :]), phi(bj)
                dfb = dcj = None
                if diag:
                    dfb = torch.matmul(fa, _tril_(torch.matmul(gj, cj.transpose(-1, -2))))
                    dcj = torch.matmul(_tril_(torch.matmul(fa.transpose(-1, -2), fb)).transpose(-1, -2), gj)
                if suffix is not None:
                    far_b = torch.matmul(suffix, cj.transpose(-1, -2))
                    far_c = torch.matmul(fb.transpose(-1, -2), suffix)
                    dfb = far_b if dfb is None else dfb + far_b
                    dcj = far_c if dcj is None else dcj + far_c
                if dfb is not None:
                    if need_b:
                        db[..., s:t, :] = phi.backward(bj, dfb).sum_to_size(bj.shape)
                    if need_c:
                        dc[..., s:t, :] = dcj.sum_to_size(cj.shape)
                add = torch.matmul(fa, gj)
                suffix = add if suffix is None else suffix + add
        return da, db, dc, None, None, None


def lt_multiply(
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    block_size: int = 256,
    include_diag: bool = True,
    square: bool = False,
) -> torch.Tensor:
    """Return lt(phi(A) phi(B)^T) C: row i is sum_{j<=i} (phi(a_i) . phi(b_j)) c_j.

    O(n F (b + e)) time for F features, any n. ``square=True`` takes phi = symmetric
    tensor square (features built per block, never stored); otherwise phi = identity.
    With ``include_diag=False`` the b x b diagonal blocks are left out (they are computed
    exactly elsewhere: the ``local_exact`` option).
    """
    check_lt_arguments(a, b, c, block_size)
    return _LTMultiply.apply(a, b, c, block_size, include_diag, square)


def lt_multiply_batched(
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    block_size: int = 256,
    include_diag: bool = True,
    square: bool = False,
) -> torch.Tensor:
    """``lt_multiply`` without a loop over blocks: about ten kernels whatever n (see module doc).

    Same arguments and result; memory O(n F + (n / b) F e) instead of O(b F + F e).
    """
    check_lt_arguments(a, b, c, block_size)
    n = a.shape[-2]
    nb = -(-n // block_size)
    pad = nb * block_size - n
    if pad:
        a, b, c = (F.pad(t, (0, 0, 0, pad)) for t in (a, b, c))
    ab, bb, cb = (t.unflatten(-2, (nb, block_size)) for t in (a, b, c))  # (..., nb, b, .)
    fa, fb = (symmetric_square(ab), symmetric_square(bb)) if square else (ab, bb)
    states = torch.matmul(fb.transpose(-1, -2), cb)  # (..., nb, F, e): every block's phi(B_j)^T C_j
    # exclusive prefix P_{j-1} = sum_{i<j} states_i (shifted cumsum: no cancellation from cumsum - states)
    prefix = torch.cumsum(F.pad(states, (0, 0, 0, 0, 1, 0))[..., :-1, :, :], dim=-3)
    out = torch.matmul(fa, prefix)
    if include_diag:
        # phi(a).phi(b) = (a.b)^2 for the symmetric square: the b x b block from r-dim dot products
        scores = torch.matmul(ab, bb.transpose(-1, -2))
        if square:
            scores = scores * scores
        out = out + torch.matmul(scores.tril(), cb)
    return out.flatten(-3, -2)[..., :n, :]


def lt_multiply_cumsum(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, chunk: int = 64) -> torch.Tensor:
    """Performer's per-token cumulative sum: S_i = sum_{j<=i} b_j^T c_j, out_i = a_i S_i.

    Materialises one (f x e) state per token of a chunk: O(chunk f e) memory forward and
    O(n f e) for autograd's backward, which is why the block algorithm replaces it.
    """
    _check_block(chunk)
    n = a.shape[-2]
    lead = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2], c.shape[:-2])
    state = a.new_zeros(*torch.broadcast_shapes(b.shape[:-2], c.shape[:-2]), b.shape[-1], c.shape[-1])
    outs = []
    for s in range(0, n, chunk):
        bt, ct, at = b[..., s : s + chunk, :], c[..., s : s + chunk, :], a[..., s : s + chunk, :]
        prefix = state.unsqueeze(-3) + torch.cumsum(bt.unsqueeze(-1) * ct.unsqueeze(-2), dim=-3)
        outs.append(torch.matmul(at.unsqueeze(-2), prefix).squeeze(-2).expand(*lead, at.shape[-2], c.shape[-1]))
        state = prefix[..., -1, :, :]
    return torch.cat(outs, dim=-2)
