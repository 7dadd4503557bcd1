"""Host side of the Triton exact local part: argument checks, launches, autograd.

The Triton twin of ``LocalExactMixin._local_blocks`` (``hf_polyattn/ops/local.py``; the diagonal
blocks of ``local_exact``) and, with ``window`` > 0, of its ``_window_exact`` (the sliding window,
``ops/window.py``) for the weights
softmax (row stabiliser m >= 0) and ((s q.k + alpha) / beta)^p with an integer p >= 1; squared
coefficient polynomials (``poly_coefficients``) stay on the PyTorch path (the caller's dispatch).

Memory: the forward keeps q, k, v and, for the softmax, the row stabiliser m (one float per query
row); the backward recomputes the weights from q and k tile by tile (flash-attention style), so no
b x b block of weights or scores ever reaches HBM. In PyTorch the same part held a group of 8
(CPU) or 64 (accelerators) blocks' scores and weights in memory and rematerialised them under
torch.utils.checkpoint.

Window: each 64-row query tile (32 beyond head dim 64) reads the keys of its window only, about
(BQ + w) keys a row tile, so O(n w) work; the PyTorch window scored w-query tiles against 2w (3w)
candidate keys and kept the (n x 2w) scores and weights for backward (under checkpointing).

Sinks (window mode): ``sinks`` = (k, v, pos) of ``ops/window.py``'s ``Sinks``, NE slots per batch row and kv
head attended under the window's weights and normaliser (the forward's and dq's first key tiles); their gradients
come from the dq kernel's programs as per-row-tile shares (NT x NE x (d + e + 1) floats per query head: 1/64 of
NE q-sized tensors at 64-row tiles), summed here. ``sink_q``: a second query tensor, the queries re-rotated to where
they score the sinks (``PolyAttnConfig.sink_position='window'``, made by the caller, whose autograd rotates its
gradient back), scoring the slots from ``learned`` on; the dq kernel writes its gradient beside dq.

Launches: 1 forward, 2 backward (dq; dk and dv together), whatever n; dk and dv are summed over the
G query heads of a kv head inside the kernel (keys and values are never repeated G times).
"""

from __future__ import annotations

import torch

from . import _local_kernels as K
from .causal import _grad_buffer, _pow2, _precision

__all__ = ["MAX_HEAD_DIM", "local_blocks_triton"]

# q/k and value head dims up to 128 (tiles of 64 rows up to d = 64, 32 rows beyond): the dk/dv
# program holds k, v, dk, dv and a q, dO tile in fp32 (6 x 32 KB at d = 128, 32 rows).
MAX_HEAD_DIM = 128
_NUM_WARPS = 4
_NUM_STAGES = 2
# dk/dv: one stage. With 2 (the others' setting) the sm_90 build spilled 144-160 bytes of stack in the key loop at 4
# warps and 32-64 at 8 (255 registers: the prefetched q and dO tiles on top of k, v, dk, dv); with 1, 248 registers
# and no stack (recipes/inspect_triton_sm90.py). Untimed; recipes/profile_gpu_kernels.py times both (local rows)
DKV_STAGES = 1


def _is_interpreted() -> bool:
    return type(K._local_fwd_kernel).__name__ == "InterpretedFunction"


def _check_sinks(q, v, window, sinks, sink_q=None, learned=0) -> None:
    if sinks is None:
        if sink_q is not None:
            raise ValueError("sink_q needs sinks (it scores their slots)")
        return
    if not window:
        raise ValueError("sinks need window > 0 (they are attended beside the sliding window)")
    if not (isinstance(sinks, (tuple, list)) and len(sinks) == 3
            and all(isinstance(t, torch.Tensor) for t in sinks)):
        raise ValueError("sinks must be a tuple (k, v, pos) of tensors (ops.window.Sinks)")
    sk, sv, sp = sinks
    if sk.dim() != 5 or sv.dim() != 5 or sk.shape[2] != 1 or sv.shape[2] != 1 or sk.shape[3] != sv.shape[3]:
        raise ValueError(f"sink keys and values need shapes (B, Hkv, 1, NE, d) and (B, Hkv, 1, NE, e + 1), got "
                         f"{tuple(sk.shape)} and {tuple(sv.shape)}")
    if sk.shape[-1] != q.shape[-1] or sv.shape[-1] != v.shape[-1]:
        raise ValueError(f"sink keys / values need q's {q.shape[-1]} and v's {v.shape[-1]} columns, got "
                         f"{sk.shape[-1]} and {sv.shape[-1]}")
    if sp.dim() != 2 or sp.shape[-1] != sk.shape[3] or sp.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"sink positions need shape (B, NE) = (B, {sk.shape[3]}) and an integer dtype, got "
                         f"{tuple(sp.shape)} {sp.dtype}")
    for name, t in (("sink keys", sk), ("sink values", sv), ("sink positions", sp)):
        if t.device != q.device:
            raise ValueError(f"{name} are on {t.device} but q is on {q.device}")
    for name, t in (("sink keys", sk), ("sink values", sv)):
        if t.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"{name} must be float32, bfloat16 or float16, got {t.dtype}")
    if sink_q is None:
        return
    if not isinstance(sink_q, torch.Tensor) or sink_q.shape != q.shape:
        shape = tuple(sink_q.shape) if isinstance(sink_q, torch.Tensor) else type(sink_q).__name__
        raise ValueError(f"sink_q needs q's shape {tuple(q.shape)}, got {shape}")
    if sink_q.device != q.device or sink_q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"sink_q must be a float32, bfloat16 or float16 tensor on {q.device}, got {sink_q.dtype} on "
                         f"{sink_q.device}")
    if isinstance(learned, bool) or not isinstance(learned, int) or not 0 <= learned <= sk.shape[3]:
        raise ValueError(f"learned must be an int in [0, {sk.shape[3]}] (the slots the real q scores), got "
                         f"{learned!r}")


def _check(q, k, v, block_size, causal, scale, kernel, mask, power, beta, tf32, window=0) -> None:
    if tf32 is not None and not isinstance(tf32, bool):
        raise ValueError(f"tf32 must be None, True or False, got {tf32!r}")
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise ValueError(f"window must be an int >= 0 (0: the diagonal blocks), got {window!r}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
    if kernel not in ("softmax", "polynomial"):
        raise ValueError(f"kernel must be 'softmax' or 'polynomial', got {kernel!r}")
    if kernel == "polynomial" and (isinstance(power, bool) or not isinstance(power, int) or power < 1):
        raise ValueError(f"power must be an int >= 1, got {power!r}")
    if not float(beta) or float(beta) != float(beta):
        raise ValueError(f"beta must be a non-zero number, got {beta!r}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 5:
            raise ValueError(f"{name} needs shape (B, Hkv, G, n, features), got {tuple(x.shape)}")
        if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"{name} must be float32, bfloat16 or float16, got {x.dtype}")
        if x.device != q.device:
            raise ValueError(f"{name} is on {x.device} but q is on {q.device}")
    for name, x in (("k", k), ("v", v)):
        if x.shape[2] != 1:
            raise ValueError(f"{name} needs one group slot (B, Hkv, 1, n, features), got {tuple(x.shape)}")
    if not q.shape[3] == k.shape[3] == v.shape[3]:
        raise ValueError(f"q, k, v need the same length, got {q.shape[3]}, {k.shape[3]}, {v.shape[3]}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k need the same feature size, got {q.shape[-1]} and {k.shape[-1]}")
    if v.shape[-1] < 2:
        raise ValueError(f"v needs the values and the normaliser column [v, 1], got {v.shape[-1]} columns")
    if q.shape[-1] > MAX_HEAD_DIM or v.shape[-1] - 1 > MAX_HEAD_DIM:
        raise ValueError(f"head dims q/k {q.shape[-1]}, v {v.shape[-1] - 1}: the Triton local blocks take at "
                         f"most {MAX_HEAD_DIM}")
    try:
        torch.broadcast_shapes(q.shape[:3], k.shape[:3], v.shape[:3])
    except RuntimeError as err:
        raise ValueError(f"q, k, v leading dims do not broadcast: {tuple(q.shape[:3])}, {tuple(k.shape[:3])}, "
                         f"{tuple(v.shape[:3])}") from err
    if mask is not None:
        if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or mask.shape[1] != q.shape[3]:
            raise ValueError(f"mask needs shape (B, n) with n = {q.shape[3]}, got "
                             f"{tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__}")
        if mask.device != q.device:
            raise ValueError(f"mask is on {mask.device} but q is on {q.device}")
    if q.device.type != "cuda" and not _is_interpreted():
        raise ValueError(f"q, k, v must be CUDA tensors for the Triton kernels, got {q.device} "
                         "(set TRITON_INTERPRET=1 before importing triton to run them on CPU)")


class _Plan:
    """Shapes, tiles and broadcast views of one call."""

    def __init__(self, q, k, v, block_size, causal, scale, kernel, mask, power, alpha, beta, tf32, window=0,
                 sinks=None, sink_q=None, learned=0):
        self.B, self.HKV, self.G = torch.broadcast_shapes(q.shape[:3], k.shape[:3], v.shape[:3])
        self.n, self.D, self.E1 = q.shape[3], q.shape[4], v.shape[4] - 1
        self.W = window
        self.BD, self.BE = _pow2(self.D), _pow2(self.E1)
        rows = 64 if max(self.BD, self.BE) <= 64 else 32
        # a window has no blocks: one row tile a "block" (T = BQ), its keys found from W in the kernels
        self.T = rows if window else block_size
        self.BQ = min(rows, _pow2(self.T))
        self.QPC = -(-self.T // self.BQ)  # row tiles per block
        self.NB = -(-self.n // self.T)
        self.causal, self.softmax = bool(causal), kernel == "softmax"
        self.P = 1 if self.softmax else int(power)
        self.scale, self.alpha, self.inv_beta = float(scale), float(alpha), 1.0 / float(beta)
        self.prec = _precision(tf32, {q.dtype, k.dtype, v.dtype})
        self.device = q.device
        self.mask = None
        if mask is not None:
            m8 = mask.to(torch.int8)  # B x n bytes
            self.mask = m8.expand(self.B, self.n)
        self.sinks = None
        self.NE, self.BS = 0, 16
        self.sink_q, self.NL = sink_q, learned
        if sinks is not None:
            sk, sv, sp = sinks
            self.NE = sk.shape[3]
            # slot tiles: at least 16 wide (tl.dot), at most a row tile
            self.BS = min(self.BQ, max(16, _pow2(self.NE)))
            self.sinks = (sk.expand(self.B, self.HKV, 1, self.NE, self.D),
                          sv.expand(self.B, self.HKV, 1, self.NE, self.E1 + 1), sp.expand(self.B, self.NE))

    def views(self, q, k, v):
        B, H, G, n = self.B, self.HKV, self.G, self.n
        return q.expand(B, H, G, n, self.D), k.expand(B, H, 1, n, self.D), v.expand(B, H, 1, n, self.E1 + 1)

    def mask_args(self):
        if self.mask is None:
            return torch.zeros(1, dtype=torch.int8, device=self.device), 0, 0
        return self.mask, self.mask.stride(0), self.mask.stride(1)

    def sink_args(self):
        """The sink slots' pointers (placeholders without sinks) and strides, as the fwd and dq kernels take them."""
        if self.sinks is None:
            zero = torch.zeros(1, dtype=torch.float32, device=self.device)
            return (zero, zero, zero.long()), (0,) * 10
        sk, sv, sp = self.sinks
        ks, vs = _s5(sk), _s5(sv)
        return self.sinks, (ks[0], ks[1], ks[3], ks[4], vs[0], vs[1], vs[3], vs[4], sp.stride(0), sp.stride(1))

    def sink_q_args(self, x=None):
        """The re-rotated queries' pointer (``x``: their gradient's buffer; a placeholder without them) and its
        strides."""
        if self.sink_q is None:
            return torch.zeros(1, dtype=torch.float32, device=self.device), (0,) * 5
        x = self.sink_q.expand(self.B, self.HKV, self.G, self.n, self.D) if x is None else x
        return x, _s5(x)

    def common(self):
        return (self.n, self.T, self.QPC, self.HKV, self.G, self.D, self.E1, self.W, self.scale, self.alpha,
                self.inv_beta)

    def with_slots(self, common):
        """``common`` with the slot counts (all, learned) after the window W (the fwd and dq kernels' order)."""
        return (*common[:8], self.NE, self.NL, *common[8:])

    def consts(self):
        return dict(CAUSAL=self.causal, HAS_MASK=self.mask is not None, SOFTMAX=self.softmax, P=self.P,
                    WINDOW=self.W > 0,
                    BQ=self.BQ, BD=self.BD, BE=self.BE, PREC=self.prec, num_warps=_NUM_WARPS, num_stages=_NUM_STAGES)

    def slot_consts(self):
        return dict(self.consts(), SINKS=self.sinks is not None, SINK_Q=self.sink_q is not None, BS=self.BS)


def _s5(x):
    return tuple(x.stride())


def _qkv_strides(q, k, v):
    sq, sk, sv = _s5(q), _s5(k), _s5(v)
    return (*sq, sk[0], sk[1], sk[3], sk[4], sv[0], sv[1], sv[3], sv[4])


def _forward(p: _Plan, q, k, v):
    q, k, v = p.views(q, k, v)
    out = torch.empty(p.B, p.HKV, p.G, p.n, p.E1 + 1, dtype=torch.float32, device=p.device)
    m = torch.zeros(p.B, p.HKV, p.G, p.n, dtype=torch.float32, device=p.device) if p.softmax else \
        torch.zeros(1, 1, 1, 1, dtype=torch.float32, device=p.device)
    mask, smb, smn = p.mask_args()
    so, sm = _s5(out), tuple(m.stride())
    slots, slot_strides = p.sink_args()
    qr, qr_strides = p.sink_q_args()
    K._local_fwd_kernel[(p.NB * p.QPC, p.B * p.HKV * p.G)](
        q, k, v, mask, out, m, *slots, qr, *p.with_slots(p.common()), *_qkv_strides(q, k, v), smb, smn, *so, *sm,
        *slot_strides, *qr_strides, **p.slot_consts())
    return out, (m if p.softmax else None)


def _backward(p: _Plan, q0, k0, v0, m, grad, need_q, need_kv, need_sinks=False, sinks0=None, need_sink_q=False):
    """(dq, dk, dv, d sink keys, d sink values, d sink_q), None where not needed."""
    q, k, v = p.views(q0, k0, v0)
    mask, smb, smn = p.mask_args()
    if m is None:
        m = torch.zeros(1, 1, 1, 1, dtype=torch.float32, device=p.device)
    sm, sg = tuple(m.stride()), _s5(grad)
    dq = dk = dv = dsk = dsv = dqr = None
    if need_q or need_sinks or need_sink_q:
        buf = _grad_buffer((p.B, p.HKV, p.G, p.n, p.D), q0)
        slots, slot_strides = p.sink_args()
        tiles = p.NB * p.QPC
        # each row tile's share of the slots' gradients, summed below (placeholders without sinks)
        shares = [torch.zeros(1, dtype=torch.float32, device=p.device)] * 2
        if need_sinks:
            shares = [torch.empty(tiles, p.B, p.HKV, p.G, p.NE, cols, dtype=torch.float32, device=p.device)
                      for cols in (p.D, p.E1 + 1)]
        share_strides = [s for t in shares for s in (tuple(t.stride()) if need_sinks else (0,) * 6)]
        qr, qr_strides = p.sink_q_args()
        # the re-rotated queries' gradient (written whenever they exist: the kernel's sums are computed anyway)
        dqr_buf, dqr_strides = p.sink_q_args(None if p.sink_q is None else
                                             _grad_buffer((p.B, p.HKV, p.G, p.n, p.D), p.sink_q))
        K._local_dq_kernel[(tiles, p.B * p.HKV * p.G)](
            q, k, v, mask, m, grad, buf, *slots, *shares, qr, dqr_buf, *p.with_slots(p.common()),
            *_qkv_strides(q, k, v), smb, smn, *sm, *sg, *_s5(buf), *slot_strides, *share_strides, *qr_strides,
            *dqr_strides, **p.slot_consts(), SINK_GRADS=need_sinks)
        if need_q:
            dq = buf.sum_to_size(q0.shape).to(q0.dtype)
        if need_sink_q:
            dqr = dqr_buf.sum_to_size(p.sink_q.shape).to(p.sink_q.dtype)
        if need_sinks:  # over the row tiles and the G query heads of a kv head: (B, Hkv, 1, NE, cols)
            dsk, dsv = (t.sum(0).sum(2, keepdim=True).sum_to_size(x.shape).to(x.dtype)
                        for t, x in zip(shares, sinks0[:2]))
    if need_kv:
        dkb = _grad_buffer((p.B, p.HKV, 1, p.n, p.D), k0)
        dvb = _grad_buffer((p.B, p.HKV, 1, p.n, p.E1 + 1), v0)
        sk, sv = _s5(dkb), _s5(dvb)
        K._local_dkv_kernel[(p.NB * p.QPC, p.B * p.HKV)](
            q, k, v, mask, m, grad, dkb, dvb, *p.common(), *_qkv_strides(q, k, v), smb, smn, *sm, *sg,
            sk[0], sk[1], sk[3], sk[4], sv[0], sv[1], sv[3], sv[4], **dict(p.consts(), num_stages=DKV_STAGES))
        dk = dkb.sum_to_size(k0.shape).to(k0.dtype)
        dv = dvb.sum_to_size(v0.shape).to(v0.dtype)
    return dq, dk, dv, dsk, dsv, dqr



class _LocalBlocksTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, block_size, causal, scale, kernel, power, alpha, beta, tf32, window,  # noqa: D102
                sink_k, sink_v, sink_pos, sink_q, learned):
        sinks = None if sink_k is None else (sink_k, sink_v, sink_pos)
        p = _Plan(q, k, v, block_size, causal, scale, kernel, mask, power, alpha, beta, tf32, window, sinks, sink_q,
                  learned)
        ctx.args = (block_size, causal, scale, kernel, power, alpha, beta, tf32, window)
        ctx.learned = learned
        if p.n == 0 or p.B * p.HKV * p.G == 0:
            out = torch.zeros(p.B, p.HKV, p.G, p.n, p.E1 + 1, dtype=torch.float32, device=q.device)
            m = torch.zeros(p.B, p.HKV, p.G, p.n, dtype=torch.float32, device=q.device)
        else:
            out, m = _forward(p, q, k, v)
            if m is None:
                m = torch.zeros(1, 1, 1, 1, dtype=torch.float32, device=q.device).expand(p.B, p.HKV, p.G, p.n)
        ctx.save_for_backward(q, k, v, mask, m if p.softmax else None, sink_k, sink_v, sink_pos, sink_q)
        ctx.mark_non_differentiable(m)
        return out, m

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out, grad_m):  # noqa: D102  (m is detached, as in PyTorch: grad_m is unused)
        q, k, v, mask, m, sink_k, sink_v, sink_pos, sink_q = ctx.saved_tensors
        sinks = None if sink_k is None else (sink_k, sink_v, sink_pos)
        need = ctx.needs_input_grad
        need_q, need_kv, need_sinks = need[0], need[1] or need[2], sinks is not None and (need[13] or need[14])
        need_sink_q = sink_q is not None and need[16]
        p = _Plan(q, k, v, ctx.args[0], ctx.args[1], ctx.args[2], ctx.args[3], mask, *ctx.args[4:], sinks, sink_q,
                  ctx.learned)
        none = (None,) * 10
        if p.n == 0 or p.B * p.HKV * p.G == 0 or grad_out is None:
            zeros = [torch.zeros_like(x) if x is not None and need[i] else None
                     for i, x in ((0, q), (1, k), (2, v), (13, sink_k), (14, sink_v), (16, sink_q))]
            return (*zeros[:3], *none, *zeros[3:5], None, zeros[5], None)
        dq, dk, dv, dsk, dsv, dqr = _backward(p, q, k, v, m, grad_out.float(), need_q, need_kv, need_sinks, sinks,
                                              need_sink_q)
        return (dq if need_q else None, dk if need[1] else None, dv if need[2] else None, *none,
                dsk if need[13] else None, dsv if need[14] else None, None, dqr, None)


def local_blocks_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_size: int,
    causal: bool,
    scale: float,
    kernel: str,
    mask: torch.Tensor | None = None,
    power: int = 2,
    alpha: float = 0.0,
    beta: float = 1.0,
    tf32: bool | None = None,
    window: int = 0,
    sinks: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    sink_q: torch.Tensor | None = None,
    learned: int = 0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Exact weights on the block_size x block_size diagonal blocks (aligned at 0) times [v, 1]; with
    ``window`` > 0 on each query's sliding window instead (query i sees the keys j with
    i - window < j <= i when ``causal``, |i - j| < window otherwise; ``block_size`` unused).

    q (B, Hkv, G, n, d), k (B, Hkv, 1, n, d), v (B, Hkv, 1, n, e + 1) = [values, normaliser column]
    (leading dims of k, v may broadcast); ``mask`` (B, n) bool, False at padded keys (or None).
    Query i of a block sees the block's kept keys (``causal``: j <= i) with weights of x = scale q.k:
    'softmax' exp(x - m_i), m_i = max(0, the row's max over those keys); 'polynomial'
    ((x + alpha) / beta)^power. Returns (loc (B, Hkv, G, n, e + 1) fp32, log_far): log_far =
    -m (B, Hkv, G, n, 1) fp32 for the softmax (the factor exp(-m) that puts a kernel part on these
    weights' scale; not differentiable, as m is detached in PyTorch), None for the polynomial.
    Same meaning as ``LocalExactMixin._local_blocks`` (window: ``_window_exact``) before its
    ``far_scale``. Differentiable in q, k, v; fp32 / bf16 / fp16 inputs, fp32 accumulation; ``tf32`` as
    in ``lt_multiply_triton``.

    ``sinks`` (window only): (k (B, Hkv, 1, NE, d), v (B, Hkv, 1, NE, e + 1), pos (B, NE) int) of
    ``ops.window.Sinks`` (leading dims may broadcast): slot u joins row i's weights, stabiliser and [v, 1] sums
    when pos_u <= i (the sinks among the keys are the caller's to mask). Differentiable in its k and v too.
    ``sink_q`` (q's shape) scores the slots from ``learned`` on instead of q (``ops.window.Sinks.q``: the queries
    re-rotated to where they score the sinks); differentiable in it too.
    """
    _check(q, k, v, block_size, causal, scale, kernel, mask, power, beta, tf32, window)
    _check_sinks(q, v, window, sinks, sink_q, learned)
    sink_k, sink_v, sink_pos = (None, None, None) if sinks is None else sinks
    loc, m = _LocalBlocksTriton.apply(q, k, v, mask, block_size, bool(causal), float(scale), kernel, int(power),
                                      float(alpha), float(beta), tf32, window, sink_k, sink_v, sink_pos, sink_q,
                                      learned)
    return loc, (-m.unsqueeze(-1) if kernel == "softmax" else None)
