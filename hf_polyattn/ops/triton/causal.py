"""Host side of the Triton lt(phi(A) phi(B)^T) C: argument checks, head tables, launches, autograd.

Memory and launches (the design constraints of this module):

* Nothing of size n x F is ever stored: features are formed tile by tile in registers from the
  r-dim inputs. At n = 32k, r = 32 (F = 528) an fp32 feature tensor would be 69 MB per head.
* Per-chunk states, fp32 (n / T) x F x SE per kv head (SE = e rounded up to 8, e = 65 stored as
  64 columns + an F-vector, see "Tail"): 128 x 528 x 65 x 4 B = 17.6 MB at n = 32k, r = 32, e = 65,
  T = 256 (the inputs are n (r + e) = 3.2 M values, 6.4 MB in
  bf16). They are kept because they let every output tile run in parallel (n / 64 x heads
  programs); one running (528 x 65) fp32 state is 137 KB, more than a program can hold on chip.
  Every chunk's own state is computed in parallel and one scan over chunks makes them running
  sums (a sequential walk over chunks in 144 programs was latency-bound: 5.2 ms of a 30 ms
  forward+backward at n = 32k, H = 16 on an H100). Backward recomputes them (prefix states P and
  suffix states U, the same kernel): only a, b, c are saved, so nothing F-sized lives between
  forward and backward (17.6 MB x heads x layers otherwise).
* Tail: C with e = 2^m + 1 columns (head_dim values + the normaliser, e = 65 at d = 64) runs its
  first 2^m columns through the e tiles and the last as row sums on the side (``TAIL`` in
  ``_kernels``). Padding 65 columns to one 128-wide tile made half of every state and output dot
  multiply zeros.
* Forward: 2 launches + 1 running sum (``running_sums_``: 2 launches). Backward: up to 5 launches (P, U, dA, dB,
  dC) + 2 running sums, plus a
  sum over broadcast dims when an input was broadcast (dB, dC are already reduced over query groups
  inside the kernels: B and C are never copied G times). Head offset tables are cached per layout,
  so a call makes no host-to-device copy (each one synchronised the stream: 11 per call before).
* Chunk T. The states are (n / T) F x SE fp32 a kv head; the chunk's own pairs are computed exactly
  from r-dim dot products, (a_i.b_j)^p, about T/2 (r + e) multiply-adds a row, against F e for the
  state read. With ``include_diag=True`` the result does not depend on T, so T is chosen for speed:
  min(block_size, max(MIN_DIAG_CHUNK = 64, F rounded up to a power of two)), at least 16 (the smallest matmul tile):
  identity features (F = r = 64, e = 65) at T = 256 spent 4x more on the diagonal (128 x 129) than
  on the state (64 x 65); at T = 64 the two are even, for 4x the state slabs (8.4 MB a head at
  n = 32k instead of 2.1); on an H100 T = 128 measured 7% faster than 64 (``MIN_DIAG_CHUNK``).
  ``include_diag=False`` drops the block_size x block_size diagonal blocks aligned at 0; a chunk is then a
  whole number of blocks and its exact part the pairs of different blocks (``_kernels._exact_pair``). Either
  way T is raised until T >= F (``STATE_CHUNK_RULE``: block_size times a power of two without the diagonal, F
  rounded up to a power of two with it), so
  the states are at most the size of c in fp32: polysketch's F = 528 (r = 32) at T = 256 held
  (n / 256) 528 x 64 fp32 = 2.06 n d bytes, 4.1 bf16 query-sized tensors a head, more than any
  other tensor of a layer's backward; at T = 1024, 1.0. The price is the exact part of the chunk:
  at b = 256, T = 1024 a query row reads on average 384 more keys exactly, (r + e) = 97
  multiply-adds each, about what its state read costs.
* Decay (``decay=(qlog, klog)``, ``ops.causal``'s module doc): the log-decays go to the kernels as fp32 tables in
  head order, (H, G, n) for qlog and (H, n) for klog (n floats a head: a column of q). Each chunk's slab is
  referenced at one key and scaled to it in the state kernel; the running sums over chunks are then decayed sums,
  slot t = sum_{t' <= t} exp(-|ref_t - ref_t'|) slab_t', by the same segmented scan as the undecayed sums, each
  step decaying what it carries by exp(ref_t - ref_{t-1}) <= 1 (``running_sums_``; before it, (64 x 64) matrices of
  decays over groups of slots, ``ops.causal.decayed_running_sums``, which stays its reference).
  The gradient of qlog is one more per-row sum in the dA kernel, that of klog a row sum of c dC on the host (dC
  then kept in fp32 until it is formed). Not tuned on a GPU yet: correctness and the structure the GPU path needs.
"""

from __future__ import annotations

import math

import torch

from ..causal import check_decay, decayed_running_sums
from ..sketches import symmetric_power_indices
from . import _kernels as K

__all__ = ["lt_multiply_triton", "running_sums_"]

# 64-row tiles, 64 features per tile (a 64 x 64 fp32 phi tile is 32 registers a thread at 4 warps; square
# features: one tile per input column, R wide), e padded to one tile up to 128. Rows per tile shrink as r
# grows: the diagonal part holds (rows x R) fp32 tiles of a and b, and at R = 256 with 64 rows they needed
# 352 KB of shared memory (H100: 227 KB).
_MAX_TILE_ROWS = 64
_MAX_TILE_FEATURES = 64
_MAX_TILE_E = 128
_MAX_R = 256
_NUM_WARPS = 4
# dA / dB of squared features with an exact part in the chunk: at 4 warps the sm_90 build spilled (column tiles:
# 255 registers, 112 and 192 bytes of stack; gathered: 8 bytes); at 8 none (recipes/inspect_triton_sm90.py)
_NUM_WARPS_GRAD_DIAG = 8
# 2, not triton's default 3: the backward kernels stream a (64 x 128) dO tile and a (128 x 64) state
# tile in fp32 per step, 64 KB a stage; three stages plus layout scratch near H100's 228 KB of smem
_NUM_STAGES = 2
# the tail column (module doc); False times the padded layout it replaced (recipes/profile_gpu_kernels.py lt_rows)
TAIL_COLUMN = True
# the include_diag chunk rule (module doc); False runs T = block_size, the rule it replaced (same script)
DIAG_CHUNK_RULE = True
# the rule's smallest chunk: fewer, larger chunks trade the states' cumsum over chunks (a scan along an outer dim:
# 1.3 of linear-elu's 5.4 ms of GPU time at n = 32k, H = 16 on an H100, gpu_h100_auto/run2/profile_kinds.txt) for
# exact diagonal work. On an H100 linear-elu (bf16, n = 32k, H = 16, forward + backward) took 5.44-5.50 ms at 64 and
# 5.07-5.13 ms at 128, alternated three times in one process, 5.49 ms at 256 (recipes/profile_gpu_kernels.py
# chunk_rows, switch_rows; results/gpu_h100_compiled/). 128 stays off: its dB kernel for identity features keeps 16
# bytes in local memory in the sm_90 build (3 loads, 2 stores; tests/ops/test_triton_sm90.py), a variant without
# spills (8 warps) not yet timed. Since the running sums run as a Triton scan (``SCAN_KERNEL``) 128 is slower: 6.56 ms
# against 4.68-4.69 at 64 in one process (results/gpu_h100_scan/run1)
MIN_DIAG_CHUNK = 64
# chunks of at least F rows (module doc); False keeps the chunk at block_size or below, as before (same script:
# ``block_states_*`` rows)
STATE_CHUNK_RULE = True
# the running sums of the state slots: the segmented Triton scan (``running_sums_``); False runs torch's cumsum over
# the slot dim (1.3 of linear-elu's 5.4 ms of GPU time at n = 32k, H = 16 on an H100, six calls,
# gpu_h100_auto/run2/profile_kinds.txt) and, decayed, ``causal.decayed_running_sums`` (matmuls by 64 x 64 decay
# matrices: 1.46 of the long-context default's 11.7 ms, gpu_h100_compiled/run2/followup.txt), as before. On an H100
# (n = 32k, H = 16, bf16, forward + backward, one process, alternated twice) linear-elu took 4.66-4.70 ms with the
# scan against 5.46-5.47 without, the default 10.4-11.2 against 12.3-17.5 (results/gpu_h100_scan/)
SCAN_KERNEL = True
# slots per segment (a program's sequential steps) and columns per program: at n = 32k, T = 64, H = 16 the slabs are
# (16, 511, 64 x 64): 16 segments x 16 column tiles x 16 heads = 4,096 programs of at most 32 steps
SCAN_SEGMENT = 32
_SCAN_COLUMNS = 256
# square feature tiles formed by column scaling (``_kernels`` module doc); False runs the gathered symmetric
# tiles they replaced (same script: ``gathered_*`` rows)
SQUARE_TILES = True


def _pow2(x: int, lo: int = 16) -> int:
    """Smallest power of two >= x and >= lo (tl.dot needs every tile dimension >= 16)."""
    return max(lo, 1 << max(0, x - 1).bit_length())


def _tile_rows(R: int) -> int:
    return _MAX_TILE_ROWS if R <= 64 else max(16, _MAX_TILE_ROWS * 64 // R)


def _is_interpreted() -> bool:
    return type(K._out_kernel).__name__ == "InterpretedFunction"


# activation name -> the kernels' ACT code (``_kernels._act``); names are the feature maps' (ops/feature_maps.py)
ACT_CODES = {None: 0, "elu": 1, "relu": 2}


def _check(a, b, c, block_size, include_diag, square, tf32, activation=None) -> None:
    if tf32 is not None and not isinstance(tf32, bool):
        raise ValueError(f"tf32 must be None, True or False, got {tf32!r}")
    if not isinstance(activation, (str, type(None))) or activation not in ACT_CODES:
        raise ValueError(f"activation must be one of {list(ACT_CODES)}, got {activation!r}")
    if activation is not None and square:
        raise ValueError(f"activation={activation!r} is for identity features: square must be False")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
    for name, x in (("a", a), ("b", b), ("c", c)):
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() < 2:
            raise ValueError(f"{name} needs shape (..., n, features), got {tuple(x.shape)}")
        if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"{name} must be float32, bfloat16 or float16, got {x.dtype}")
        if x.device != a.device:
            raise ValueError(f"{name} is on {x.device} but a is on {a.device}")
    if a.shape[-2] != b.shape[-2] or b.shape[-2] != c.shape[-2]:
        raise ValueError(f"a, b, c need the same length, got {a.shape[-2]}, {b.shape[-2]}, {c.shape[-2]}")
    if a.shape[-1] != b.shape[-1]:
        raise ValueError(f"a and b need the same feature size, got {a.shape[-1]} and {b.shape[-1]}")
    if a.shape[-1] > _MAX_R:
        raise ValueError(f"a and b: feature size r = {a.shape[-1]} > {_MAX_R} is not supported by the Triton kernels")
    try:
        torch.broadcast_shapes(a.shape[:-2], b.shape[:-2], c.shape[:-2])
    except RuntimeError as err:
        raise ValueError(f"a, b, c leading dims do not broadcast: {tuple(a.shape[:-2])}, "
                         f"{tuple(b.shape[:-2])}, {tuple(c.shape[:-2])}") from err
    if a.device.type != "cuda" and not _is_interpreted():
        raise ValueError(f"a, b, c must be CUDA tensors for the Triton kernels, got {a.device} "
                         "(set TRITON_INTERPRET=1 before importing triton to run them on CPU)")


_TABLES: dict = {}
_OFFSETS: dict = {}
_OFFSETS_MAX = 256  # distinct layouts kept (a model has a handful: one per shape of q, k, v, grad)


def _no_table(device) -> torch.Tensor:
    """A 1-element fp32 stand-in for the decay tables of an undecayed call (never read: DECAY is False)."""
    key = ("none", str(device))
    if key not in _TABLES:
        _TABLES[key] = torch.zeros(1, dtype=torch.float32, device=device)
    return _TABLES[key]


def _feature_tables(r: int, square: bool, device):
    """(i0, i1, w) of the symmetric square on ``device`` (dummies for the identity), cached."""
    key = (r, square, str(device))
    if key not in _TABLES:
        if square:
            idx, w = symmetric_power_indices(r, 2)
            t = (idx[:, 0].to(torch.int32), idx[:, 1].to(torch.int32), w.to(torch.float32))
        else:
            t = (torch.zeros(1, dtype=torch.int32),) * 2 + (torch.ones(1),)
        _TABLES[key] = tuple(x.to(device) for x in t)
    return _TABLES[key]


class _Plan:
    """Shapes, tile sizes and per-head offset tables of one call.

    Leading dims: ``lead`` = broadcast of all three; kv ("state") dims are those where b or c has
    size > 1, the others are query-group dims. Head h (0..H-1) runs over the kv dims, group g
    (0..G-1) over the rest; ``offsets(x)`` gives the element offset of x's (h, g) matrix, read
    through x's own strides (stride 0 where x is broadcast: no copies).
    """

    def __init__(self, a, b, c, block_size, include_diag, square, tf32=None, activation=None):
        self.n, self.r, self.e = a.shape[-2], a.shape[-1], c.shape[-1]
        self.act = ACT_CODES[activation]
        self.square, self.include_diag = square, include_diag
        self.lead = tuple(torch.broadcast_shapes(a.shape[:-2], b.shape[:-2], c.shape[:-2]))
        nd = len(self.lead)
        kv = tuple(torch.broadcast_shapes(b.shape[:-2], c.shape[:-2]))
        self.kv_lead = (1,) * (nd - len(kv)) + kv
        kv_dims = [d for d in range(nd) if self.kv_lead[d] != 1]
        group_dims = [d for d in range(nd) if self.kv_lead[d] == 1]
        self.perm = kv_dims + group_dims
        self.H = math.prod(self.lead[d] for d in kv_dims)
        self.G = math.prod(self.lead[d] for d in group_dims)
        self.F = self.r * (self.r + 1) // 2 if square else self.r
        if not include_diag:
            self.T = block_size
            if STATE_CHUNK_RULE and self.F > block_size:
                self.T = block_size * _pow2(-(-self.F // block_size), lo=1)
        else:
            if DIAG_CHUNK_RULE:
                self.T = max(16, min(block_size, max(MIN_DIAG_CHUNK, _pow2(self.F))))
            else:
                self.T = max(16, block_size)
            if STATE_CHUNK_RULE and self.T < self.F:
                self.T = _pow2(self.F)
        self.BLK = block_size  # the dropped diagonal blocks (include_diag=False)
        # the chunk's exact part: the diagonal, or the pairs of different blocks when a chunk holds several
        self.quad = include_diag or self.T > block_size
        self.NC = -(-self.n // self.T)
        self.R = _pow2(self.r)
        self.BQ = min(_tile_rows(self.R), _pow2(self.T))
        self.QPC = -(-self.T // self.BQ)  # row tiles per chunk
        # row tiles that hold rows: a last chunk shorter than T (n < T included) launches only its own tiles
        self.tiles = (self.NC - 1) * self.QPC + _cdiv(self.n - (self.NC - 1) * self.T, self.BQ) if self.n else 0
        # square tiles: one per input column, all R columns wide; else BF-feature tiles
        self.cols = SQUARE_TILES and square
        if self.cols:
            self.BF, self.NT = self.R, self.r
        else:
            self.BF = min(_MAX_TILE_FEATURES, _pow2(self.F)) if square else min(self.R, _MAX_TILE_FEATURES)
            self.NT = _cdiv(self.F, self.BF)
        # tail: e = 2^m + 1 (>= 17) runs as 2^m tiled columns + one side column (see the module doc)
        self.tail = TAIL_COLUMN and self.e >= 17 and ((self.e - 1) & (self.e - 2)) == 0
        self.em = self.e - 1 if self.tail else self.e  # the columns the e tiles cover
        self.BE = min(_MAX_TILE_E, _pow2(self.em))
        if self.cols:  # an (R x BE) fp32 state tile per step: at most 32 KB (R = 256: 32 columns)
            self.BE = max(16, min(self.BE, 8192 // self.R))
        self.SE = -(-self.em // 8) * 8  # state row stride: 32-byte aligned rows
        self.device = a.device
        self.i0, self.i1, self.w = _feature_tables(self.r, square, a.device)
        self.prec = _precision(tf32, {a.dtype, b.dtype, c.dtype})

    def offsets(self, x: torch.Tensor, kv: bool = False) -> torch.Tensor:
        """(H, G) int64 offsets of x's matrices (``kv``: the (H,) column of group 0), cached per layout."""
        key = (kv, self.lead, tuple(self.perm), tuple(x.shape[:-2]), tuple(x.stride()[:-2]), str(self.device))
        table = _OFFSETS.get(key)
        if table is None:
            if len(_OFFSETS) >= _OFFSETS_MAX:
                _OFFSETS.clear()
            table = self._offsets(x)
            table = _OFFSETS[key] = table[:, 0].contiguous() if kv else table
        return table

    def _offsets(self, x: torch.Tensor) -> torch.Tensor:
        nd = len(self.lead)
        xe = x.expand(*self.lead, *x.shape[-2:])
        off = torch.zeros((1,) * nd, dtype=torch.int64)
        for d in range(nd):
            shape = [1] * nd
            shape[d] = self.lead[d]
            off = off + (torch.arange(self.lead[d], dtype=torch.int64) * xe.stride(d)).view(shape)
        off = off.expand(self.lead).permute(self.perm).reshape(self.H, self.G)
        return off.contiguous().to(self.device)

    def kv_offsets(self, x: torch.Tensor) -> torch.Tensor:
        return self.offsets(x, kv=True)

    def log_tables(self, qlog: torch.Tensor, klog: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """qlog as an (H, G, n) and klog as an (H, n) fp32 contiguous table in the plan's head order."""
        order = (*self.perm, len(self.lead))
        q = qlog.float().expand(*self.lead, self.n).permute(order).reshape(self.H, self.G, self.n)
        k = klog.float().expand(*self.kv_lead, self.n).permute(order).reshape(self.H, self.n)
        return q.contiguous(), k.contiguous()

    def from_table(self, x: torch.Tensor, shape) -> torch.Tensor:
        """An (H, G, n) table in the leading dims' own order, summed to ``shape`` (``log_tables`` undone)."""
        nd = len(self.lead)
        inverse = sorted(range(nd), key=self.perm.__getitem__)
        x = x.reshape(*(self.lead[d] for d in self.perm), self.n).permute(*inverse, nd)
        return x.sum_to_size(shape)

    def states(self, x, y, x_off, y_off, groups: int, reverse: bool, logs=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(H, NC-1, F, SE) fp32 running sums of phi(X_m)^T Y_m over chunks: slot k holds chunks 0..k
        (reverse: slot k holds chunks NC-1-k..NC-1), summed over ``groups`` query groups; and the
        (H, NC-1, F) sums for Y's tail column (a 1-element dummy without a tail). ``logs``: (X's row log-decays
        as an (H, groups, n) table, the klog table) of a decayed product: slot k is referenced at the last key of
        chunk k (reverse: the key before chunk NC-1-k), its running sum decayed to it (``running_sums_``)."""
        s = torch.empty(self.H, self.NC - 1, self.F, self.SE, dtype=torch.float32, device=self.device)
        z = torch.empty((self.H, self.NC - 1, self.F) if self.tail else (1,), dtype=torch.float32,
                        device=self.device)
        if self.NC == 1:
            return s, z  # one chunk: everything is diagonal, no state is read
        xlog, klog = (_no_table(self.device),) * 2 if logs is None else logs
        grid = (self.NC - 1, self.NT, self.H * _cdiv(self.em, self.BE))
        K._state_kernel[grid](
            x, y, s, z, x_off, y_off, self.i0, self.i1, self.w, xlog, klog,
            self.n, self.r, self.F, self.em, self.SE, groups, self.T, self.NC,
            x.stride(-2), x.stride(-1), y.stride(-2), y.stride(-1),
            REVERSE=reverse, SQUARE=self.square, COLS=self.cols, TAIL=self.tail, BT=self.BQ, BF=self.BF, BE=self.BE,
            R=self.R, PREC=self.prec, ACT=self.act, DECAY=logs is not None, num_warps=_NUM_WARPS,
            num_stages=_NUM_STAGES,
        )
        ref = None
        if logs is not None:
            ref = klog[:, self.T - 1 :: self.T][:, : self.NC - 1]  # the last keys of chunks 0..NC-2
            # slot t gets sum_{t' <= t} exp(ref_t - ref_t') s_t' (reverse: exp(ref_t' - ref_t)), the sign that
            # keeps every exponent <= 0 (prefix references move forward, where klog falls; suffix ones backward)
            ref = (-ref.flip(-1) if reverse else ref).contiguous()
        return running_sums_(s, ref), (running_sums_(z, ref) if self.tail else z)


def running_sums_(s: torch.Tensor, logs: torch.Tensor | None = None) -> torch.Tensor:
    """s (H, S, ...) fp32 contiguous, in place: slot t <- sum_{t' <= t} s_t', or with ``logs`` (H, S) fp32,
    non-increasing along S, sum_{t' <= t} exp(logs_t - logs_t') s_t'. ``SCAN_KERNEL``: the segmented Triton scan
    (``_kernels``' "Running sums"); else the PyTorch reference it replaced (``cumsum_``, ``decayed_running_sums``)."""
    if not SCAN_KERNEL:
        if logs is None:
            return s.cumsum_(1)
        return s.copy_(decayed_running_sums(s.flatten(2), logs).view_as(s))
    H, S = s.shape[0], s.shape[1]
    X = s[0, 0].numel() if H and S else 0
    if H * S * X == 0 or S == 1:
        return s
    nseg = _cdiv(S, SCAN_SEGMENT)
    bx = min(_SCAN_COLUMNS, _pow2(X))
    tot = torch.empty(H, nseg, X, dtype=torch.float32, device=s.device)
    table = _no_table(s.device) if logs is None else logs
    grid = (_cdiv(X, bx), nseg, H)
    args = (s, table, tot, S, X, SCAN_SEGMENT, nseg)
    if nseg > 1:
        K._segment_totals_kernel[grid](*args, DECAY=logs is not None, BX=bx, num_warps=_NUM_WARPS)
    K._segment_scan_kernel[grid](*args, DECAY=logs is not None, BX=bx, num_warps=_NUM_WARPS)
    return s


def _precision(tf32, dtypes) -> str:
    """Triton's dot precision: "tf32" (operands rounded to 10 mantissa bits, fp32 accumulation) or
    "tf32x3" (three tf32 products: fp32 accuracy, ~1e-6 relative, 3x the tensor-core work).

    ``tf32=None`` follows the inputs: fp32 inputs get fp32-accurate dots unless the user allowed
    tf32 for fp32 matmuls (``torch.set_float32_matmul_precision``, as torch itself does); half
    inputs get tf32, whose operand rounding (2^-11) is below their own (bf16 2^-8, fp16 2^-11).
    """
    if tf32 is None:
        tf32 = dtypes != {torch.float32} or torch.get_float32_matmul_precision() != "highest"
    return "tf32" if tf32 else "tf32x3"


def _grad_buffer(shape: tuple, x: torch.Tensor, fp32: bool = False) -> torch.Tensor:
    """Where a kernel writes the gradient of input ``x``: a tensor of x's own dtype when it has x's shape (the
    kernel rounds its fp32 sums once on the store, as ``.to`` would), else fp32 to be summed to x's shape first.
    A bf16 input's fp32 buffer and its bf16 copy were 3 bf16 x-sized tensors for one. ``fp32``: fp32 in any case
    (dC read again by the klog gradient)."""
    direct = tuple(x.shape) == tuple(shape) and not fp32
    return torch.empty(shape, dtype=x.dtype if direct else torch.float32, device=x.device)


def _cdiv(x: int, y: int) -> int:
    return -(-x // y)


def _forward(p: _Plan, a, b, c, logs=None) -> torch.Tensor:
    """The product; ``logs``: the (qlog, klog) tables of a decayed one (``_Plan.log_tables``)."""
    out = torch.empty(*p.lead, p.n, p.e, dtype=torch.float32, device=p.device)
    b_off, c_off = p.kv_offsets(b), p.kv_offsets(c)
    qt, kt = (_no_table(p.device),) * 2 if logs is None else logs
    s, z = p.states(b, c, b_off, c_off, 1, reverse=False, logs=None if logs is None else (kt, kt))
    grid = (p.tiles, p.H * p.G, _cdiv(p.em, p.BE))
    K._out_kernel[grid](
        a, b, c, s, z, out, p.offsets(a), b_off, c_off, p.offsets(out), p.i0, p.i1, p.w, qt, kt,
        p.n, p.r, p.F, p.em, p.SE, p.G, p.T, p.NC, p.QPC, p.BLK,
        a.stride(-2), a.stride(-1), b.stride(-2), b.stride(-1), c.stride(-2), c.stride(-1),
        out.stride(-2), out.stride(-1),
        INCLUDE_DIAG=p.include_diag, QUAD=p.quad, SQUARE=p.square, COLS=p.cols, TAIL=p.tail, BQ=p.BQ, BF=p.BF,
        BE=p.BE, R=p.R, PREC=p.prec, ACT=p.act, DECAY=logs is not None, num_warps=_NUM_WARPS,
        num_stages=_NUM_STAGES,
    )
    return out


def _backward(p: _Plan, a, b, c, g, need_a: bool, need_b: bool, need_c: bool, logs=None, need_q: bool = False,
              need_k: bool = False, log_shapes=None):
    """(dA, dB, dC, d qlog, d klog), None where not needed; ``logs``: the (qlog, klog) tables of a decayed product,
    ``log_shapes``: qlog's and klog's own shapes."""
    a_off, g_off = p.offsets(a), p.offsets(g)
    b_off, c_off = p.kv_offsets(b), p.kv_offsets(c)
    strides = (a.stride(-2), a.stride(-1), b.stride(-2), b.stride(-1))
    decay = logs is not None
    qt, kt = (_no_table(p.device),) * 2 if logs is None else logs
    consts = dict(INCLUDE_DIAG=p.include_diag, QUAD=p.quad, SQUARE=p.square, COLS=p.cols, TAIL=p.tail, BQ=p.BQ,
                  BF=p.BF, BE=p.BE, R=p.R, PREC=p.prec, ACT=p.act, DECAY=decay, num_warps=_NUM_WARPS,
                  num_stages=_NUM_STAGES)
    grad_consts = dict(consts, num_warps=_NUM_WARPS_GRAD_DIAG) if p.square and p.quad else consts
    da = db = dc = dq = dk = None
    if need_a or need_q:
        s, z = p.states(b, c, b_off, c_off, 1, reverse=False, logs=(kt, kt) if decay else None)
        buf = _grad_buffer((*p.lead, p.n, p.r), a)
        dq_buf = torch.empty(p.H, p.G, p.n, dtype=torch.float32, device=p.device) if decay else qt
        K._da_kernel[(p.tiles, p.H * p.G)](
            a, b, c, g, s, z, buf, a_off, b_off, c_off, g_off, p.offsets(buf), p.i0, p.i1, p.w, qt, kt, dq_buf,
            p.n, p.r, p.F, p.em, p.SE, p.G, p.T, p.NC, p.QPC, p.BLK, *strides, c.stride(-2), c.stride(-1),
            g.stride(-2), g.stride(-1), buf.stride(-2), buf.stride(-1), **grad_consts,
        )
        del s, z
        da = buf.sum_to_size(a.shape).to(a.dtype) if need_a else None
        dq = p.from_table(dq_buf, log_shapes[0]) if need_q else None
    if need_b or need_c or need_k:
        # suffix states summed over the G query groups of each kv head (the reduction dB, dC need)
        u, uz = p.states(a, g, a_off, g_off, p.G, reverse=True, logs=(qt, kt) if decay else None)
        if need_b:
            buf = _grad_buffer((*p.kv_lead, p.n, p.r), b)
            K._db_kernel[(p.tiles, p.H)](
                a, b, c, g, u, uz, buf, a_off, b_off, c_off, g_off, p.kv_offsets(buf), p.i0, p.i1, p.w, qt, kt,
                p.n, p.r, p.F, p.em, p.SE, p.G, p.T, p.NC, p.QPC, p.BLK, *strides, c.stride(-2), c.stride(-1),
                g.stride(-2), g.stride(-1), buf.stride(-2), buf.stride(-1), **grad_consts,
            )
            db = buf.sum_to_size(b.shape).to(b.dtype)
        if need_c or need_k:
            buf = _grad_buffer((*p.kv_lead, p.n, p.e), c, fp32=need_k)
            K._dc_kernel[(p.tiles, p.H, _cdiv(p.em, p.BE))](
                a, b, g, u, uz, buf, a_off, b_off, g_off, p.kv_offsets(buf), p.i0, p.i1, p.w, qt, kt,
                p.n, p.r, p.F, p.em, p.SE, p.G, p.T, p.NC, p.QPC, p.BLK, *strides,
                g.stride(-2), g.stride(-1), buf.stride(-2), buf.stride(-1), **consts,
            )
            if need_k:  # d klog_j = -<c_j, dC_j> (dC summed over the query groups, where klog is shared)
                dk = (-(c.float() * buf).sum(-1)).sum_to_size(log_shapes[1])
            dc = buf.sum_to_size(c.shape).to(c.dtype) if need_c else None
    return da, db, dc, dq, dk


class _LTMultiplyTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, c, block_size: int, include_diag: bool, square: bool, tf32, activation, qlog=None,
                klog=None):  # noqa: D102
        ctx.save_for_backward(a, b, c, qlog, klog)
        ctx.args = (block_size, include_diag, square, tf32, activation)
        p = _Plan(a, b, c, block_size, include_diag, square, tf32, activation)
        if p.n == 0 or p.H * p.G == 0 or p.e == 0:
            return torch.zeros(*p.lead, p.n, p.e, dtype=torch.float32, device=a.device)
        return _forward(p, a, b, c, None if qlog is None else p.log_tables(qlog, klog))

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):  # noqa: D102
        a, b, c, qlog, klog = ctx.saved_tensors
        need_a, need_b, need_c = ctx.needs_input_grad[:3]
        need_q, need_k = ctx.needs_input_grad[8:10] if qlog is not None else (False, False)
        p = _Plan(a, b, c, *ctx.args)
        if p.n == 0 or p.H * p.G == 0 or p.e == 0 or p.r == 0:
            zeros = [torch.zeros_like(x) if need else None
                     for x, need in zip((a, b, c, qlog, klog), (need_a, need_b, need_c, need_q, need_k))]
            return (*zeros[:3], None, None, None, None, None, *zeros[3:])
        logs = None if qlog is None else p.log_tables(qlog, klog)
        da, db, dc, dq, dk = _backward(p, a, b, c, grad_out.float(), need_a, need_b, need_c, logs, need_q, need_k,
                                       None if qlog is None else (qlog.shape, klog.shape))
        if dq is not None:
            dq = dq.to(qlog.dtype)
        if dk is not None:
            dk = dk.to(klog.dtype)
        return da, db, dc, None, None, None, None, None, dq, dk


def lt_multiply_triton(
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    block_size: int = 256,
    include_diag: bool = True,
    square: bool = False,
    tf32: bool | None = None,
    activation: str | None = None,
    decay: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """lt(phi(A) phi(B)^T) C with Triton kernels; same semantics and checks as ``ops.causal.lt_multiply``.

    Row i is sum_{j <= i} (phi(a_i) . phi(b_j)) c_j, phi = identity or (``square``) the symmetric
    tensor square. ``include_diag=False`` leaves out the block_size x block_size diagonal blocks
    aligned at 0. A (..., n, r), B (..., n, r), C (..., n, e) with broadcastable leading dims;
    fp32 / bf16 / fp16 inputs, fp32 output and fp32 accumulation. Differentiable in a, b, c.
    ``tf32``: the dots' operand precision (see ``_precision``): None follows the inputs' dtypes,
    True rounds operands to tf32 (what a half-precision model asks for; ~2^-10 relative per
    term), False keeps fp32 accuracy. ``activation`` ('elu': elu(x) + 1, 'relu'; identity features only):
    phi = that map of a and b, applied on chip as the kernels load them, the gradients taken through it: the
    same as passing act(a), act(b) without those n x r tensors (and their gradients) in memory.
    ``decay=(qlog, klog)``: term (i, j) times exp(qlog_i - klog_j) (``ops.causal``'s module doc: shapes and
    contract); the log-decays are read in fp32 and their gradients returned in their own dtype.
    """
    _check(a, b, c, block_size, include_diag, square, tf32, activation)
    if decay is None:
        return _LTMultiplyTriton.apply(a, b, c, block_size, bool(include_diag), bool(square), tf32, activation)
    qlog, klog = check_decay(a, b, c, decay)
    return _LTMultiplyTriton.apply(a, b, c, block_size, bool(include_diag), bool(square), tf32, activation, qlog,
                                   klog)
