"""Causal (lower-triangular) products lt(A B^T) C without an n x n matrix.

``lt_multiply`` is the block algorithm of PolySketchFormer Section 3 (Theorem 3.1):
per block j, U_j = B_j^T C_j; block i reads the exclusive prefix sum of the U's with one
matmul and adds its own lower-triangular b x b block. Every step is a batched matmul
over all blocks at once (no Python loop over blocks), which is what makes it fast on
CPU as well as on GPU.

The backward pass rematerialises: it stores only A, B, C and calls the same forward
three times (on reversed sequences for the upper-triangular products), so no per-block
(r^2 x d) prefix state is kept between forward and backward.

``lt_multiply_cumsum`` is the per-token cumulative-sum algorithm (Performer), kept for
comparison and as a second reference.

Shapes: A (..., n, f), B (..., n, f), C (..., n, e), broadcastable in the leading dims
(grouped-query attention passes B, C with a size-1 group axis that A expands).
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

__all__ = ["lt_multiply", "lt_multiply_cumsum"]


def _check_block(block_size: int) -> None:
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")


def _pad_rows(x: torch.Tensor, n_to: int) -> torch.Tensor:
    n = x.shape[-2]
    return x if n == n_to else F.pad(x, (0, 0, 0, n_to - n))


def _lt_blocks(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, block: int, include_diag: bool) -> torch.Tensor:
    """lt(a b^T) c with n a multiple of ``block``; include_diag=False drops the diagonal blocks."""
    n, f = a.shape[-2], a.shape[-1]
    e = c.shape[-1]
    nb = n // block
    ab = a.reshape(*a.shape[:-2], nb, block, f)
    bb = b.reshape(*b.shape[:-2], nb, block, f)
    cb = c.reshape(*c.shape[:-2], nb, block, e)
    lead = torch.broadcast_shapes(ab.shape[:-2], bb.shape[:-2], cb.shape[:-2])
    out = ab.new_zeros(*lead, block, e)
    if nb > 1:
        # U_j = B_j^T C_j, then the prefix over blocks 0..j-1 feeds block j: (nb-1) states only.
        states = torch.matmul(bb[..., :-1, :, :].transpose(-1, -2), cb[..., :-1, :, :])
        states = states.cumsum(dim=-3)
        out[..., 1:, :, :] = torch.matmul(ab[..., 1:, :, :], states)
    if include_diag:
        scores = torch.matmul(ab, bb.transpose(-1, -2))
        mask = torch.ones(block, block, dtype=torch.bool, device=a.device).tril_()
        scores = scores.masked_fill_(~mask, 0.0)
        out = out + torch.matmul(scores, cb)
    return out.reshape(*lead[:-1], nb * block, e)


class _LTMultiply(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, c, block: int, include_diag: bool):  # noqa: D102
        n = a.shape[-2]
        n_pad = -(-n // block) * block
        ctx.save_for_backward(a, b, c)
        ctx.block, ctx.include_diag = block, include_diag
        out = _lt_blocks(_pad_rows(a, n_pad), _pad_rows(b, n_pad), _pad_rows(c, n_pad), block, include_diag)
        return out[..., :n, :]

    @staticmethod
    def backward(ctx, grad_out):  # noqa: D102
        a, b, c = ctx.saved_tensors
        block, diag = ctx.block, ctx.include_diag
        n = a.shape[-2]
        n_pad = -(-n // block) * block
        # Zero rows appended at the end keep block boundaries aligned under reversal.
        a_, b_, c_, g_ = (_pad_rows(t, n_pad) for t in (a, b, c, grad_out))

        def rev(t):
            return t.flip(-2)

        da = db = dc = None
        if ctx.needs_input_grad[0]:
            # dA = lt(dY C^T) B
            da = _lt_blocks(g_, c_, b_, block, diag)[..., :n, :].sum_to_size(a.shape)
        if ctx.needs_input_grad[1]:
            # dB = ut(C dY^T) A  ==  rev(lt(rev C rev dY^T) rev A)
            db = rev(_lt_blocks(rev(c_), rev(g_), rev(a_), block, diag))[..., :n, :].sum_to_size(b.shape)
        if ctx.needs_input_grad[2]:
            # dC = ut(B A^T) dY  ==  rev(lt(rev B rev A^T) rev dY)
            dc = rev(_lt_blocks(rev(b_), rev(a_), rev(g_), block, diag))[..., :n, :].sum_to_size(c.shape)
        return da, db, dc, None, None


def lt_multiply(
    a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, block_size: int = 256, include_diag: bool = True
) -> torch.Tensor:
    """Return lt(A B^T) C: row i is sum_{j<=i} (a_i . b_j) c_j, in O(n f (b + e)) time.

    Any n (zero rows pad it to a multiple of ``block_size`` internally). With
    ``include_diag=False`` the b x b diagonal blocks are left out (they are computed
    exactly elsewhere: the ``local_exact`` option).
    """
    _check_block(block_size)
    if a.shape[-2] != b.shape[-2] or b.shape[-2] != c.shape[-2]:
        raise ValueError(f"a, b, c need the same length, got {a.shape[-2]}, {b.shape[-2]}, {c.shape[-2]}")
    if a.shape[-1] != b.shape[-1]:
        raise ValueError(f"a and b need the same feature size, got {a.shape[-1]} and {b.shape[-1]}")
    return _LTMultiply.apply(a, b, c, block_size, include_diag)


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
