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

    def __init__(self, q, k, v, block_size, causal, scale, kernel, mask, power, alpha, beta, tf32, window=0):
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

    def views(self, q, k, v):
        B, H, G, n = self.B, self.HKV, self.G, self.n
        return q.expand(B, H, G, n, self.D), k.expand(B, H, 1, n, self.D), v.expand(B, H, 1, n, self.E1 + 1)

    def mask_args(self):
        if self.mask is None:
            return torch.zeros(1, dtype=torch.int8, device=self.device), 0, 0
        return self.mask, self.mask.stride(0), self.mask.stride(1)

    def common(self):
        return (self.n, self.T, self.QPC, self.HKV, self.G, self.D, self.E1, self.W, self.scale, self.alpha,
                self.inv_beta)

    def consts(self):
        return dict(CAUSAL=self.causal, HAS_MASK=self.mask is not None, SOFTMAX=self.softmax, P=self.P,
                    WINDOW=self.W > 0,
                    BQ=self.BQ, BD=self.BD, BE=self.BE, PREC=self.prec, num_warps=_NUM_WARPS, num_stages=_NUM_STAGES)


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
    K._local_fwd_kernel[(p.NB * p.QPC, p.B * p.HKV * p.G)](
        q, k, v, mask, out, m, *p.common(), *_qkv_strides(q, k, v), smb, smn, *so, *sm, **p.consts())
    return out, (m if p.softmax else None)


def _backward(p: _Plan, q0, k0, v0, m, grad, need_q, need_kv):
    q, k, v = p.views(q0, k0, v0)
    mask, smb, smn = p.mask_args()
    if m is None:
        m = torch.zeros(1, 1, 1, 1, dtype=torch.float32, device=p.device)
    sm, sg = tuple(m.stride()), _s5(grad)
    dq = dk = dv = None
    if need_q:
        buf = _grad_buffer((p.B, p.HKV, p.G, p.n, p.D), q0)
        K._local_dq_kernel[(p.NB * p.QPC, p.B * p.HKV * p.G)](
            q, k, v, mask, m, grad, buf, *p.common(), *_qkv_strides(q, k, v), smb, smn, *sm, *sg, *_s5(buf),
            **p.consts())
        dq = buf.sum_to_size(q0.shape).to(q0.dtype)
    if need_kv:
        dkb = _grad_buffer((p.B, p.HKV, 1, p.n, p.D), k0)
        dvb = _grad_buffer((p.B, p.HKV, 1, p.n, p.E1 + 1), v0)
        sk, sv = _s5(dkb), _s5(dvb)
        K._local_dkv_kernel[(p.NB * p.QPC, p.B * p.HKV)](
            q, k, v, mask, m, grad, dkb, dvb, *p.common(), *_qkv_strides(q, k, v), smb, smn, *sm, *sg,
            sk[0], sk[1], sk[3], sk[4], sv[0], sv[1], sv[3], sv[4], **dict(p.consts(), num_stages=DKV_STAGES))
        dk = dkb.sum_to_size(k0.shape).to(k0.dtype)
        dv = dvb.sum_to_size(v0.shape).to(v0.dtype)
    return dq, dk, dv



class _LocalBlocksTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, block_size, causal, scale, kernel, power, alpha, beta, tf32, window):  # noqa: D102
        p = _Plan(q, k, v, block_size, causal, scale, kernel, mask, power, alpha, beta, tf32, window)
        ctx.args = (block_size, causal, scale, kernel, power, alpha, beta, tf32, window)
        if p.n == 0 or p.B * p.HKV * p.G == 0:
            out = torch.zeros(p.B, p.HKV, p.G, p.n, p.E1 + 1, dtype=torch.float32, device=q.device)
            m = torch.zeros(p.B, p.HKV, p.G, p.n, dtype=torch.float32, device=q.device)
        else:
            out, m = _forward(p, q, k, v)
            if m is None:
                m = torch.zeros(1, 1, 1, 1, dtype=torch.float32, device=q.device).expand(p.B, p.HKV, p.G, p.n)
        ctx.save_for_backward(q, k, v, mask, m if p.softmax else None)
        ctx.mark_non_differentiable(m)
        return out, m

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out, grad_m):  # noqa: D102  (m is detached, as in PyTorch: grad_m is unused)
        q, k, v, mask, m = ctx.saved_tensors
        need_q = ctx.needs_input_grad[0]
        need_kv = ctx.needs_input_grad[1] or ctx.needs_input_grad[2]
        p = _Plan(q, k, v, ctx.args[0], ctx.args[1], ctx.args[2], ctx.args[3], mask, *ctx.args[4:])
        none = (None,) * 10
        if p.n == 0 or p.B * p.HKV * p.G == 0 or grad_out is None:
            return (torch.zeros_like(q) if need_q else None, torch.zeros_like(k) if ctx.needs_input_grad[1] else None,
                    torch.zeros_like(v) if ctx.needs_input_grad[2] else None, *none)
        dq, dk, dv = _backward(p, q, k, v, m, grad_out.float(), need_q, need_kv)
        return (dq, dk if ctx.needs_input_grad[1] else None, dv if ctx.needs_input_grad[2] else None, *none)


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
    """
    _check(q, k, v, block_size, causal, scale, kernel, mask, power, beta, tf32, window)
    loc, m = _LocalBlocksTriton.apply(q, k, v, mask, block_size, bool(causal), float(scale), kernel, int(power),
                                      float(alpha), float(beta), tf32, window)
    return loc, (-m.unsqueeze(-1) if kernel == "softmax" else None)
