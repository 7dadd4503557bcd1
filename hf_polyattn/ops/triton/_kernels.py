"""Triton kernels for lt(phi(A) phi(B)^T) C and its gradients (imported lazily: needs triton).

Notation: a sequence of n rows is cut into chunks of T rows (T = the caller's block size, see
``causal.py``); chunk k holds rows [k T, min(k T + T, n)). phi is the identity (F = r features) or
the symmetric square (F = r(r+1)/2 features phi_(i,j)(x) = w_ij x_i x_j for i <= j, w_ij = sqrt(2)
for i < j and 1 for i = j, stored i-major: feature (i, j) is state row i r - i(i-1)/2 + j - i).
Kernels never read a feature tensor from memory; the features are formed on chip, tile by tile.

Square tiles (``COLS``, the default): feature tile i is the row tile of x scaled by its own column
i, phi_i = x * x[:, i] * w_i (rows x R, the columns j < i masked to zero: their pairs are tile j's),
so a tile costs one column load and one multiply a feature; its gradient goes back to x by two
elementwise terms and one row sum (``_tile_grad``). The tiles compute the r^2 pairs, twice the
r(r+1)/2 the states hold (the masked half), on tensor cores; the states keep the symmetric size.
The gathered layout it replaced (``COLS`` False, kept for the before/after timing of
recipes/profile_gpu_kernels.py) formed 64-feature tiles from two gathered loads of the r-dim input
per feature (``_features``: 64 scalar global loads per thread and tile, H100 sm_90 build in
recipes/results/inspect_triton_sm90/) and their gradient through two one-hot matmuls (``_feature_grad``).

Three kinds of kernel, all launched once per call over (tiles x heads):

* ``_state_kernel``: one program per (chunk, F tile, kv head x e tile) writes phi(X_m)^T Y_m of
  its chunk m alone as an fp32 (F x SE) slab (SE: e padded to a multiple of 8 floats, aligned
  rows); the host turns the slabs into running sums with one scan over chunks (``_segment_*``). Prefix states
  P (X = B, Y = C, slot m = chunk m) serve the forward and dA; suffix states U (X = A, Y = dO,
  summed over the query heads of a kv head; slot m = chunk NC-1-m) serve dB and dC. After the
  scan, chunk k reads the far part from slot k-1 (prefix) or NC-2-k (suffix).
* ``_out_kernel`` / ``_da_kernel`` / ``_db_kernel`` / ``_dc_kernel``: one program per (query or
  key tile, head[, e tile]) reads the one state slab of its chunk for the far part and computes the
  diagonal chunk exactly from r-dim dot products, (phi(a).phi(b)) = (a.b)^p with p = 1 or 2.

Head addressing goes through int64 offset tables (one entry per (kv head, query group)), so any
broadcast of the leading dims and any strides work without copies.

Tail column (``TAIL``): when C has 2^m + 1 columns (head_dim values + the normaliser's column
of ones, e = 65 at d = 64), the first 2^m go through the e tiles and the last one is handled apart
with row sums and outer products on the CUDA cores; its states live in their own (F,) slabs
(``z``). Rounding 65 columns up to one 128-wide tile made half of every state and output dot
padding.

Activation (``ACT``, identity features only): phi(x) = act(x) elementwise, applied to every tile of A
and B as it is loaded (1: elu(x) + 1, 2: relu(x)), and dA, dB multiplied by act'(x) as they are stored:
linear attention's feature maps without an n x r feature tensor or its gradient in HBM.

Decay (``DECAY``, ``causal``'s module doc): fp32 tables of cumulative log-decays, qlog (H, G, n) per query row
and klog (H, n) per key, give every term (i, j) the factor exp(qlog_i - klog_j). A chunk's state slab is
referenced at one key (the prefix at its chunk's last key, the suffix at the key before its chunk): its rows are
scaled by exp(klog_ref - klog_j) (prefix) or exp(qlog_i - klog_ref) (suffix) as they are summed, the host decays
the slabs into running sums, and a tile that reads a slab scales its rows by the decay from the slab's
reference to the row. Exact pairs take exp(qlog_i - klog_j) directly. Every exponent is masked before the exp
(``_masked_exp``) and <= 0 under the contract. The gradient of qlog comes out of ``_da_kernel`` as
<phi(a_i), dphi(a_i)> (= a_i . dA_i / 2 for square features, whose phi is homogeneous of degree 2); that of klog,
-<c_j, dC_j>, is a row sum the host forms from dC.

All accumulation is fp32; features and states never exist in half precision (degree-4..8
polynomial values overflow fp16's 65504). ``PREC`` is the fp32 dot precision: "tf32x3" keeps
fp32 accuracy (~1e-6 relative) on tensor cores, "tf32" is ~5e-4 relative and 3x cheaper. Inputs in
bf16/fp16 are converted to fp32 on load; their values are exact in tf32 (8 and 11 significant
bits, tf32 keeps 11), so r-dim dots of raw inputs lose nothing either way.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _if_last(mask, pid_e, ne):
    """``mask`` in the last e tile's program (the one that owns the tail column), else all False.
    Formed elementwise: Triton 3.9's interpreter mis-types a (block & scalar) mask."""
    return mask & ((mask.to(tl.int32) * 0 + pid_e) == ne - 1)


@triton.jit
def _masked_exp(x, ok):
    """exp(x) where ``ok``, 0 elsewhere, the mask applied before the exp: padding rows and pairs outside the causal
    part may hold any exponent, the decay contract bounds only the ones taken (by 0)."""
    return tl.where(ok, tl.exp(tl.where(ok, x, 0.0)), 0.0)


@triton.jit
def _act(x, mask, ACT: tl.constexpr):
    """act(x) where ``mask``, 0 elsewhere (masked loads give x = 0, and elu(0) + 1 = 1 is no padding)."""
    if ACT == 1:
        x = tl.where(mask, tl.where(x > 0, x + 1.0, tl.exp(x)), 0.0)
    elif ACT == 2:
        x = tl.where(x > 0, x, 0.0)
    return x


@triton.jit
def _act_grad(dy, x, ACT: tl.constexpr):
    """d act(x) / dx times dy: elu + 1: 1 above 0, exp(x) below; relu: 1 above 0."""
    if ACT == 1:
        dy = dy * tl.where(x > 0, 1.0, tl.exp(x))
    elif ACT == 2:
        dy = tl.where(x > 0, dy, 0.0)
    return dy


@triton.jit
def _features(x_ptr, rows, row_mask, sxn, sxr, i0_ptr, i1_ptr, w_ptr, f0, F,
              SQUARE: tl.constexpr, BF: tl.constexpr, ACT: tl.constexpr):
    """phi(x) for ``rows`` and features f0..f0+BF as a (rows x BF) fp32 tile, formed on chip."""
    fs = f0 + tl.arange(0, BF)
    fmask = fs < F
    m = row_mask[:, None] & fmask[None, :]
    if SQUARE:
        i0 = tl.load(i0_ptr + fs, mask=fmask, other=0)
        i1 = tl.load(i1_ptr + fs, mask=fmask, other=0)
        w = tl.load(w_ptr + fs, mask=fmask, other=0.0)
        # two gathers from the same (rows x r) tile: served by L1, never an n x F tensor in HBM
        x0 = tl.load(x_ptr + rows[:, None] * sxn + i0[None, :] * sxr, mask=m, other=0.0).to(tl.float32)
        x1 = tl.load(x_ptr + rows[:, None] * sxn + i1[None, :] * sxr, mask=m, other=0.0).to(tl.float32)
        phi = x0 * x1 * w[None, :]
    else:
        phi = tl.load(x_ptr + rows[:, None] * sxn + fs[None, :] * sxr, mask=m, other=0.0).to(tl.float32)
        phi = _act(phi, m, ACT)
    return phi


@triton.jit
def _feature_grad(dphi, x_ptr, rows, row_mask, sxn, sxr, i0_ptr, i1_ptr, w_ptr, f0, F,
                  SQUARE: tl.constexpr, BF: tl.constexpr, R: tl.constexpr, PREC: tl.constexpr):
    """Gradient w.r.t. the r columns of x (rows x R) from the gradient of a phi tile (rows x BF).

    d phi_f / d x_z = w_f (x[i1_f] [z = i0_f] + x[i0_f] [z = i1_f]): a scatter over f, done as
    two matmuls with one-hot (BF x R) matrices built in registers (tensor cores, no atomics).
    """
    fs = f0 + tl.arange(0, BF)
    fmask = fs < F
    zs = tl.arange(0, R)
    if SQUARE:
        m = row_mask[:, None] & fmask[None, :]
        i0 = tl.load(i0_ptr + fs, mask=fmask, other=0)
        i1 = tl.load(i1_ptr + fs, mask=fmask, other=0)
        w = tl.load(w_ptr + fs, mask=fmask, other=0.0)
        x0 = tl.load(x_ptr + rows[:, None] * sxn + i0[None, :] * sxr, mask=m, other=0.0).to(tl.float32)
        x1 = tl.load(x_ptr + rows[:, None] * sxn + i1[None, :] * sxr, mask=m, other=0.0).to(tl.float32)
        wd = dphi * w[None, :]
        e0 = ((i0[:, None] == zs[None, :]) & fmask[:, None]).to(tl.float32)
        e1 = ((i1[:, None] == zs[None, :]) & fmask[:, None]).to(tl.float32)
        dx = tl.dot(wd * x1, e0, input_precision=PREC) + tl.dot(wd * x0, e1, input_precision=PREC)
    elif BF == R:
        dx = dphi  # identity features, one tile covers all r columns
    else:
        e0 = ((fs[:, None] == zs[None, :]) & fmask[:, None]).to(tl.float32)
        dx = tl.dot(dphi, e0, input_precision=PREC)
    return dx


_SQRT2 = tl.constexpr(1.4142135623730951)


@triton.jit
def _row_tile(x_ptr, rows, row_mask, sxn, sxr, r, R: tl.constexpr, ACT: tl.constexpr):
    """The (rows x R) fp32 tile of act(x) for the r-dim input x (columns r..R-1 zero): one vectorisable load."""
    zs = tl.arange(0, R)
    m = row_mask[:, None] & (zs < r)[None, :]
    return _act(tl.load(x_ptr + rows[:, None] * sxn + zs[None, :] * sxr, mask=m, other=0.0).to(tl.float32), m, ACT)


@triton.jit
def _num_tiles(r, F, SQUARE: tl.constexpr, COLS: tl.constexpr, BF: tl.constexpr):
    """Feature tiles of phi: one per column i for square tiles, else ceil(F / BF)."""
    if SQUARE and COLS:
        nt = r
    else:
        nt = tl.cdiv(F, BF)
    return nt


@triton.jit
def _square_weights(t, r, BF: tl.constexpr):
    """(j, w_tj, state row of pair (t, j)) of square tile t: w = sqrt(2) for j > t, 1 for j = t, 0 for
    j < t (pair (j, t) belongs to tile j) and for j >= r."""
    js = tl.arange(0, BF)
    w = tl.where((js >= t) & (js < r), tl.where(js > t, _SQRT2, 1.0), 0.0)
    # pair (t, j) sits at row t r - t(t-1)/2 + (j - t) of the i-major symmetric order
    return js, w, t * r - (t * (t + 1)) // 2 + js


@triton.jit
def _tile_slots(t, r, F, SQUARE: tl.constexpr, COLS: tl.constexpr, BF: tl.constexpr):
    """(state rows (BF,), which of them exist) of feature tile t."""
    if SQUARE and COLS:
        js, w, fs = _square_weights(t, r, BF)
        keep = w != 0.0
    else:
        fs = t * BF + tl.arange(0, BF)
        keep = fs < F
    return fs, keep


@triton.jit
def _tile(t, xs, x_ptr, rows, row_mask, sxn, sxr, i0_ptr, i1_ptr, w_ptr, r, F,
          SQUARE: tl.constexpr, COLS: tl.constexpr, BF: tl.constexpr, ACT: tl.constexpr):
    """phi tile t (rows x BF) fp32 (its state rows: ``_tile_slots``). ``xs``: the rows' (rows x R) input tile
    (square tiles scale it by its own column t; unused otherwise)."""
    if SQUARE and COLS:
        js, w, fs = _square_weights(t, r, BF)
        xt = tl.load(x_ptr + rows * sxn + t * sxr, mask=row_mask, other=0.0).to(tl.float32)
        phi = xs * (xt[:, None] * w[None, :])
    else:
        phi = _features(x_ptr, rows, row_mask, sxn, sxr, i0_ptr, i1_ptr, w_ptr, t * BF, F, SQUARE, BF, ACT)
    return phi


@triton.jit
def _tile_grad(dphi, t, xs, x_ptr, rows, row_mask, sxn, sxr, i0_ptr, i1_ptr, w_ptr, r, F,
               SQUARE: tl.constexpr, COLS: tl.constexpr, BF: tl.constexpr, R: tl.constexpr, PREC: tl.constexpr):
    """(rows x R) gradient of x from the gradient of phi tile t. Square tiles: phi_tj = w_tj x_t x_j, so
    dx_j += w_tj x_t dphi_tj and dx_t += sum_j w_tj x_j dphi_tj (j = t gets both: d x_t^2 = 2 x_t)."""
    if SQUARE and COLS:
        js, w, fs = _square_weights(t, r, BF)
        xt = tl.load(x_ptr + rows * sxn + t * sxr, mask=row_mask, other=0.0).to(tl.float32)
        wd = dphi * w[None, :]
        dx = wd * xt[:, None] + tl.where(js[None, :] == t, tl.sum(wd * xs, axis=1)[:, None], 0.0)
    else:
        dx = _feature_grad(dphi, x_ptr, rows, row_mask, sxn, sxr, i0_ptr, i1_ptr, w_ptr, t * BF, F, SQUARE, BF, R,
                           PREC)
    return dx


@triton.jit
def _chunk_tile(pid, n, T, QPC, BQ: tl.constexpr):
    """(chunk k, first row, chunk end, rows, which rows exist) of row tile ``pid`` (QPC tiles a chunk)."""
    k = pid // QPC
    first = k * T + (pid % QPC) * BQ
    c_end = tl.minimum(k * T + T, n)
    rows = first + tl.arange(0, BQ)
    return k, first, c_end, rows, rows < c_end


@triton.jit
def _exact_pair(qi, kj, BLK, INCLUDE_DIAG: tl.constexpr):
    """Which (query i, key j) pairs of one chunk the chunk's exact part takes (broadcast index tensors): j <= i
    with the diagonal included, else the pairs of different blocks, block(j) < block(i) (the dropped diagonal
    blocks are BLK rows aligned at 0; chunks are whole blocks)."""
    if INCLUDE_DIAG:
        ok = kj <= qi
    else:
        ok = (kj // BLK) < (qi // BLK)
    return ok


@triton.jit
def _exact_weights(x, rows, rmask, cols, cmask, ql, klog_ptr, BLK, INCLUDE_DIAG: tl.constexpr, DECAY: tl.constexpr,
                   KEYS_FIRST: tl.constexpr):
    """x (queries ``rows`` x keys ``cols``; ``KEYS_FIRST``: keys x queries) on the chunk's exact pairs
    (``_exact_pair``), 0 elsewhere; ``DECAY``: times exp(qlog_i - klog_j) (``ql``: the rows' qlog, ``klog_ptr``:
    the kv head's klog)."""
    if KEYS_FIRST:
        ok = _exact_pair(rows[None, :], cols[:, None], BLK, INCLUDE_DIAG)
    else:
        ok = _exact_pair(rows[:, None], cols[None, :], BLK, INCLUDE_DIAG)
    if DECAY:
        kl = tl.load(klog_ptr + cols, mask=cmask, other=0.0)
        if KEYS_FIRST:
            x = x * _masked_exp(ql[None, :] - kl[:, None], ok & cmask[:, None] & rmask[None, :])
        else:
            x = x * _masked_exp(ql[:, None] - kl[None, :], ok & rmask[:, None] & cmask[None, :])
    else:
        x = tl.where(ok, x, 0.0)
    return x


@triton.jit
def _key_decay(klog_ptr, cols, cmask, c_end):
    """exp(klog_{c_end - 1} - klog_j) of the keys ``cols``: from each key to its chunk's last key, the suffix
    state's reference (0 for padding rows)."""
    kl = tl.load(klog_ptr + cols, mask=cmask, other=0.0)
    return _masked_exp(tl.load(klog_ptr + c_end - 1) - kl, cmask)


@triton.jit
def _query_logs(qlog_ptr, hg, n, rows, rmask, DECAY: tl.constexpr, BQ: tl.constexpr):
    """qlog of the query ``rows`` of head x group ``hg`` (zeros without ``DECAY``: never read)."""
    ql = tl.zeros((BQ,), dtype=tl.float32)
    if DECAY:
        ql = tl.load(qlog_ptr + hg.to(tl.int64) * n + rows, mask=rmask, other=0.0)
    return ql


@triton.jit
def _exact_keys_end(q0, BLK, INCLUDE_DIAG: tl.constexpr, BQ: tl.constexpr):
    """End of the keys the query tile [q0, q0 + BQ) takes exactly (they start at its chunk's start)."""
    if INCLUDE_DIAG:
        hi = q0 + BQ
    else:
        hi = ((q0 + BQ - 1) // BLK) * BLK  # the start of the last row's block
    return hi


@triton.jit
def _exact_queries_start(k0, BLK, INCLUDE_DIAG: tl.constexpr):
    """First query that takes the key tile starting at k0 exactly (they end at its chunk's end)."""
    if INCLUDE_DIAG:
        lo = k0
    else:
        lo = (k0 // BLK + 1) * BLK  # the next block
    return lo


@triton.jit
def _far_input_grad(y_ptr, rows, rmask, syn, sye, yz, s_base, z_base, x_ptr, xs, sxn, sxr, i0_ptr, i1_ptr, w_ptr,
                    r, F, E, SE, SQUARE: tl.constexpr, COLS: tl.constexpr, TAIL: tl.constexpr, BQ: tl.constexpr,
                    BF: tl.constexpr, BE: tl.constexpr, R: tl.constexpr, PREC: tl.constexpr):
    """(rows x R) gradient of the r-dim inputs X through dphi(X) = Y S^T: the far part of dA (Y = dO,
    S = prefix state, X = A) and of dB (Y = C, S = suffix state, X = B); ``yz`` is Y's tail column,
    z_base its state slab, ``xs`` X's (rows x R) tile."""
    acc = tl.zeros((BQ, R), dtype=tl.float32)
    for t in range(0, _num_tiles(r, F, SQUARE, COLS, BF)):
        fs, fmask = _tile_slots(t, r, F, SQUARE, COLS, BF)
        dphi = tl.zeros((BQ, BF), dtype=tl.float32)
        if TAIL:
            zt = tl.load(z_base + fs, mask=fmask, other=0.0)
            dphi += yz[:, None] * zt[None, :]
        for e0 in range(0, E, BE):
            es = e0 + tl.arange(0, BE)
            emask = es < E
            yt = tl.load(y_ptr + rows[:, None] * syn + es[None, :] * sye,
                         mask=rmask[:, None] & emask[None, :], other=0.0).to(tl.float32)
            st = tl.load(s_base + fs[:, None] * SE + es[None, :], mask=fmask[:, None] & emask[None, :], other=0.0)
            dphi += tl.dot(yt, tl.trans(st), input_precision=PREC)
        acc += _tile_grad(dphi, t, xs, x_ptr, rows, rmask, sxn, sxr, i0_ptr, i1_ptr, w_ptr, r, F, SQUARE, COLS, BF,
                          R, PREC)
    return acc


@triton.jit
def _pair_dots(x_ptr, xrows, xmask, sxn, sxe, xz, y_ptr, yrows, ymask, syn, sye, yz, E,
               TAIL: tl.constexpr, BQ: tl.constexpr, BE: tl.constexpr, PREC: tl.constexpr):
    """(BQ x BQ) X[xrows] . Y[yrows] over the E tiled columns, plus the tail columns' outer product."""
    d = tl.zeros((BQ, BQ), dtype=tl.float32)
    for e0 in range(0, E, BE):
        es = e0 + tl.arange(0, BE)
        emask = es < E
        xt = tl.load(x_ptr + xrows[:, None] * sxn + es[None, :] * sxe,
                     mask=xmask[:, None] & emask[None, :], other=0.0).to(tl.float32)
        yt = tl.load(y_ptr + yrows[:, None] * syn + es[None, :] * sye,
                     mask=ymask[:, None] & emask[None, :], other=0.0).to(tl.float32)
        d += tl.dot(xt, tl.trans(yt), input_precision=PREC)
    if TAIL:
        d += xz[:, None] * yz[None, :]
    return d


@triton.jit
def _state_kernel(x_ptr, y_ptr, s_ptr, z_ptr, x_off_ptr, y_off_ptr, i0_ptr, i1_ptr, w_ptr, xlog_ptr, klog_ptr,
                  n, r, F, E, SE, G, T, NC, sxn, sxr, syn, sye,
                  REVERSE: tl.constexpr, SQUARE: tl.constexpr, COLS: tl.constexpr, TAIL: tl.constexpr,
                  BT: tl.constexpr, BF: tl.constexpr, BE: tl.constexpr, R: tl.constexpr, PREC: tl.constexpr,
                  ACT: tl.constexpr, DECAY: tl.constexpr):
    """Slot k (REVERSE: NC-1-k) of s gets phi(X_k)^T Y_k of chunk k alone, summed over the G groups.

    NC - 1 slots: the forward reads chunks 0..NC-2 (the last chunk's state is never read), the
    reverse 1..NC-1. One program per (chunk, feature tile, kv head x e tile): every chunk in parallel;
    the host turns the slots into running sums with one scan over the chunk axis. (A first
    version walked the chunks in order inside 144 programs at n = 32k, H = 16: latency-bound,
    5.2 ms of a 30 ms forward+backward on an H100.) ``TAIL``: the last e tile's program also
    writes phi(X_k)^T y_k of Y's column E (the tail) into z. ``DECAY``: Y's rows are scaled to the slot's
    reference key, exp(klog_ref - xlog_j) for the prefix (X = B, xlog = klog, reference the chunk's last key) and
    exp(xlog_i - klog_ref) for the suffix (X = A, xlog = qlog of each group, reference the key before the chunk).
    """
    if REVERSE:
        k = tl.program_id(0) + 1
    else:
        k = tl.program_id(0)
    t = tl.program_id(1)
    pid_he = tl.program_id(2)
    ne = tl.cdiv(E, BE)
    h = pid_he // ne
    pid_e = pid_he % ne
    es = pid_e * BE + tl.arange(0, BE)
    emask = es < E
    # square tiles accumulate the slab transposed, (BE x BF) = Y^T phi: as phi^T Y an R = 32 tile had 32 rows,
    # too few for Hopper's 64-row warpgroup MMA (the sm_90 build fell back to mma.sync: HMMA, no HGMMA in
    # recipes/results/inspect_triton_sm90/); identity tiles keep (BF x BE) (transposed, 197 -> 224 registers at BF = 64)
    if SQUARE and COLS:
        acc = tl.zeros((BE, BF), dtype=tl.float32)
    else:
        acc = tl.zeros((BF, BE), dtype=tl.float32)
    acc_z = tl.zeros((BF,), dtype=tl.float32)
    c_start = k * T
    c_end = tl.minimum(c_start + T, n)
    fs, fmask = _tile_slots(t, r, F, SQUARE, COLS, BF)
    ref = 0.0
    if DECAY:
        if REVERSE:
            ref = tl.load(klog_ptr + h.to(tl.int64) * n + c_start - 1)
        else:
            ref = tl.load(klog_ptr + h.to(tl.int64) * n + c_end - 1)
    for g in range(0, G):
        xo = tl.load(x_off_ptr + h * G + g)
        yo = tl.load(y_off_ptr + h * G + g)
        for t0 in range(c_start, c_end, BT):
            rows = t0 + tl.arange(0, BT)
            rmask = rows < c_end
            xs = tl.zeros((BT, R), dtype=tl.float32)
            if SQUARE and COLS:
                xs = _row_tile(x_ptr + xo, rows, rmask, sxn, sxr, r, R, 0)
            phi = _tile(t, xs, x_ptr + xo, rows, rmask, sxn, sxr, i0_ptr, i1_ptr, w_ptr, r, F, SQUARE, COLS, BF, ACT)
            y = tl.load(y_ptr + yo + rows[:, None] * syn + es[None, :] * sye,
                        mask=rmask[:, None] & emask[None, :], other=0.0).to(tl.float32)
            f = tl.zeros((BT,), dtype=tl.float32)
            if DECAY:
                xl = tl.load(xlog_ptr + (h * G + g).to(tl.int64) * n + rows, mask=rmask, other=0.0)
                if REVERSE:
                    f = _masked_exp(xl - ref, rmask)
                else:
                    f = _masked_exp(ref - xl, rmask)
                y = y * f[:, None]
            if SQUARE and COLS:
                acc += tl.dot(tl.trans(y), phi, input_precision=PREC)
            else:
                acc += tl.dot(tl.trans(phi), y, input_precision=PREC)
            if TAIL:
                yz = tl.load(y_ptr + yo + rows * syn + E * sye, mask=_if_last(rmask, pid_e, ne), other=0.0)
                yz = yz.to(tl.float32)
                if DECAY:
                    yz = yz * f
                acc_z += tl.sum(phi * yz[:, None], axis=0)
    if REVERSE:
        slot = NC - 1 - k
    else:
        slot = k
    if TAIL:
        z_tile = z_ptr + h.to(tl.int64) * (NC - 1) * F + slot.to(tl.int64) * F + fs
        tl.store(z_tile, acc_z, mask=_if_last(fmask, pid_e, ne))
    # padding columns E..SE-1 get the zeros of the masked loads: the whole slab is defined
    s_slab = s_ptr + h.to(tl.int64) * (NC - 1) * F * SE + slot.to(tl.int64) * F * SE
    if SQUARE and COLS:
        tl.store(s_slab + fs[None, :] * SE + es[:, None], acc, mask=fmask[None, :] & (es[:, None] < SE))
    else:
        tl.store(s_slab + fs[:, None] * SE + es[None, :], acc, mask=fmask[:, None] & (es[None, :] < SE))


@triton.jit
def _out_kernel(a_ptr, b_ptr, c_ptr, s_ptr, z_ptr, o_ptr, a_off_ptr, b_off_ptr, c_off_ptr, o_off_ptr,
                i0_ptr, i1_ptr, w_ptr, qlog_ptr, klog_ptr,
                n, r, F, E, SE, G, T, NC, QPC, BLK, san, sar, sbn, sbr, scn, sce, son, soe,
                INCLUDE_DIAG: tl.constexpr, QUAD: tl.constexpr, SQUARE: tl.constexpr, COLS: tl.constexpr,
                TAIL: tl.constexpr, BQ: tl.constexpr, BF: tl.constexpr, BE: tl.constexpr, R: tl.constexpr,
                PREC: tl.constexpr, ACT: tl.constexpr, DECAY: tl.constexpr):
    """out[rows, e tile] = phi(A_rows) P_k + (QUAD) sum over the chunk's exact pairs (a_i.b_j)^p c_j: j <= i
    (INCLUDE_DIAG) or block(j) < block(i) (``_exact_pair``; QUAD: the diagonal is included or chunks hold several
    blocks). ``TAIL``: the last e tile also writes column E from z and c's column E. ``DECAY``: the far part times
    exp(qlog_i - klog_{kT-1}) (P_k's reference), each exact pair times exp(qlog_i - klog_j)."""
    pid_q = tl.program_id(0)
    hg = tl.program_id(1)
    pid_e = tl.program_id(2)
    ne = tl.num_programs(2)
    h = hg // G
    k, q0, c_end, rows, rmask = _chunk_tile(pid_q, n, T, QPC, BQ)
    es = pid_e * BE + tl.arange(0, BE)
    emask = es < E
    ao = tl.load(a_off_ptr + hg)
    oo = tl.load(o_off_ptr + hg)
    qa = _row_tile(a_ptr + ao, rows, rmask, san, sar, r, R, ACT)  # square tiles' input and the diagonal's queries
    acc = tl.zeros((BQ, BE), dtype=tl.float32)
    acc_z = tl.zeros((BQ,), dtype=tl.float32)
    ql = _query_logs(qlog_ptr, hg, n, rows, rmask, DECAY, BQ)
    if k > 0:  # P_0 = 0: the first chunk has no far part
        s_base = s_ptr + h.to(tl.int64) * (NC - 1) * F * SE + (k - 1).to(tl.int64) * F * SE
        z_base = z_ptr + h.to(tl.int64) * (NC - 1) * F + (k - 1).to(tl.int64) * F
        for t in range(0, _num_tiles(r, F, SQUARE, COLS, BF)):
            fs, fmask = _tile_slots(t, r, F, SQUARE, COLS, BF)
            phi = _tile(t, qa, a_ptr + ao, rows, rmask, san, sar, i0_ptr, i1_ptr, w_ptr, r, F, SQUARE, COLS, BF,
                        ACT)
            st = tl.load(s_base + fs[:, None] * SE + es[None, :], mask=fmask[:, None] & emask[None, :], other=0.0)
            acc += tl.dot(phi, st, input_precision=PREC)
            if TAIL:
                zt = tl.load(z_base + fs, mask=_if_last(fmask, pid_e, ne), other=0.0)
                acc_z += tl.sum(phi * zt[None, :], axis=1)
        if DECAY:
            f = _masked_exp(ql - tl.load(klog_ptr + h.to(tl.int64) * n + k * T - 1), rmask)
            acc = acc * f[:, None]
            acc_z = acc_z * f
    if QUAD:
        bo = tl.load(b_off_ptr + h)
        co = tl.load(c_off_ptr + h)
        for j0 in range(k * T, _exact_keys_end(q0, BLK, INCLUDE_DIAG, BQ), BQ):
            cols = j0 + tl.arange(0, BQ)
            cmask = cols < c_end
            kb = _row_tile(b_ptr + bo, cols, cmask, sbn, sbr, r, R, ACT)
            s = tl.dot(qa, tl.trans(kb), input_precision=PREC)
            if SQUARE:
                s = s * s
            s = _exact_weights(s, rows, rmask, cols, cmask, ql, klog_ptr + h.to(tl.int64) * n, BLK, INCLUDE_DIAG,
                               DECAY, False)
            cv = tl.load(c_ptr + co + cols[:, None] * scn + es[None, :] * sce,
                         mask=cmask[:, None] & emask[None, :], other=0.0).to(tl.float32)
            acc += tl.dot(s, cv, input_precision=PREC)
            if TAIL:
                cz = tl.load(c_ptr + co + cols * scn + E * sce, mask=_if_last(cmask, pid_e, ne), other=0.0)
                cz = cz.to(tl.float32)
                acc_z += tl.sum(s * cz[None, :], axis=1)
    tl.store(o_ptr + oo + rows[:, None] * son + es[None, :] * soe, acc, mask=rmask[:, None] & emask[None, :])
    if TAIL:
        tl.store(o_ptr + oo + rows * son + E * soe, acc_z, mask=_if_last(rmask, pid_e, ne))


@triton.jit
def _da_kernel(a_ptr, b_ptr, c_ptr, g_ptr, s_ptr, z_ptr, da_ptr, a_off_ptr, b_off_ptr, c_off_ptr, g_off_ptr,
               da_off_ptr, i0_ptr, i1_ptr, w_ptr, qlog_ptr, klog_ptr, dq_ptr,
               n, r, F, E, SE, G, T, NC, QPC, BLK, san, sar, sbn, sbr, scn, sce, sgn, sge, sdn, sdr,
               INCLUDE_DIAG: tl.constexpr, QUAD: tl.constexpr, SQUARE: tl.constexpr, COLS: tl.constexpr,
               TAIL: tl.constexpr, BQ: tl.constexpr, BF: tl.constexpr, BE: tl.constexpr, R: tl.constexpr,
               PREC: tl.constexpr, ACT: tl.constexpr, DECAY: tl.constexpr):
    """dA rows: far part through dphi(A) = dO P_k^T, the chunk's exact pairs from D_ij = dO_i . c_j. ``DECAY``: the
    decays of ``_out_kernel``, and dq (H, G, n) gets d qlog_i = <phi(a_i), dphi(a_i)>."""
    pid_q = tl.program_id(0)
    hg = tl.program_id(1)
    h = hg // G
    k, q0, c_end, rows, rmask = _chunk_tile(pid_q, n, T, QPC, BQ)
    ao = tl.load(a_off_ptr + hg)
    go = tl.load(g_off_ptr + hg)
    zs = tl.arange(0, R)
    zmask = zs < r
    qa = _row_tile(a_ptr + ao, rows, rmask, san, sar, r, R, 0)  # square tiles' input (ACT: identity features only)
    acc = tl.zeros((BQ, R), dtype=tl.float32)
    gz = tl.zeros((BQ,), dtype=tl.float32)
    if TAIL:  # dO's tail column, against z (far part) and c's tail column (diagonal chunk)
        gz = tl.load(g_ptr + go + rows * sgn + E * sge, mask=rmask, other=0.0).to(tl.float32)
    ql = _query_logs(qlog_ptr, hg, n, rows, rmask, DECAY, BQ)
    if k > 0:
        s_base = s_ptr + h.to(tl.int64) * (NC - 1) * F * SE + (k - 1).to(tl.int64) * F * SE
        z_base = z_ptr + h.to(tl.int64) * (NC - 1) * F + (k - 1).to(tl.int64) * F
        far = _far_input_grad(g_ptr + go, rows, rmask, sgn, sge, gz, s_base, z_base, a_ptr + ao, qa, san, sar,
                              i0_ptr, i1_ptr, w_ptr, r, F, E, SE, SQUARE, COLS, TAIL, BQ, BF, BE, R, PREC)
        if DECAY:
            far = far * _masked_exp(ql - tl.load(klog_ptr + h.to(tl.int64) * n + k * T - 1), rmask)[:, None]
        acc += far
    if QUAD:
        bo = tl.load(b_off_ptr + h)
        co = tl.load(c_off_ptr + h)
        for j0 in range(k * T, _exact_keys_end(q0, BLK, INCLUDE_DIAG, BQ), BQ):
            cols = j0 + tl.arange(0, BQ)
            cmask = cols < c_end
            kb = _row_tile(b_ptr + bo, cols, cmask, sbn, sbr, r, R, ACT)
            cz = tl.zeros((BQ,), dtype=tl.float32)
            if TAIL:
                cz = tl.load(c_ptr + co + cols * scn + E * sce, mask=cmask, other=0.0).to(tl.float32)
            d = _pair_dots(g_ptr + go, rows, rmask, sgn, sge, gz, c_ptr + co, cols, cmask, scn, sce, cz, E,
                           TAIL, BQ, BE, PREC)
            d = _exact_weights(d, rows, rmask, cols, cmask, ql, klog_ptr + h.to(tl.int64) * n, BLK, INCLUDE_DIAG,
                               DECAY, False)
            if SQUARE:  # d (a.b)^2 / da = 2 (a.b) b
                d = d * 2.0 * tl.dot(qa, tl.trans(kb), input_precision=PREC)
            acc += tl.dot(d, kb, input_precision=PREC)
    if DECAY:  # <phi(a), dphi(a)>: a . dA / 2 for the square (homogeneous of degree 2), act(a) . dphi with ACT
        if SQUARE:
            dql = 0.5 * tl.sum(qa * acc, axis=1)
        elif ACT != 0:
            dql = tl.sum(_row_tile(a_ptr + ao, rows, rmask, san, sar, r, R, ACT) * acc, axis=1)
        else:
            dql = tl.sum(qa * acc, axis=1)
        tl.store(dq_ptr + hg.to(tl.int64) * n + rows, dql, mask=rmask)
    if ACT != 0:
        acc = _act_grad(acc, qa, ACT)
    dao = tl.load(da_off_ptr + hg)
    tl.store(da_ptr + dao + rows[:, None] * sdn + zs[None, :] * sdr, acc, mask=rmask[:, None] & zmask[None, :])


@triton.jit
def _db_kernel(a_ptr, b_ptr, c_ptr, g_ptr, u_ptr, uz_ptr, db_ptr, a_off_ptr, b_off_ptr, c_off_ptr, g_off_ptr,
               db_off_ptr, i0_ptr, i1_ptr, w_ptr, qlog_ptr, klog_ptr,
               n, r, F, E, SE, G, T, NC, QPC, BLK, san, sar, sbn, sbr, scn, sce, sgn, sge, sdn, sdr,
               INCLUDE_DIAG: tl.constexpr, QUAD: tl.constexpr, SQUARE: tl.constexpr, COLS: tl.constexpr,
               TAIL: tl.constexpr, BQ: tl.constexpr, BF: tl.constexpr, BE: tl.constexpr, R: tl.constexpr,
               PREC: tl.constexpr, ACT: tl.constexpr, DECAY: tl.constexpr):
    """dB rows of one kv head: far part through dphi(B) = C U_k^T, the chunk's exact pairs summed over the G groups.
    ``DECAY``: the far part times exp(klog_ref - klog_j) (U_k's reference: the chunk's last key), each exact pair
    times exp(qlog_i - klog_j)."""
    pid_k = tl.program_id(0)
    h = tl.program_id(1)
    k, k0, c_end, cols, cmask = _chunk_tile(pid_k, n, T, QPC, BQ)
    bo = tl.load(b_off_ptr + h)
    co = tl.load(c_off_ptr + h)
    zs = tl.arange(0, R)
    zmask = zs < r
    kb = _row_tile(b_ptr + bo, cols, cmask, sbn, sbr, r, R, 0)  # square tiles' input (ACT: identity features only)
    acc = tl.zeros((BQ, R), dtype=tl.float32)
    cz = tl.zeros((BQ,), dtype=tl.float32)
    if TAIL:  # c's tail column, against uz (far part) and dO's tail column (diagonal chunk)
        cz = tl.load(c_ptr + co + cols * scn + E * sce, mask=cmask, other=0.0).to(tl.float32)
    if k < NC - 1:  # U_{NC-1} = 0: the last chunk has no later chunks
        u_base = u_ptr + h.to(tl.int64) * (NC - 1) * F * SE + (NC - 2 - k).to(tl.int64) * F * SE
        uz_base = uz_ptr + h.to(tl.int64) * (NC - 1) * F + (NC - 2 - k).to(tl.int64) * F
        far = _far_input_grad(c_ptr + co, cols, cmask, scn, sce, cz, u_base, uz_base, b_ptr + bo, kb, sbn, sbr,
                              i0_ptr, i1_ptr, w_ptr, r, F, E, SE, SQUARE, COLS, TAIL, BQ, BF, BE, R, PREC)
        if DECAY:
            far = far * _key_decay(klog_ptr + h.to(tl.int64) * n, cols, cmask, c_end)[:, None]
        acc += far
    if QUAD:
        for g in range(0, G):
            ao = tl.load(a_off_ptr + h * G + g)
            go = tl.load(g_off_ptr + h * G + g)
            for q_start in range(_exact_queries_start(k0, BLK, INCLUDE_DIAG), c_end, BQ):
                rows = q_start + tl.arange(0, BQ)
                rmask = rows < c_end
                qa = _row_tile(a_ptr + ao, rows, rmask, san, sar, r, R, ACT)
                gz = tl.zeros((BQ,), dtype=tl.float32)
                if TAIL:
                    gz = tl.load(g_ptr + go + rows * sgn + E * sge, mask=rmask, other=0.0).to(tl.float32)
                dt = _pair_dots(c_ptr + co, cols, cmask, scn, sce, cz, g_ptr + go, rows, rmask, sgn, sge, gz, E,
                                TAIL, BQ, BE, PREC)
                dt = _exact_weights(dt, rows, rmask, cols, cmask, _query_logs(qlog_ptr, h * G + g, n, rows, rmask,
                                    DECAY, BQ), klog_ptr + h.to(tl.int64) * n, BLK, INCLUDE_DIAG, DECAY, True)
                if SQUARE:
                    dt = dt * 2.0 * tl.dot(kb, tl.trans(qa), input_precision=PREC)
                acc += tl.dot(dt, qa, input_precision=PREC)
    if ACT != 0:
        acc = _act_grad(acc, kb, ACT)
    dbo = tl.load(db_off_ptr + h)
    tl.store(db_ptr + dbo + cols[:, None] * sdn + zs[None, :] * sdr, acc, mask=cmask[:, None] & zmask[None, :])


@triton.jit
def _dc_kernel(a_ptr, b_ptr, g_ptr, u_ptr, uz_ptr, dc_ptr, a_off_ptr, b_off_ptr, g_off_ptr, dc_off_ptr,
               i0_ptr, i1_ptr, w_ptr, qlog_ptr, klog_ptr,
               n, r, F, E, SE, G, T, NC, QPC, BLK, san, sar, sbn, sbr, sgn, sge, sdn, sde,
               INCLUDE_DIAG: tl.constexpr, QUAD: tl.constexpr, SQUARE: tl.constexpr, COLS: tl.constexpr,
               TAIL: tl.constexpr, BQ: tl.constexpr, BF: tl.constexpr, BE: tl.constexpr, R: tl.constexpr,
               PREC: tl.constexpr, ACT: tl.constexpr, DECAY: tl.constexpr):
    """dC rows of one kv head: phi(B) U_k + the chunk's exact pairs (a_i.b_j)^p dO_i summed over the G groups
    (``TAIL``: the last e tile also writes column E from uz and dO's column E). ``DECAY``: as ``_db_kernel``."""
    pid_k = tl.program_id(0)
    h = tl.program_id(1)
    pid_e = tl.program_id(2)
    ne = tl.num_programs(2)
    k, k0, c_end, cols, cmask = _chunk_tile(pid_k, n, T, QPC, BQ)
    es = pid_e * BE + tl.arange(0, BE)
    emask = es < E
    bo = tl.load(b_off_ptr + h)
    kb = _row_tile(b_ptr + bo, cols, cmask, sbn, sbr, r, R, ACT)
    acc = tl.zeros((BQ, BE), dtype=tl.float32)
    acc_z = tl.zeros((BQ,), dtype=tl.float32)
    if k < NC - 1:
        u_base = u_ptr + h.to(tl.int64) * (NC - 1) * F * SE + (NC - 2 - k).to(tl.int64) * F * SE
        uz_base = uz_ptr + h.to(tl.int64) * (NC - 1) * F + (NC - 2 - k).to(tl.int64) * F
        for t in range(0, _num_tiles(r, F, SQUARE, COLS, BF)):
            fs, fmask = _tile_slots(t, r, F, SQUARE, COLS, BF)
            phi = _tile(t, kb, b_ptr + bo, cols, cmask, sbn, sbr, i0_ptr, i1_ptr, w_ptr, r, F, SQUARE, COLS, BF,
                        ACT)
            ut = tl.load(u_base + fs[:, None] * SE + es[None, :], mask=fmask[:, None] & emask[None, :], other=0.0)
            acc += tl.dot(phi, ut, input_precision=PREC)
            if TAIL:
                uz = tl.load(uz_base + fs, mask=_if_last(fmask, pid_e, ne), other=0.0)
                acc_z += tl.sum(phi * uz[None, :], axis=1)
        if DECAY:
            f = _key_decay(klog_ptr + h.to(tl.int64) * n, cols, cmask, c_end)
            acc = acc * f[:, None]
            acc_z = acc_z * f
    if QUAD:
        for g in range(0, G):
            ao = tl.load(a_off_ptr + h * G + g)
            go = tl.load(g_off_ptr + h * G + g)
            for q_start in range(_exact_queries_start(k0, BLK, INCLUDE_DIAG), c_end, BQ):
                rows = q_start + tl.arange(0, BQ)
                rmask = rows < c_end
                qa = _row_tile(a_ptr + ao, rows, rmask, san, sar, r, R, ACT)
                st = tl.dot(kb, tl.trans(qa), input_precision=PREC)
                if SQUARE:
                    st = st * st
                st = _exact_weights(st, rows, rmask, cols, cmask, _query_logs(qlog_ptr, h * G + g, n, rows, rmask,
                                    DECAY, BQ), klog_ptr + h.to(tl.int64) * n, BLK, INCLUDE_DIAG, DECAY, True)
                gt = tl.load(g_ptr + go + rows[:, None] * sgn + es[None, :] * sge,
                             mask=rmask[:, None] & emask[None, :], other=0.0).to(tl.float32)
                acc += tl.dot(st, gt, input_precision=PREC)
                if TAIL:
                    gz = tl.load(g_ptr + go + rows * sgn + E * sge, mask=_if_last(rmask, pid_e, ne), other=0.0)
                    gz = gz.to(tl.float32)
                    acc_z += tl.sum(st * gz[None, :], axis=1)
    dco = tl.load(dc_off_ptr + h)
    tl.store(dc_ptr + dco + cols[:, None] * sdn + es[None, :] * sde, acc, mask=cmask[:, None] & emask[None, :])
    if TAIL:
        tl.store(dc_ptr + dco + cols * sdn + E * sde, acc_z, mask=_if_last(cmask, pid_e, ne))


# ---------------------------------------------------------------------------------------------------------------------
# Running sums over the state slots (``causal.running_sums_``): x (H, S, X) fp32, contiguous, in place, slot t ->
# sum_{t' <= t} x_t' (DECAY: exp(L_t - L_t') x_t', L (H, S) non-increasing, so every factor is <= 1). torch.cumsum
# along dim 1 walks S slots per thread in H X threads (one 16 x 4096 slab set at n = 32k: 217 us a call on an H100,
# 1.3 of linear-elu's 5.4 ms), too few loads in flight to cover the latency of each. Here the S slots are cut into
# segments of SEG: each segment's (decayed) total first, in parallel over (X tile, segment, head); then every segment
# walks its own slots from the carry of the totals before it. 3 passes over x (read, read, write) by NSEG X / BX H
# programs of SEG sequential steps each.
# ---------------------------------------------------------------------------------------------------------------------


@triton.jit
def _segment(S, X, SEG, BX: tl.constexpr):
    """This program's segment g, head h (int64), column tile (and its mask) and slots [t0, t1)."""
    g, h = tl.program_id(1), tl.program_id(2).to(tl.int64)
    cols = tl.program_id(0) * BX + tl.arange(0, BX)
    t0 = g * SEG
    return g, h, cols, cols < X, t0, tl.minimum(t0 + SEG, S)


@triton.jit
def _segment_totals_kernel(x_ptr, logs_ptr, tot_ptr, S, X, SEG, NSEG, DECAY: tl.constexpr, BX: tl.constexpr):
    """tot[h, g] = sum over segment g's slots t of x_t (DECAY: times exp(L_end - L_t), referenced at its last slot)."""
    g, h, cols, cmask, t0, t1 = _segment(S, X, SEG, BX)
    base = x_ptr + h * S * X
    acc = tl.zeros([BX], dtype=tl.float32)
    if DECAY:
        end = tl.load(logs_ptr + h * S + t1 - 1)
    for t in range(t0, t1):
        x = tl.load(base + t * X + cols, mask=cmask, other=0.0)
        if DECAY:
            x = x * tl.exp(end - tl.load(logs_ptr + h * S + t))
        acc += x
    tl.store(tot_ptr + (h * NSEG + g) * X + cols, acc, mask=cmask)


@triton.jit
def _segment_scan_kernel(x_ptr, logs_ptr, tot_ptr, S, X, SEG, NSEG, DECAY: tl.constexpr, BX: tl.constexpr):
    """Segment g's running sums in place: the carry of segments 0..g-1 (their totals, decayed from one segment's end
    to the next), then its own slots."""
    g, h, cols, cmask, t0, t1 = _segment(S, X, SEG, BX)
    base = x_ptr + h * S * X
    acc = tl.zeros([BX], dtype=tl.float32)
    if DECAY:
        # the reference of the carry: segment 0's end while the carry is summed (its first factor multiplies 0); in
        # segment 0 its own first slot (exp(0) on an empty carry)
        prev = tl.load(logs_ptr + h * S + tl.where(g > 0, SEG - 1, t0))
    for g2 in range(0, g):
        tot = tl.load(tot_ptr + (h * NSEG + g2) * X + cols, mask=cmask, other=0.0)
        if DECAY:
            end = tl.load(logs_ptr + h * S + g2 * SEG + SEG - 1)
            acc = acc * tl.exp(end - prev)
            prev = end
        acc += tot
    for t in range(t0, t1):
        x = tl.load(base + t * X + cols, mask=cmask, other=0.0)
        if DECAY:
            lt = tl.load(logs_ptr + h * S + t)
            acc = acc * tl.exp(lt - prev)
            prev = lt
        acc += x
        tl.store(base + t * X + cols, acc, mask=cmask)
