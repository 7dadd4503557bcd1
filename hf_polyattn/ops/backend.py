"""Which implementation computes the causal product lt(phi(A) phi(B)^T) C.

Three implementations of one algorithm (PolySketchFormer Section 3), one naive twin
(``reference.py``) for all of them, and a maintained library's kernel for the part it covers:

* ``loop``: ``causal.lt_multiply``, a Python loop over blocks that builds each block's
  features in cache and stores none for backward. Fastest on the CPU, where memory traffic
  dominates; about 8,300 kernel launches per forward+backward at n=32k, b=256 (H100: 170 ms,
  the GPU idle half of it).
* ``batched``: ``causal.lt_multiply_batched``, the same algorithm as ~10 batched kernels:
  the accelerator path when Triton is absent.
* ``triton``: ``ops.triton.lt_multiply_triton``, chunked Triton kernels that form the
  squared features on chip (``pip install hf_polyattn[gpu]``).
* ``fla``: fla-core's ``chunk_linear_attn`` (``pip install hf_polyattn[fla]``, pinned), CUDA only,
  for identity features with the diagonal included: the linear and performer kinds without
  ``local_exact`` (their plain product and a window's far part); a decayed product on its
  ``chunk_simple_gla`` (one log-decay per key and head), and a layer's sliding window through
  FlexAttention (``ops/flex.py``). Asked for by name (``backend='fla'`` or the environment variable); 'auto'
  does not take it: on one H100 (bf16, H=16, d=64, causal forward+backward, n = 32k, one process) fla-core's
  kernel alone took 3.7 ms, a linear elu+1 layer on 'fla' 10.1 ms and the same layer on 'triton' 5.5 ms
  (``recipes/results/SECTION_gpu_h100_auto.md``). Its dots follow
  fla-core (tf32 for fp32 inputs: ~2^-10 relative, as ``triton`` in a half-precision model);
  squared features (polysketch) and dropped diagonal blocks are refused by name.

``auto`` picks ``triton`` on CUDA when Triton imports, ``batched`` on any other accelerator
or on CUDA without Triton, ``loop`` on the CPU. Measured (layer forward+backward, bf16 module,
H=16, d=64; ``recipes/results/profile_gpu_kernels/h100-bf16.jsonl``, one H100): polysketch
triton 10.7 / 41.9 ms vs batched 40.9 / 147.5 ms at n = 8k / 32k; for identity features the two
are within 8% (linear elu+1 at 32k 9.75 vs 10.4 ms, performer 29.2 vs 28.3 ms) and triton holds
less memory (linear at 32k: 1.9 vs 2.8 GB), so triton for every kind. On 2 CPU cores batched was
up to 2.6x slower than the loop (``recipes/results/benchmark_backends/cpu-fp32.md``), but not for a decayed
product (``decay='scalar'`` or ``'gate'``, the long-context default): the loop's per-block decay factors (a few
small exps and scalings per block, forward and twice backward) cost more than the batched path's materialised
states, so 'auto' takes ``batched`` for it on the CPU (``recipes/results/benchmark_backends/cpu-fp32-decay.md``).
``PolyAttnConfig.backend`` forces one; so does the environment variable ``HF_POLYATTN_BACKEND`` when the
config says ``auto`` (handy for benchmarks and CI without touching saved configs). 'auto' never picks
``fla``, for a product alone or a whole layer (``flex.layer_backend``).
"""

from __future__ import annotations

import functools
import os

import torch
from torch.nn import functional as F

from ..config import BACKENDS
from .causal import check_decay, lt_multiply, lt_multiply_batched
from .common import ACTIVATIONS, to_work

__all__ = ["BACKENDS", "ENV_VAR", "FLA_VERSION", "fla_available", "fla_gated_refusal", "lt_multiply_fla", "lt_product",
           "product_backend", "resolve_backend", "triton_available"]

ENV_VAR = "HF_POLYATTN_BACKEND"


# the Triton kernels' limit on r (the per-row inputs, before squaring): ops/triton/causal.py _MAX_R
TRITON_MAX_INPUT_FEATURES = 256

# fla-core: the version the 'fla' backend is written against (pyproject's [fla] extra), its key-dim limit
# (chunk_linear_attn's kernels tile K up to 256), the devices its Triton kernels run on
FLA_VERSION = "0.6.0"
FLA_MAX_FEATURES = 256
_FLA_DEVICES = ("cuda",)


def _is_auto(requested: str) -> bool:
    return requested == "auto" and os.environ.get(ENV_VAR, "").strip() in ("", "auto")


def triton_available() -> bool:
    try:
        from .triton import is_available
    except ImportError:
        return False
    return is_available()


def fla_available() -> bool:
    """True when fla-core's ``chunk_linear_attn`` imports (says nothing about a GPU being present)."""
    try:
        from fla.ops.linear_attn import chunk_linear_attn  # noqa: F401
    except Exception:  # a broken install counts as absent: 'fla' is then refused by name
        return False
    return True


# fla-core 0.6.0's own guard (fla/ops/common/chunk_o.py): on Hopper GPUs, Triton from 3.4.0 up to 3.7.1 computes
# the gated chunk backward (chunk_bwd_dqkwg) wrongly, so fla-core raises there unless tilelang serves it. Seen on an
# H200 with torch 2.11's Triton 3.6.0: the long-context default's forward + backward failed in its backward pass.
FLA_GATED_BAD_TRITON = ((3, 4, 0), (3, 7, 1))


def _version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split("+")[0].split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit()) if piece[:1].isdigit() else ""
        parts.append(int(digits) if digits else 0)
    return tuple(parts + [0] * (3 - len(parts)))


def fla_gated_refusal(device: torch.device) -> str | None:
    """Why fla-core cannot run a gated (decayed) layer's backward on ``device``, or None when it can: a Hopper GPU
    (compute capability 9.x) with Triton in [3.4.0, 3.7.1) and no tilelang (``FLA_GATED_BAD_TRITON``)."""
    if device.type != "cuda":
        return None
    return _fla_gated_refusal(device.index)


@functools.lru_cache(maxsize=16)  # asked on every gated layer's forward under 'auto': find_spec scans sys.path
def _fla_gated_refusal(index: int | None) -> str | None:
    if not torch.cuda.is_available():
        return None
    if torch.cuda.get_device_capability(index)[0] != 9:
        return None
    try:
        import triton
    except ImportError:
        return None
    version = _version_tuple(triton.__version__)
    low, high = FLA_GATED_BAD_TRITON
    if not low <= version < high:
        return None
    import importlib.util

    if importlib.util.find_spec("tilelang") is not None:
        return None
    return (f"fla-core's gated chunk backward is wrong on Hopper GPUs with Triton {triton.__version__} (>= 3.4.0 and "
            "< 3.7.1; fla-core refuses it): install triton>=3.7.1 (pip install 'hf_polyattn[gpu]' pins 3.9.0) or "
            "tilelang")


def _triton_interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "") not in ("", "0")


def resolve_backend(requested: str, device: torch.device, dtype: torch.dtype = torch.float32) -> str:
    """The concrete backend ('loop', 'batched', 'triton' or 'fla') for ``requested`` on ``device``.

    float64 inputs (the exact polynomial tensor path) never go to Triton, which computes in
    float32: 'auto' takes 'batched' for them on accelerators.
    """
    if requested not in BACKENDS:
        raise ValueError(f"backend must be one of {list(BACKENDS)}, got {requested!r}")
    if requested == "auto":
        env = os.environ.get(ENV_VAR, "").strip()
        if env:
            if env not in BACKENDS:
                raise ValueError(f"environment variable {ENV_VAR} must be one of {list(BACKENDS)}, got {env!r}")
            requested = env
    if requested == "auto":
        if device.type == "cpu":
            return "loop"
        if device.type == "cuda" and dtype != torch.float64 and triton_available():
            return "triton"
        return "batched"
    if requested == "triton":
        if not triton_available():
            raise ValueError("backend='triton' needs the triton package: pip install 'hf_polyattn[gpu]'")
        if dtype == torch.float64:
            raise ValueError("backend='triton' computes in float32; float64 inputs (the exact polynomial tensor "
                             "path) need backend='auto', 'batched' or 'loop'")
        if device.type != "cuda" and not _triton_interpreted():
            raise ValueError(f"backend='triton' runs on CUDA tensors (got {device.type}); on the CPU only under "
                             "Triton's interpreter (TRITON_INTERPRET=1, for tests): use backend='loop' or 'auto'")
    if requested == "fla":
        if not fla_available():
            raise ValueError(f"backend='fla' needs fla-core: pip install 'hf_polyattn[fla]' (fla-core=={FLA_VERSION})")
        if dtype == torch.float64:
            raise ValueError("backend='fla' computes in float32 at most; float64 inputs (the exact polynomial tensor "
                             "path) need backend='auto', 'batched' or 'loop'")
        if device.type not in _FLA_DEVICES:
            raise ValueError(f"backend='fla' runs fla-core's Triton kernels on CUDA tensors (got {device.type}): use "
                             "backend='loop' or 'auto' on the CPU")
    return requested


# fla-core's chunk kernels tile the value columns (BV autotuned over 32 ... 128, fla/ops/common/chunk_o.py) and
# recompute a chunk's q k^T in every tile: [v, 1] with d = 64, 65 columns, runs two 64-wide tiles, about twice the work
# of v alone. Measured on one H100 (bf16, n = 32k, forward + backward, recipes/results/SECTION_gpu_h100_graphs.md): our
# linear-elu layer with fp32 features and 65 columns 7.39 ms against fla-core's own row, bf16 features and 64
# columns, 3.76 ms. So columns past a multiple of this many (the normaliser) go through a cumulative sum instead.
FLA_VALUE_TILE = 64
# at most this many such columns (a cumsum of n x r x t floats each): [v, 1] has one
_FLA_CUMSUM_COLUMNS = 4


def lt_multiply_fla(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
                    decay: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """lt(A B^T) C, diagonal included, by fla-core's ``chunk_linear_attn`` (fp32 output); with ``decay=(qlog,
    klog)`` (``lt_product``'s contract) term (i, j) times exp(qlog_i - klog_j) by its ``chunk_simple_gla``.

    A (..., n, r), B (..., n, r), C (..., n, e) with broadcastable leading dims (query groups of a
    kv head included). fla-core takes (batch, n, heads, features) with one key per query head, so
    every leading index becomes a head: B and C are copied per query group (G-fold; the Triton
    kernels read them in place). chunk_simple_gla weighs term (i, j) by exp(g_{j+1} + ... + g_i), one log-gate g_t
    per key and head: here g_t = klog_t - klog_{t-1} (g_0 = 0), and row i of A is scaled by exp(qlog_i - klog_i) <= 1
    (the same product; in float32 the gates' differences of the cumulative sums are off by about |klog| 2^-24 each).

    Precision: fla-core reads A, B and C in bfloat16 when C is bfloat16 (a bf16 model's values: its features, formed in
    float32, are rounded to it, as fla-core's own rows feed them; its kernels accumulate in float32), else in the
    inputs' common dtype (an fp16 model's product stays float32: fla-core returns the unnormalised sums in its inputs'
    dtype, and at 32k keys of elu + 1 features they pass fp16's largest value, 65,504). Without decay, the columns of C
    past a multiple of ``FLA_VALUE_TILE`` (at most ``_FLA_CUMSUM_COLUMNS``: the normaliser of [v, 1]) are computed in
    float32 as a_i . cumsum_{j <= i}(b_j c_j) from the same rounded features, instead of a second tile of every chunk.
    """
    if a.shape[-1] > FLA_MAX_FEATURES:
        raise ValueError(f"backend='fla': feature size r = {a.shape[-1]} > {FLA_MAX_FEATURES} is beyond fla-core's "
                         "kernels (performer num_features): use backend='triton' or 'batched'")
    n, e = a.shape[-2], c.shape[-1]
    lead = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2], c.shape[:-2],
                                  *(() if decay is None else (x.shape[:-1] for x in decay)))
    dtype = c.dtype if c.dtype == torch.bfloat16 else torch.promote_types(torch.promote_types(a.dtype, b.dtype),
                                                                            c.dtype)

    def heads(x: torch.Tensor, dt=dtype) -> torch.Tensor:  # (..., n, f) -> (1, n, heads, f), contiguous
        x = x.to(dt).expand(*lead, n, x.shape[-1]).reshape(-1, n, x.shape[-1])
        return x.transpose(0, 1).unsqueeze(0).contiguous()

    def back(out: torch.Tensor) -> torch.Tensor:  # (1, n, heads, f) -> (*lead, n, f) in float32
        return out.squeeze(0).transpose(0, 1).reshape(*lead, n, out.shape[-1]).float()

    if decay is not None:
        from fla.ops.simple_gla import chunk_simple_gla

        qlog, klog = (x.float() for x in decay)
        gates = F.pad(klog[..., 1:] - klog[..., :-1], (1, 0))  # g_0 = 0: only differences of klog matter
        a = a.float() * torch.exp(qlog - klog).unsqueeze(-1)
        out, _ = chunk_simple_gla(heads(a), heads(b), heads(c), g=heads(gates.unsqueeze(-1), torch.float32).squeeze(-1),
                                  scale=1.0)
        return back(out)
    from fla.ops.linear_attn import chunk_linear_attn

    tail = e % FLA_VALUE_TILE if e > FLA_VALUE_TILE else 0
    tail = tail if tail <= _FLA_CUMSUM_COLUMNS else 0
    a, b = a.to(dtype), b.to(dtype)  # rounded once: fla-core and the cumulative sum read the same features
    out, _ = chunk_linear_attn(heads(a), heads(b), heads(c[..., : e - tail]), scale=1.0, normalize=False)
    out = back(out)
    if not tail:
        return out
    # in float32: running sums of b_j c_j^T over the keys, laid (..., r, t, n) so that the scan runs along the
    # innermost dim, and read as a product and a sum over r: a scan along dim -3 (stride r t) and 512k batched
    # 1 x r x t matmuls made linear-elu take 34.4 ms against 10.1 ms this way (H100, bf16, 32k, forward + backward,
    # SECTION_gpu_h100_auto.md)
    terms = (b.float().unsqueeze(-1) * c[..., e - tail :].float().unsqueeze(-2)).movedim(-3, -1)  # (..., r, t, n)
    sums = torch.cumsum(terms.contiguous(), dim=-1).movedim(-1, -3)  # (..., n, r, t)
    rest = (a.float().unsqueeze(-1) * sums).sum(-2)  # (*lead, n, t)
    return torch.cat([out, rest.expand(*lead, n, tail)], dim=-1)


def product_backend(requested: str, device: torch.device, dtype: torch.dtype, features: int,
                    decay: bool = False) -> str:
    """The backend ``lt_product`` runs for ``features`` input columns (r before squaring): ``resolve_backend``,
    except that 'auto' leaves 'triton' for 'batched' beyond the kernels' tiles (performer with num_features > 256)
    and, on the CPU, 'loop' for 'batched' when the product is decayed (``decay``): the loop's per-block decay
    factors made it the slower one there (module doc, ``recipes/results/benchmark_backends/cpu-fp32-decay.md``)."""
    which = resolve_backend(requested, device, dtype)
    if which == "triton" and features > TRITON_MAX_INPUT_FEATURES and _is_auto(requested):
        which = "batched"
    if which == "loop" and decay and _is_auto(requested):
        which = "batched"
    return which


def lt_product(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, block_size: int, include_diag: bool,
               square: bool, backend: str = "auto", tf32: bool | None = None,
               activation: str | None = None,
               decay: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """lt(phi(A) phi(B)^T) C by the chosen backend (see the module doc).

    ``tf32``: operand precision of the Triton kernels' dots (``ops.triton.causal._precision``);
    the attention module passes True for half-precision models. The PyTorch backends follow
    torch's own float32 matmul setting. ``activation`` ('elu': elu(x) + 1, 'relu'; identity features only):
    phi(x) = that map of a and b; the Triton kernels apply it as they load a and b (no n x r feature tensors
    or their gradients in memory), the other backends to a float32 (float64 stays) copy first.
    ``decay=(qlog, klog)``: term (i, j) weighted by exp(qlog_i - klog_j), cumulative log-decays per row, qlog
    broadcasting like a's leading dims and klog like b's and c's; contract: klog non-increasing, qlog_i <= klog_i
    (``causal``'s module doc). None is the undecayed product, by the same code as without the argument. The
    PyTorch backends and 'fla' compute a decayed product of half inputs in float32.
    """
    if activation is not None:
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be None or one of {sorted(ACTIVATIONS)}, got {activation!r}")
        if square:
            raise ValueError(f"activation={activation!r} is for identity features: square must be False")
    which = product_backend(backend, a.device, a.dtype, a.shape[-1], decay is not None)
    if decay is not None:
        decay = check_decay(a, b, c, decay)
        if which not in ("triton", "fla"):  # 'fla' reads half values as they are (lt_multiply_fla's precision)
            a, b, c, *decay = to_work(a, b, c, *decay)  # half inputs: the decays and sums in float32
            decay = tuple(decay)
    if activation is not None and which != "triton":
        a, b = (ACTIVATIONS[activation](x) for x in to_work(a, b))
    if which in ("loop", "batched") and c.dtype != a.dtype:
        c = c.to(torch.promote_types(a.dtype, c.dtype))  # half values: the PyTorch backends compute in fp32
    if which == "fla":
        if square or not include_diag:
            raise ValueError("backend='fla' computes identity features with the diagonal included (the linear and "
                             "performer kinds without local_exact); " + ("polysketch's squared features" if square
                             else "local_exact's dropped diagonal blocks") + " need backend='triton', 'batched' or "
                             "'loop' (or 'auto')")
        return lt_multiply_fla(a, b, c, decay)
    if which == "triton":
        from .triton import lt_multiply_triton

        return lt_multiply_triton(a, b, c, block_size, include_diag, square, tf32, activation, decay)
    fn = lt_multiply if which == "loop" else lt_multiply_batched
    return fn(a, b, c, block_size, include_diag, square, decay)
