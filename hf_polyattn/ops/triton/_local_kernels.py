"""Triton kernels for the exact diagonal blocks of ``local_exact`` and their gradients (need triton).

The sequence is cut into blocks of T rows aligned at position 0 (T = the config's block_size; the
last block may be partial). Query i of block k sees the keys j of the same block (causal: j <= i)
that the key padding mask keeps, with the weights

* softmax: exp(x_ij - m_i), x = s q_i.k_j, m_i = max(0, max over the allowed j of x_ij) (the
  stabiliser of ``LocalExactMixin.exact_weights``; m_i = 0 for a row that sees no key);
* polynomial: ((x_ij + alpha) / beta)^P, P a positive integer.

Output row i = sum_j w_ij v_j over the E = e + 1 columns of [v, 1]: the first e columns by a
matmul, the last (the normaliser column, 0 at padded keys) by a weighted row sum, so a head
dimension of 64 keeps 64-wide tiles instead of padding 65 columns to 128.

Sliding window (``WINDOW``, runtime ``W`` >= 1; the host passes T = one row tile): query i sees
the keys j with i - W < j <= i (causal) or |i - j| < W, over the whole sequence instead of one
block; the same weights, stabiliser and normaliser column (``ops/window.py``'s exact part).

Sinks (``SINKS``, window mode only): NE extra keys per (batch row, kv head), ``ops/window.py``'s ``Sinks``
(attention sinks gathered from the sequence, learned slots), each with a position: the query at row i sees the
slot when pos <= i (the caller leaves the sinks out of the window's keys by the key padding mask). They share the
row's weights, stabiliser and normaliser column with the window; the forward and the dq kernel read them in tiles
of BS slots before the window's keys. Their gradients are summed by the dq kernel's programs, each writing its row
tile's share (NT x NE x (D + E1 + 1) floats per query head, summed on the host): every query of the sequence may see
a slot, so a program per slot tile would walk all n rows alone. With ``SINK_Q`` a second query tensor (the queries
re-rotated to where they score the sinks, ``PolyAttnConfig.sink_position='window'``) scores the slots from NL on
(the first NL, learned slots, keep the real queries); the dq kernel then writes that tensor's gradient too, which the
host's autograd rotates back into q's.

Like flash attention, nothing b x b is stored: the forward keeps m (n floats per query head) for
the softmax, the backward recomputes the weights tile by tile from q and k. Three kernels, one
program per (row tile of a block, head):

* ``_local_fwd_kernel``: per (query tile, query head); online row max for the softmax (the running
  maximum starts at 0, which is the clamp), fp32 accumulators.
* ``_local_dq_kernel``: per (query tile, query head): dq = s sum_j dx_ij k_j (sinks included), and the tile's
  share of the sink slots' dk, dv.
* ``_local_dkv_kernel``: per (key tile, kv head), looping over the G query heads of the kv head
  (no atomics): dv_j = sum_i w_ij dO_i, dk_j = sum_i dx_ij (s q_i).

with dw_ij = dO_i . v_j and dx_ij = dw_ij w'(x_ij): softmax w' = w (m is a constant, detached as
in PyTorch), polynomial w' = P / beta base^(P-1).

Every dot takes fp32 operands (inputs in bf16/fp16 are converted on load) with ``PREC`` the dot
precision ("tf32x3": fp32 accuracy; "tf32": 3x cheaper, ~5e-4 relative), fp32 accumulation.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _power_minus_one(base, P: tl.constexpr):
    """base^(P-1) (P >= 1), by P-2 multiplies (P <= 8 in practice: a few multiplies per score)."""
    if P == 1:
        out = base * 0.0 + 1.0
    else:
        out = base
        for _ in tl.static_range(P - 2):
            out = out * base
    return out


@triton.jit
def _weights_and_slope(x, allowed, m, alpha, inv_beta, SOFTMAX: tl.constexpr, P: tl.constexpr):
    """(w, dw/dx) of a (rows x keys) score tile, both 0 where not ``allowed``; m: the rows' stabiliser."""
    if SOFTMAX:
        w = tl.where(allowed, tl.exp(x - m[:, None]), 0.0)
        slope = w
    else:
        base = (x + alpha) * inv_beta
        pm1 = _power_minus_one(base, P)
        w = tl.where(allowed, pm1 * base, 0.0)
        slope = tl.where(allowed, pm1 * (P * inv_beta), 0.0)
    return w, slope


@triton.jit
def _accumulate(acc, acc_n, m_i, x, allowed, vt, vn, alpha, inv_beta, SOFTMAX: tl.constexpr, P: tl.constexpr,
                PREC: tl.constexpr):
    """The forward's running sums over one tile of keys with scores x: softmax with the online row max (the running
    maximum starts at 0, which is the clamp), or the polynomial's plain sums."""
    if SOFTMAX:
        x = tl.where(allowed, x, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(x, axis=1))
        corr = tl.exp(m_i - m_new)
        w = tl.exp(x - m_new[:, None])  # exp(-inf) = 0 off the allowed keys
        acc = acc * corr[:, None] + tl.dot(w, vt, input_precision=PREC)
        acc_n = acc_n * corr + tl.sum(w * vn[None, :], axis=1)
        m_i = m_new
    else:
        w, _ = _weights_and_slope(x, allowed, m_i, alpha, inv_beta, False, P)
        acc += tl.dot(w, vt, input_precision=PREC)
        acc_n += tl.sum(w * vn[None, :], axis=1)
    return acc, acc_n, m_i


@triton.jit
def _sink_tile(sk_base, sv_base, sp_base, slots, rows, rmask, NE, ds, dmask, es, emask, E1, sskn, sskd, ssvn, ssve,
               sspn):
    """(allowed, k, v, v's normaliser column) of the sink slots ``slots`` for the query ``rows``: a slot at position
    pos is seen from row pos on (learned slots sit at -2**30, empty ones at 2**30: ops/window.py OUTSIDE)."""
    smask = slots < NE
    pos = tl.load(sp_base + slots * sspn, mask=smask, other=1073741824)
    kt = tl.load(sk_base + slots[:, None] * sskn + ds[None, :] * sskd,
                 mask=smask[:, None] & dmask[None, :], other=0.0).to(tl.float32)
    vt = tl.load(sv_base + slots[:, None] * ssvn + es[None, :] * ssve,
                 mask=smask[:, None] & emask[None, :], other=0.0).to(tl.float32)
    vn = tl.load(sv_base + slots * ssvn + E1 * ssve, mask=smask, other=0.0).to(tl.float32)
    allowed = rmask[:, None] & smask[None, :] & (pos[None, :] <= rows[:, None])
    return allowed, kt, vt, vn


@triton.jit
def _rows_tile(x_ptr, g, hh, bb, rows, rmask, ds, dmask, sxb, sxh, sxg, sxn, sxd):
    """The rows ``rows`` of head (bb, hh, g) of a (B, Hkv, G, n, d) tensor, fp32, zero beyond rmask / dmask."""
    base = x_ptr + bb.to(tl.int64) * sxb + hh.to(tl.int64) * sxh + g.to(tl.int64) * sxg
    return tl.load(base + rows[:, None] * sxn + ds[None, :] * sxd, mask=rmask[:, None] & dmask[None, :],
                   other=0.0).to(tl.float32)


@triton.jit
def _query_tile(pid_q, bhg, n, T, QPC, G, HKV, BQ: tl.constexpr):
    """(query group g, kv head hh, batch bb) of program row ``bhg``; the block start, the tile's first row,
    the block end, the tile's rows and which of them exist."""
    g = bhg % G
    bh = bhg // G
    start = (pid_q // QPC) * T
    q0 = start + (pid_q % QPC) * BQ
    c_end = tl.minimum(start + T, n)
    rows = q0 + tl.arange(0, BQ)
    return g, bh % HKV, bh // HKV, start, q0, c_end, rows, rows < c_end


@triton.jit
def _query_operands(q_ptr, k_ptr, v_ptr, g, hh, bb, rows, rmask, D, E1, scale, sqb, sqh, sqg, sqn, sqd, skb, skh,
                    svb, svh, BD: tl.constexpr, BE: tl.constexpr):
    """Column ranges and masks (head dim, value dim), this head's k and v bases, and the tile's scaled q (fp32)."""
    ds = tl.arange(0, BD)
    dmask = ds < D
    es = tl.arange(0, BE)
    emask = es < E1
    qs = _rows_tile(q_ptr, g, hh, bb, rows, rmask, ds, dmask, sqb, sqh, sqg, sqn, sqd) * scale
    k_base = k_ptr + bb.to(tl.int64) * skb + hh.to(tl.int64) * skh
    v_base = v_ptr + bb.to(tl.int64) * svb + hh.to(tl.int64) * svh
    return ds, dmask, es, emask, k_base, v_base, qs


@triton.jit
def _key_tile(k_base, v_base, mask_row, cols, k_end, ds, dmask, es, emask, E1, skn, skd, svn, sve, smn,
              HAS_MASK: tl.constexpr):
    """(kept, k, v, v's normaliser column) of the keys ``cols``: kept = below k_end and not padded; fp32 tiles."""
    cmask = cols < k_end
    if HAS_MASK:
        keep = tl.load(mask_row + cols * smn, mask=cmask, other=0)
        cmask = cmask & (keep != 0)
    kt = tl.load(k_base + cols[:, None] * skn + ds[None, :] * skd,
                 mask=cmask[:, None] & dmask[None, :], other=0.0).to(tl.float32)
    vt = tl.load(v_base + cols[:, None] * svn + es[None, :] * sve,
                 mask=cmask[:, None] & emask[None, :], other=0.0).to(tl.float32)
    vn = tl.load(v_base + cols * svn + E1 * sve, mask=cmask, other=0.0).to(tl.float32)
    return cmask, kt, vt, vn


@triton.jit
def _allowed(rows, cols, rmask, cmask, W, CAUSAL: tl.constexpr, WINDOW: tl.constexpr):
    """Which (query, key) pairs of a tile are weighted: both valid, j <= i when causal, inside the window."""
    allowed = rmask[:, None] & cmask[None, :]
    if CAUSAL:
        allowed = allowed & (cols[None, :] <= rows[:, None])
    if WINDOW:
        allowed = allowed & (cols[None, :] > rows[:, None] - W)
        if not CAUSAL:
            allowed = allowed & (cols[None, :] < rows[:, None] + W)
    return allowed


@triton.jit
def _key_range(start, q0, c_end, n, W, BQ: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr):
    """[lo, hi) of the keys a query tile [q0, q0 + BQ) may see, and the end of the valid keys."""
    if WINDOW:
        lo = tl.maximum(q0 - W + 1, 0)
        if CAUSAL:
            hi = tl.minimum(q0 + BQ, n)
        else:
            hi = tl.minimum(q0 + BQ + W - 1, n)
        k_end = n
    else:
        lo = start
        if CAUSAL:
            hi = tl.minimum(q0 + BQ, c_end)
        else:
            hi = c_end
        k_end = c_end
    return lo, hi, k_end


@triton.jit
def _local_fwd_kernel(q_ptr, k_ptr, v_ptr, mask_ptr, o_ptr, m_ptr, sk_ptr, sv_ptr, sp_ptr, qr_ptr,
                      n, T, QPC, HKV, G, D, E1, W, NE, NL, scale, alpha, inv_beta,
                      sqb, sqh, sqg, sqn, sqd, skb, skh, skn, skd, svb, svh, svn, sve,
                      smb, smn, sob, soh, sog, son, soe, smob, smoh, smog, smon,
                      sskb, sskh, sskn, sskd, ssvb, ssvh, ssvn, ssve, sspb, sspn, sqrb, sqrh, sqrg, sqrn, sqrd,
                      CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, SOFTMAX: tl.constexpr, P: tl.constexpr,
                      WINDOW: tl.constexpr, SINKS: tl.constexpr, SINK_Q: tl.constexpr, BQ: tl.constexpr,
                      BD: tl.constexpr, BE: tl.constexpr, BS: tl.constexpr, PREC: tl.constexpr):
    """out[rows] = sum over the block's (window's, sinks') allowed keys of w_ij [v_j, 1]; softmax: also m[rows]."""
    g, hh, bb, start, q0, c_end, rows, rmask = _query_tile(tl.program_id(0), tl.program_id(1), n, T, QPC, G, HKV,
                                                           BQ)
    ds, dmask, es, emask, k_base, v_base, qs = _query_operands(
        q_ptr, k_ptr, v_ptr, g, hh, bb, rows, rmask, D, E1, scale, sqb, sqh, sqg, sqn, sqd, skb, skh, svb, svh, BD, BE)
    acc = tl.zeros((BQ, BE), dtype=tl.float32)
    acc_n = tl.zeros((BQ,), dtype=tl.float32)  # the normaliser column
    m_i = tl.zeros((BQ,), dtype=tl.float32)  # running max, starting at the clamp 0
    if SINKS:
        sk_base = sk_ptr + bb.to(tl.int64) * sskb + hh.to(tl.int64) * sskh
        sv_base = sv_ptr + bb.to(tl.int64) * ssvb + hh.to(tl.int64) * ssvh
        if SINK_Q:
            qrs = _rows_tile(qr_ptr, g, hh, bb, rows, rmask, ds, dmask, sqrb, sqrh, sqrg, sqrn, sqrd) * scale
        for s0 in range(0, NE, BS):
            slots = s0 + tl.arange(0, BS)
            allowed, kt, vt, vn = _sink_tile(sk_base, sv_base, sp_ptr + bb.to(tl.int64) * sspb, slots, rows, rmask,
                                             NE, ds, dmask, es, emask, E1, sskn, sskd, ssvn, ssve, sspn)
            x = tl.dot(qs, tl.trans(kt), input_precision=PREC)
            if SINK_Q:  # the slots from NL on: scored by the re-rotated queries
                x = tl.where(slots[None, :] < NL, x, tl.dot(qrs, tl.trans(kt), input_precision=PREC))
            acc, acc_n, m_i = _accumulate(acc, acc_n, m_i, x, allowed, vt, vn, alpha, inv_beta, SOFTMAX, P, PREC)
    lo, hi, k_end = _key_range(start, q0, c_end, n, W, BQ, CAUSAL, WINDOW)
    for j0 in range(lo, hi, BQ):
        cols = j0 + tl.arange(0, BQ)
        cmask, kt, vt, vn = _key_tile(k_base, v_base, mask_ptr + bb.to(tl.int64) * smb, cols, k_end, ds, dmask, es,
                                      emask, E1, skn, skd, svn, sve, smn, HAS_MASK)
        x = tl.dot(qs, tl.trans(kt), input_precision=PREC)
        allowed = _allowed(rows, cols, rmask, cmask, W, CAUSAL, WINDOW)
        acc, acc_n, m_i = _accumulate(acc, acc_n, m_i, x, allowed, vt, vn, alpha, inv_beta, SOFTMAX, P, PREC)
    o_base = o_ptr + bb.to(tl.int64) * sob + hh.to(tl.int64) * soh + g.to(tl.int64) * sog
    tl.store(o_base + rows[:, None] * son + es[None, :] * soe, acc, mask=rmask[:, None] & emask[None, :])
    tl.store(o_base + rows * son + E1 * soe, acc_n, mask=rmask)
    if SOFTMAX:
        mo_base = m_ptr + bb.to(tl.int64) * smob + hh.to(tl.int64) * smoh + g.to(tl.int64) * smog
        tl.store(mo_base + rows * smon, m_i, mask=rmask)


@triton.jit
def _local_dq_kernel(q_ptr, k_ptr, v_ptr, mask_ptr, m_ptr, do_ptr, dq_ptr, sk_ptr, sv_ptr, sp_ptr, dsk_ptr, dsv_ptr,
                     qr_ptr, dqr_ptr,
                     n, T, QPC, HKV, G, D, E1, W, NE, NL, scale, alpha, inv_beta,
                     sqb, sqh, sqg, sqn, sqd, skb, skh, skn, skd, svb, svh, svn, sve,
                     smb, smn, smob, smoh, smog, smon, sgb, sgh, sgg, sgn, sge, sdb, sdh, sdg, sdn, sdd,
                     sskb, sskh, sskn, sskd, ssvb, ssvh, ssvn, ssve, sspb, sspn,
                     sdst, sdsb, sdsh, sdsg, sdsn, sdsd, sdvt, sdvb, sdvh, sdvg, sdvn, sdve,
                     sqrb, sqrh, sqrg, sqrn, sqrd, sdrb, sdrh, sdrg, sdrn, sdrd,
                     CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, SOFTMAX: tl.constexpr, P: tl.constexpr,
                     WINDOW: tl.constexpr, SINKS: tl.constexpr, SINK_GRADS: tl.constexpr, SINK_Q: tl.constexpr,
                     BQ: tl.constexpr, BD: tl.constexpr, BE: tl.constexpr, BS: tl.constexpr, PREC: tl.constexpr):
    """dq[rows] = s sum_j dx_ij k_j over the block's (window's, sinks') allowed keys (weights recomputed); with
    SINK_GRADS also this row tile's share of the sink slots' dk, dv (summed over the tiles and heads by the host);
    with SINK_Q the slots from NL on add to the re-rotated queries' gradient dqr instead of dq."""
    g, hh, bb, start, q0, c_end, rows, rmask = _query_tile(tl.program_id(0), tl.program_id(1), n, T, QPC, G, HKV,
                                                           BQ)
    ds, dmask, es, emask, k_base, v_base, qs = _query_operands(
        q_ptr, k_ptr, v_ptr, g, hh, bb, rows, rmask, D, E1, scale, sqb, sqh, sqg, sqn, sqd, skb, skh, svb, svh, BD, BE)
    g_base = do_ptr + bb.to(tl.int64) * sgb + hh.to(tl.int64) * sgh + g.to(tl.int64) * sgg
    go = tl.load(g_base + rows[:, None] * sgn + es[None, :] * sge,
                 mask=rmask[:, None] & emask[None, :], other=0.0).to(tl.float32)
    gn = tl.load(g_base + rows * sgn + E1 * sge, mask=rmask, other=0.0).to(tl.float32)
    if SOFTMAX:
        m_base = m_ptr + bb.to(tl.int64) * smob + hh.to(tl.int64) * smoh + g.to(tl.int64) * smog
        m_i = tl.load(m_base + rows * smon, mask=rmask, other=0.0)
    else:
        m_i = tl.zeros((BQ,), dtype=tl.float32)
    acc = tl.zeros((BQ, BD), dtype=tl.float32)
    if SINKS:
        if SINK_Q:
            qrs = _rows_tile(qr_ptr, g, hh, bb, rows, rmask, ds, dmask, sqrb, sqrh, sqrg, sqrn, sqrd) * scale
            acc_r = tl.zeros((BQ, BD), dtype=tl.float32)
        sk_base = sk_ptr + bb.to(tl.int64) * sskb + hh.to(tl.int64) * sskh
        sv_base = sv_ptr + bb.to(tl.int64) * ssvb + hh.to(tl.int64) * ssvh
        tile = tl.program_id(0).to(tl.int64)
        dsk_base = dsk_ptr + tile * sdst + bb.to(tl.int64) * sdsb + hh.to(tl.int64) * sdsh + g.to(tl.int64) * sdsg
        dsv_base = dsv_ptr + tile * sdvt + bb.to(tl.int64) * sdvb + hh.to(tl.int64) * sdvh + g.to(tl.int64) * sdvg
        for s0 in range(0, NE, BS):
            slots = s0 + tl.arange(0, BS)
            allowed, kt, vt, vn = _sink_tile(sk_base, sv_base, sp_ptr + bb.to(tl.int64) * sspb, slots, rows, rmask,
                                             NE, ds, dmask, es, emask, E1, sskn, sskd, ssvn, ssve, sspn)
            x = tl.dot(qs, tl.trans(kt), input_precision=PREC)
            if SINK_Q:
                own = slots[None, :] < NL
                x = tl.where(own, x, tl.dot(qrs, tl.trans(kt), input_precision=PREC))
            w, slope = _weights_and_slope(x, allowed, m_i, alpha, inv_beta, SOFTMAX, P)
            dx = (tl.dot(go, tl.trans(vt), input_precision=PREC) + gn[:, None] * vn[None, :]) * slope
            if SINK_Q:  # split by the queries that scored each slot
                dxr = tl.where(own, 0.0, dx)
                dx = tl.where(own, dx, 0.0)
                acc_r += tl.dot(dxr, kt, input_precision=PREC)
            acc += tl.dot(dx, kt, input_precision=PREC)
            if SINK_GRADS:
                smask = slots < NE
                dks = tl.dot(tl.trans(dx), qs, input_precision=PREC)
                if SINK_Q:
                    dks += tl.dot(tl.trans(dxr), qrs, input_precision=PREC)
                tl.store(dsk_base + slots[:, None] * sdsn + ds[None, :] * sdsd, dks,
                         mask=smask[:, None] & dmask[None, :])
                tl.store(dsv_base + slots[:, None] * sdvn + es[None, :] * sdve,
                         tl.dot(tl.trans(w), go, input_precision=PREC), mask=smask[:, None] & emask[None, :])
                tl.store(dsv_base + slots * sdvn + E1 * sdve, tl.sum(w * gn[:, None], axis=0), mask=smask)
    lo, hi, k_end = _key_range(start, q0, c_end, n, W, BQ, CAUSAL, WINDOW)
    for j0 in range(lo, hi, BQ):
        cols = j0 + tl.arange(0, BQ)
        cmask, kt, vt, vn = _key_tile(k_base, v_base, mask_ptr + bb.to(tl.int64) * smb, cols, k_end, ds, dmask, es,
                                      emask, E1, skn, skd, svn, sve, smn, HAS_MASK)
        x = tl.dot(qs, tl.trans(kt), input_precision=PREC)
        allowed = _allowed(rows, cols, rmask, cmask, W, CAUSAL, WINDOW)
        w, slope = _weights_and_slope(x, allowed, m_i, alpha, inv_beta, SOFTMAX, P)
        dw = tl.dot(go, tl.trans(vt), input_precision=PREC) + gn[:, None] * vn[None, :]
        acc += tl.dot(dw * slope, kt, input_precision=PREC)
    d_base = dq_ptr + bb.to(tl.int64) * sdb + hh.to(tl.int64) * sdh + g.to(tl.int64) * sdg
    tl.store(d_base + rows[:, None] * sdn + ds[None, :] * sdd, acc * scale, mask=rmask[:, None] & dmask[None, :])
    if SINKS:
        if SINK_Q:
            dr_base = dqr_ptr + bb.to(tl.int64) * sdrb + hh.to(tl.int64) * sdrh + g.to(tl.int64) * sdrg
            tl.store(dr_base + rows[:, None] * sdrn + ds[None, :] * sdrd, acc_r * scale,
                     mask=rmask[:, None] & dmask[None, :])


@triton.jit
def _local_dkv_kernel(q_ptr, k_ptr, v_ptr, mask_ptr, m_ptr, do_ptr, dk_ptr, dv_ptr,
                      n, T, QPC, HKV, G, D, E1, W, scale, alpha, inv_beta,
                      sqb, sqh, sqg, sqn, sqd, skb, skh, skn, skd, svb, svh, svn, sve,
                      smb, smn, smob, smoh, smog, smon, sgb, sgh, sgg, sgn, sge,
                      skbo, skho, skno, skdo, svbo, svho, svno, sveo,
                      CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, SOFTMAX: tl.constexpr, P: tl.constexpr,
                      WINDOW: tl.constexpr, BQ: tl.constexpr, BD: tl.constexpr, BE: tl.constexpr,
                      PREC: tl.constexpr):
    """dk, dv of one key tile of one kv head, summed over its G query heads (weights recomputed)."""
    # a key tile of kv head (bb, hh): the query-tile layout with one group
    _, hh, bb, start, j0, c_end, cols, _ = _query_tile(tl.program_id(0), tl.program_id(1), n, T, QPC, 1, HKV, BQ)
    ds = tl.arange(0, BD)
    dmask = ds < D
    es = tl.arange(0, BE)
    emask = es < E1
    k_base = k_ptr + bb.to(tl.int64) * skb + hh.to(tl.int64) * skh
    v_base = v_ptr + bb.to(tl.int64) * svb + hh.to(tl.int64) * svh
    cmask, kt, vt, vn = _key_tile(k_base, v_base, mask_ptr + bb.to(tl.int64) * smb, cols, c_end, ds, dmask, es,
                                  emask, E1, skn, skd, svn, sve, smn, HAS_MASK)
    dk = tl.zeros((BQ, BD), dtype=tl.float32)
    dv = tl.zeros((BQ, BE), dtype=tl.float32)
    dvn = tl.zeros((BQ,), dtype=tl.float32)
    # the queries that may see these keys: [lo, hi), valid below q_end
    if WINDOW:
        if CAUSAL:
            lo = j0
        else:
            lo = tl.maximum(j0 - W + 1, 0)
        hi = tl.minimum(j0 + BQ + W - 1, n)
        q_end = n
    else:
        if CAUSAL:
            lo = j0  # tiles are aligned at the block start: queries before j0 see none of these keys
        else:
            lo = start
        hi = c_end
        q_end = c_end
    q_bh = q_ptr + bb.to(tl.int64) * sqb + hh.to(tl.int64) * sqh
    g_bh = do_ptr + bb.to(tl.int64) * sgb + hh.to(tl.int64) * sgh
    m_bh = m_ptr + bb.to(tl.int64) * smob + hh.to(tl.int64) * smoh
    for g in range(0, G):
        q_base = q_bh + g * sqg
        g_base = g_bh + g * sgg
        m_base = m_bh + g * smog
        for i0 in range(lo, hi, BQ):
            rows = i0 + tl.arange(0, BQ)
            rmask = rows < q_end
            qs = tl.load(q_base + rows[:, None] * sqn + ds[None, :] * sqd,
                         mask=rmask[:, None] & dmask[None, :], other=0.0).to(tl.float32) * scale
            go = tl.load(g_base + rows[:, None] * sgn + es[None, :] * sge,
                         mask=rmask[:, None] & emask[None, :], other=0.0).to(tl.float32)
            gn = tl.load(g_base + rows * sgn + E1 * sge, mask=rmask, other=0.0).to(tl.float32)
            if SOFTMAX:
                m_i = tl.load(m_base + rows * smon, mask=rmask, other=0.0)
            else:
                m_i = tl.zeros((BQ,), dtype=tl.float32)
            x = tl.dot(qs, tl.trans(kt), input_precision=PREC)
            allowed = _allowed(rows, cols, rmask, cmask, W, CAUSAL, WINDOW)
            w, slope = _weights_and_slope(x, allowed, m_i, alpha, inv_beta, SOFTMAX, P)
            dv += tl.dot(tl.trans(w), go, input_precision=PREC)
            dvn += tl.sum(w * gn[:, None], axis=0)
            dw = tl.dot(go, tl.trans(vt), input_precision=PREC) + gn[:, None] * vn[None, :]
            dk += tl.dot(tl.trans(dw * slope), qs, input_precision=PREC)
    dk_base = dk_ptr + bb.to(tl.int64) * skbo + hh.to(tl.int64) * skho
    dv_base = dv_ptr + bb.to(tl.int64) * svbo + hh.to(tl.int64) * svho
    # rows of padded keys get their zeros too: every row of dk, dv is written
    wmask = cols < c_end
    tl.store(dk_base + cols[:, None] * skno + ds[None, :] * skdo, dk, mask=wmask[:, None] & dmask[None, :])
    tl.store(dv_base + cols[:, None] * svno + es[None, :] * sveo, dv, mask=wmask[:, None] & emask[None, :])
    tl.store(dv_base + cols * svno + E1 * sveo, dvn, mask=wmask)
