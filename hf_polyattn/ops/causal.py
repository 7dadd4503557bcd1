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

Decay (``decay=(qlog, klog)``, cumulative log-decays per row; RetNet / GLA): the product becomes

    out_i = sum_{j <= i} exp(qlog_i - klog_j) (phi(a_i) . phi(b_j)) c_j

with qlog (..., n) broadcasting like A's leading dims and klog (..., n) like B's and C's (one decay per key of a
kv head). Contract, the caller's duty: klog non-increasing along n and qlog_i <= klog_i, so that every exponent
used below is <= 0 (nothing overflows, however strong the decay). Gates g_t in (0, 1] give qlog = klog = cumsum(log
g); a window's shifted product passes qlog = G[w:], klog = G[:n-w] (``window.shifted_lt``). The block algorithm
keeps the state referenced at the last key of its block, P_m = sum_{j < t_m} exp(klog_{t_m - 1} - klog_j)
phi(B_j)^T C_j, so a block's queries read it times exp(qlog_i - klog_{s_m - 1}) and the state moves on by
exp(klog_{t_m - 1} - klog_{s_m - 1}): each factor is a decay over a stretch of the sequence, in (0, 1]. The
gradients of the log-decays need no recurrence of their own: every term of out_i carries exp(qlog_i) and every
term with key j carries exp(-klog_j), so d qlog_i = <dOut_i, out_i> = <phi(a_i), dphi(a_i)> and d klog_j =
-<c_j, dC_j>.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from .sketches import symmetric_power_indices, symmetric_square

__all__ = ["check_decay", "decay_matrix", "decayed_running_sums", "lt_multiply", "lt_multiply_batched",
           "lt_multiply_cumsum"]


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


def check_decay(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, decay) -> tuple[torch.Tensor, torch.Tensor]:
    """(qlog, klog) of ``decay`` after the checks every implementation makes (ValueError naming the argument):
    two float tensors of length n, qlog's leading dims broadcasting to the product's (A's, B's, C's together),
    klog's to B's and C's (a key's decay is shared by the query groups of its kv head)."""
    if not (isinstance(decay, (tuple, list)) and len(decay) == 2
            and all(isinstance(x, torch.Tensor) for x in decay)):
        raise ValueError(f"decay must be None or a pair (qlog, klog) of tensors, got {type(decay).__name__}")
    qlog, klog = decay
    n = a.shape[-2]
    lead = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2], c.shape[:-2])
    kv_lead = torch.broadcast_shapes(b.shape[:-2], c.shape[:-2])
    for name, x, target, like in (("qlog", qlog, lead, "a, b, c"), ("klog", klog, kv_lead, "b and c")):
        if not x.is_floating_point():
            raise ValueError(f"decay's {name} must be a float tensor, got {x.dtype}")
        if x.dim() < 1 or x.shape[-1] != n:
            raise ValueError(f"decay's {name} must have shape (..., n) with n = {n}, got {tuple(x.shape)}")
        try:
            ok = torch.broadcast_shapes(x.shape[:-1], target) == target
        except RuntimeError:
            ok = False
        if not ok:
            raise ValueError(f"decay's {name} leading dims {tuple(x.shape[:-1])} must broadcast to those of "
                             f"{like} {tuple(target)}")
        if x.device != a.device:
            raise ValueError(f"decay's {name} is on {x.device} but a is on {a.device}")
    return qlog, klog


def decay_matrix(qlog: torch.Tensor, klog: torch.Tensor) -> torch.Tensor:
    """(..., m, m) exp(qlog_i - klog_j) for j <= i and 0 above the diagonal, masked before the exp: under the
    contract (module doc) no exponent taken is positive, whatever qlog_i - klog_j is for j > i."""
    x = qlog.unsqueeze(-1) - klog.unsqueeze(-2)
    m = x.shape[-1]
    keep = torch.ones(m, m, dtype=torch.bool, device=x.device).tril()
    return torch.exp(x.masked_fill(~keep, float("-inf")))


# slots a level of ``decayed_running_sums`` combines with one (m x m) matrix of decays
SCAN_GROUP = 64


def decayed_running_sums(x: torch.Tensor, logs: torch.Tensor, group: int = SCAN_GROUP) -> torch.Tensor:
    """y_t = sum_{t' <= t} exp(logs_t - logs_t') x_t' for x (..., S, X) and logs (..., S) non-increasing (leading
    dims broadcasting): running sums over S slots, each referenced at its own slot's log. Groups of ``group`` slots
    take one masked (m x m) decay matrix each; the groups' totals are combined the same way, recursively, and carried
    into the next group by exp(logs_t - logs_{end of the group before}) <= 1: O(S m X) work and O(S m) decays,
    where one (S x S) matrix was S^2 (2047^2 a head for the Triton chunks of n = 128k, T = 64)."""
    s = logs.shape[-1]
    if s <= group:
        return torch.matmul(decay_matrix(logs, logs), x)
    ng = -(-s // group)
    pad = ng * group - s
    lg = _pad_rows(logs, pad).unflatten(-1, (ng, group))  # (..., ng, m)
    local = torch.matmul(decay_matrix(lg, lg), F.pad(x, (0, 0, 0, pad)).unflatten(-2, (ng, group)))
    ends = lg[..., -1]  # each group's last slot: the reference of its total
    carry = decayed_running_sums(local[..., -1, :], ends, group)  # (..., ng, X): everything up to group g's end
    prev = F.pad(carry[..., :-1, :], (0, 0, 1, 0))  # what group g takes from before it (nothing for group 0)
    before = torch.cat([lg[..., :1, 0], ends[..., :-1]], dim=-1)  # its reference (group 0: its first slot, unused)
    out = local + torch.exp(lg - before.unsqueeze(-1)).unsqueeze(-1) * prev.unsqueeze(-2)
    return out.flatten(-3, -2)[..., :s, :]


def _blocks(n: int, block: int):
    for s in range(0, n, block):
        yield s, min(s + block, n)


def _tril_(x: torch.Tensor) -> torch.Tensor:
    return x.tril_()


class _LTMultiply(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, c, block: int, include_diag: bool, square: bool, qlog=None, klog=None):  # noqa: D102
        ctx.save_for_backward(a, b, c, qlog, klog)
        ctx.block, ctx.include_diag, ctx.square = block, include_diag, square
        decay = qlog is not None
        phi = _Features(a.shape[-1], square, a.device, a.dtype)
        n, e = a.shape[-2], c.shape[-1]
        lead = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2], c.shape[:-2])
        out = a.new_empty(*lead, n, e)
        state = a.new_zeros(*torch.broadcast_shapes(b.shape[:-2], c.shape[:-2]), phi.num_features, e)
        for s, t in _blocks(n, block):
            fa, fb, cj = phi(a[..., s:t, :]), phi(b[..., s:t, :]), c[..., s:t, :]
            oj = torch.matmul(fa.transpose(-1, -2), state)
            if decay and s:  # the state is referenced at key s - 1
                oj = oj * _query_decay(qlog, klog, s, t)
            if include_diag:
                scores = torch.matmul(fa.transpose(-1, -2), fb)
                scores = scores * decay_matrix(qlog[..., s:t], klog[..., s:t]) if decay else _tril_(scores)
                oj = oj + torch.matmul(scores, cj)
            out[..., s:t, :] = oj
            state = _next_state(state, fb, cj, klog, s, t)
        return out

    @staticmethod
    def backward(ctx, grad_out):  # noqa: D102
        a, b, c, qlog, klog = ctx.saved_tensors
        block, diag = ctx.block, ctx.include_diag
        decay = qlog is not None
        phi = _Features(a.shape[-1], ctx.square, a.device, a.dtype)
        need_a, need_b, need_c = ctx.needs_input_grad[:3]
        need_q, need_k = ctx.needs_input_grad[6:8] if decay else (False, False)
        n, e = a.shape[-2], c.shape[-1]
        da = torch.zeros_like(a) if need_a else None
        db = torch.zeros_like(b) if need_b else None
        dc = torch.zeros_like(c) if need_c else None
        dq = torch.zeros_like(qlog) if need_q else None
        dk = torch.zeros_like(klog) if need_k else None
        if need_a or need_q:
            # forward order: dA_j = dY_j P_{j-1}^T (+ tril(dY_j C_j^T) phi(B_j)), feature-major
            state = a.new_zeros(*torch.broadcast_shapes(b.shape[:-2], c.shape[:-2]), phi.num_features, e)
            for s, t in _blocks(n, block):
                aj, cj, gj = a[..., s:t, :], c[..., s:t, :], grad_out[..., s:t, :]
                fb = phi(b[..., s:t, :])
                gq = gj * _query_decay(qlog, klog, s, t) if decay and s else gj
                dfa = torch.matmul(state, gq.transpose(-1, -2))
                if diag:
                    dd = torch.matmul(gj, cj.transpose(-1, -2))
                    dd = dd * decay_matrix(qlog[..., s:t], klog[..., s:t]) if decay else _tril_(dd)
                    dfa = dfa + torch.matmul(fb, dd.transpose(-1, -2))
                state = _next_state(state, fb, cj, klog, s, t)
                dxa = phi.backward(aj, dfa)
                if need_a:
                    da[..., s:t, :] = dxa.sum_to_size(aj.shape)
                if need_q:  # <phi(a_i), dphi(a_i)> = a_i . dA_i / p for features homogeneous of degree p = 1, 2
                    dq[..., s:t] = ((aj * dxa).sum(-1) / (2.0 if ctx.square else 1.0)).sum_to_size(dq[..., s:t].shape)
        if need_b or need_c or need_k:
            # reverse order: R_j = sum_{i>j} phi(A_i)^T dY_i;  dB_j = C_j R_j^T, dC_j = phi(B_j) R_j
            # (decay: R_j referenced at the block's last key t - 1, each key scaled by exp(klog_{t-1} - klog_j))
            suffix = None
            for s, t in reversed(list(_blocks(n, block))):
                bj, cj, gj = b[..., s:t, :], c[..., s:t, :], grad_out[..., s:t, :]
                fa, fb = phi(a[..., s:t, :]), phi(bj)
                dfb = dcj = None
                kf = torch.exp(klog[..., t - 1 : t] - klog[..., s:t]) if decay else None
                if diag:
                    dd = torch.matmul(gj, cj.transpose(-1, -2))
                    sc = torch.matmul(fa.transpose(-1, -2), fb)
                    if decay:
                        w = decay_matrix(qlog[..., s:t], klog[..., s:t])
                        dd, sc = dd * w, sc * w
                    else:
                        dd, sc = _tril_(dd), _tril_(sc)
                    dfb = torch.matmul(fa, dd)
                    dcj = torch.matmul(sc.transpose(-1, -2), gj)
                if suffix is not None:
                    far_b = torch.matmul(suffix, cj.transpose(-1, -2))
                    far_c = torch.matmul(fb.transpose(-1, -2), suffix)
                    if decay:
                        far_b, far_c = far_b * kf.unsqueeze(-2), far_c * kf.unsqueeze(-1)
                    dfb = far_b if dfb is None else dfb + far_b
                    dcj = far_c if dcj is None else dcj + far_c
                if dfb is not None:
                    if need_b:
                        db[..., s:t, :] = phi.backward(bj, dfb).sum_to_size(bj.shape)
                    if need_c:
                        dc[..., s:t, :] = dcj.sum_to_size(cj.shape)
                    if need_k:
                        dk[..., s:t] = (-(cj * dcj).sum(-1)).sum_to_size(dk[..., s:t].shape)
                if decay:
                    if not s:
                        break  # nothing before the first block reads the suffix
                    # move the reference from key t - 1 to key s - 1, the last key of the block before
                    gq = gj * _query_decay(qlog, klog, s, t)
                    add = torch.matmul(fa, gq)
                    suffix = add if suffix is None else add + suffix * _log_ratio(klog, t - 1, s - 1)
                else:
                    add = torch.matmul(fa, gj)
                    suffix = add if suffix is None else suffix + add
        return da, db, dc, None, None, None, dq, dk


def _query_decay(qlog: torch.Tensor, klog: torch.Tensor, s: int, t: int) -> torch.Tensor:
    """exp(qlog_i - klog_{s-1}) of the queries of block [s, t) (s > 0) as a (..., t - s, 1) factor: from the state's
    reference, the last key of the block before, to each query."""
    return torch.exp(qlog[..., s:t] - klog[..., s - 1 : s]).unsqueeze(-1)


def _log_ratio(klog: torch.Tensor, i: int, j: int) -> torch.Tensor:
    """exp(klog_i - klog_j) as a (..., 1, 1) factor of a state (i >= j: in (0, 1])."""
    return torch.exp(klog[..., i : i + 1] - klog[..., j : j + 1]).unsqueeze(-1)


def _next_state(state: torch.Tensor, fb: torch.Tensor, cj: torch.Tensor, klog: torch.Tensor | None, s: int,
                t: int) -> torch.Tensor:
    """The state after block [s, t) from the one before it (feature-major block features ``fb``); with decay
    (``klog``) referenced at key t - 1, from the one referenced at key s - 1."""
    if klog is None:
        return state + torch.matmul(fb, cj)
    kf = torch.exp(klog[..., t - 1 : t] - klog[..., s:t]).unsqueeze(-1)
    add = torch.matmul(fb, cj * kf)
    return add + state * _log_ratio(klog, t - 1, s - 1) if s else add + state


def lt_multiply(
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    block_size: int = 256,
    include_diag: bool = True,
    square: bool = False,
    decay: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Return lt(phi(A) phi(B)^T) C: row i is sum_{j<=i} (phi(a_i) . phi(b_j)) c_j.

    O(n F (b + e)) time for F features, any n. ``square=True`` takes phi = symmetric
    tensor square (features built per block, never stored); otherwise phi = identity.
    With ``include_diag=False`` the b x b diagonal blocks are left out (they are computed
    exactly elsewhere: the ``local_exact`` option). ``decay=(qlog, klog)`` weights term (i, j)
    by exp(qlog_i - klog_j) (module doc: shapes and contract), computed in a's dtype.
    """
    check_lt_arguments(a, b, c, block_size)
    if decay is None:
        return _LTMultiply.apply(a, b, c, block_size, include_diag, square)
    qlog, klog = (x.to(a.dtype) for x in check_decay(a, b, c, decay))
    return _LTMultiply.apply(a, b, c, block_size, include_diag, square, qlog, klog)


def _pad_rows(x: torch.Tensor, pad: int) -> torch.Tensor:
    """x (..., n) with its last entry repeated ``pad`` more times (log-decays of padding rows: no new decay)."""
    return torch.cat([x, x[..., -1:].expand(*x.shape[:-1], pad)], dim=-1) if pad else x


def lt_multiply_batched(
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    block_size: int = 256,
    include_diag: bool = True,
    square: bool = False,
    decay: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """``lt_multiply`` without a loop over blocks: about ten kernels whatever n (see module doc).

    Same arguments and result; memory O(n F + (n / b) F e) instead of O(b F + F e). With ``decay``, each block's
    state is referenced at its last key and the running sums over blocks are decayed ones (``decayed_running_sums``;
    the diagonal blocks take their own b x b decays, masked before the exp): nothing n x n.
    """
    check_lt_arguments(a, b, c, block_size)
    if decay is not None:
        qlog, klog = (x.to(a.dtype) for x in check_decay(a, b, c, decay))
    n = a.shape[-2]
    nb = -(-n // block_size)
    pad = nb * block_size - n
    if pad:
        a, b, c = (F.pad(t, (0, 0, 0, pad)) for t in (a, b, c))
    ab, bb, cb = (t.unflatten(-2, (nb, block_size)) for t in (a, b, c))  # (..., nb, b, .)
    fa, fb = (symmetric_square(ab), symmetric_square(bb)) if square else (ab, bb)
    if decay is not None:
        qb, kb = (_pad_rows(x, pad).unflatten(-1, (nb, block_size)) for x in (qlog, klog))  # (..., nb, b)
        ends = kb[..., -1]  # (..., nb): each block's last key, its state's reference
        before = torch.cat([kb[..., :1, 0], ends[..., :-1]], dim=-1)  # the block before's (block 0: unused)
    # values scaled by their decay to their block's last key (decay), the b x b diagonal blocks read them unscaled
    cs = cb if decay is None else cb * torch.exp(ends.unsqueeze(-1) - kb).unsqueeze(-1)
    states = torch.matmul(fb.transpose(-1, -2), cs)  # (..., nb, F, e): every block's phi(B_j)^T C_j
    if decay is None:
        # exclusive prefix P_{j-1} = sum_{i<j} states_i (shifted cumsum: no cancellation from cumsum - states)
        prefix = torch.cumsum(F.pad(states, (0, 0, 0, 0, 1, 0))[..., :-1, :, :], dim=-3)
        out = torch.matmul(fa, prefix)
    else:
        # P_{m-1} = sum_{l<m} exp(end_{m-1} - end_l) states_l: the running sums shifted by one block
        running = decayed_running_sums(states.flatten(-2), ends).unflatten(-1, states.shape[-2:])
        prefix = F.pad(running, (0, 0, 0, 0, 1, 0))[..., :-1, :, :]
        out = torch.matmul(fa, prefix) * torch.exp(qb - before.unsqueeze(-1)).unsqueeze(-1)
    if include_diag:
        # phi(a).phi(b) = (a.b)^2 for the symmetric square: the b x b block from r-dim dot products
        scores = torch.matmul(ab, bb.transpose(-1, -2))
        if square:
            scores = scores * scores
        scores = scores.tril() if decay is None else scores * decay_matrix(qb, kb)
        out = out + torch.matmul(scores, cb)
    return out.flatten(-3, -2)[..., :n, :]


def lt_multiply_cumsum(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, chunk: int = 64,
                       decay: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Performer's per-token cumulative sum: S_i = sum_{j<=i} b_j^T c_j, out_i = a_i S_i.

    Materialises one (f x e) state per token of a chunk: O(chunk f e) memory forward and
    O(n f e) for autograd's backward, which is why the block algorithm replaces it.
    ``decay=(qlog, klog)`` (module doc): S_i is referenced at key i, S_i = sum_{j<=i} exp(klog_i - klog_j)
    b_j^T c_j (within a chunk by a (chunk x chunk) matrix of decays), and out_i = exp(qlog_i - klog_i) a_i S_i.
    """
    _check_block(chunk)
    if decay is not None:
        qlog, klog = (x.to(a.dtype) for x in check_decay(a, b, c, decay))
    n = a.shape[-2]
    lead = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2], c.shape[:-2])
    state = a.new_zeros(*torch.broadcast_shapes(b.shape[:-2], c.shape[:-2]), b.shape[-1], c.shape[-1])
    outs = []
    for s in range(0, n, chunk):
        bt, ct, at = b[..., s : s + chunk, :], c[..., s : s + chunk, :], a[..., s : s + chunk, :]
        if decay is None:
            prefix = state.unsqueeze(-3) + torch.cumsum(bt.unsqueeze(-1) * ct.unsqueeze(-2), dim=-3)
        else:
            kt = klog[..., s : s + chunk]
            outer = (bt.unsqueeze(-1) * ct.unsqueeze(-2)).flatten(-2)  # (..., t, f e)
            prefix = torch.matmul(decay_matrix(kt, kt), outer).unflatten(-1, state.shape[-2:])
            if s:
                prefix = prefix + torch.exp(kt - klog[..., s - 1 : s])[..., None, None] * state.unsqueeze(-3)
        o = torch.matmul(at.unsqueeze(-2), prefix).squeeze(-2)
        if decay is not None:
            o = o * torch.exp(qlog[..., s : s + chunk] - klog[..., s : s + chunk]).unsqueeze(-1)
        outs.append(o.expand(*lead, at.shape[-2], c.shape[-1]))
        state = prefix[..., -1, :, :]
    return torch.cat(outs, dim=-2)
