"""Which implementation computes the causal product lt(phi(A) phi(B)^T) C.

Three implementations of one algorithm (PolySketchFormer Section 3), one naive twin
(``reference.py``) for all of them:

* ``loop``: ``causal.lt_multiply``, a Python loop over blocks that builds each block's
  features in cache and stores none for backward. Fastest on the CPU, where memory traffic
  dominates; about 8,300 kernel launches per forward+backward at n=32k, b=256 (H100: 170 ms,
  the GPU idle half of it).
* ``batched``: ``causal.lt_multiply_batched``, the same algorithm as ~10 batched kernels:
  the accelerator path when Triton is absent.
* ``triton``: ``ops.triton.lt_multiply_triton``, chunked Triton kernels that form the
  squared features on chip (``pip install hf_polyattn[gpu]``).

``auto`` picks ``triton`` on CUDA when Triton imports, ``batched`` on any other accelerator
or on CUDA without Triton, ``loop`` on the CPU. Measured (layer forward+backward, bf16 module,
H=16, d=64; ``recipes/results/profile_gpu_kernels/h100-bf16.jsonl``, one H100): polysketch
triton 10.7 / 41.9 ms vs batched 40.9 / 147.5 ms at n = 8k / 32k; for identity features the two
are within 8% (linear elu+1 at 32k 9.75 vs 10.4 ms, performer 29.2 vs 28.3 ms) and triton holds
less memory (linear at 32k: 1.9 vs 2.8 GB), so triton for every kind. On 2 CPU cores batched was
up to 2.6x slower than the loop (``recipes/results/benchmark_backends/cpu-fp32.md``).
``PolyAttnConfig.backend`` forces one; so does the environment variable
``HF_POLYATTN_BACKEND`` when the config says ``auto`` (handy for benchmarks and CI without
touching saved configs).
"""

from __future__ import annotations

import os

import torch

from ..config import BACKENDS
from .causal import lt_multiply, lt_multiply_batched

__all__ = ["BACKENDS", "ENV_VAR", "lt_product", "resolve_backend", "triton_available"]

ENV_VAR = "HF_POLYATTN_BACKEND"


# the Triton kernels' limit on r (the per-row inputs, before squaring): ops/triton/causal.py _MAX_R
TRITON_MAX_INPUT_FEATURES = 256


def _is_auto(requested: str) -> bool:
    return requested == "auto" and os.environ.get(ENV_VAR, "").strip() in ("", "auto")


def triton_available() -> bool:
    try:
        from .triton import is_available
    except ImportError:
        return False
    return is_available()


def _triton_interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "") not in ("", "0")


def resolve_backend(requested: str, device: torch.device, dtype: torch.dtype = torch.float32) -> str:
    """The concrete backend ('loop', 'batched' or 'triton') for ``requested`` on ``device``.

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
    return requested


def lt_product(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, block_size: int, include_diag: bool,
               square: bool, backend: str = "auto", tf32: bool | None = None) -> torch.Tensor:
    """lt(phi(A) phi(B)^T) C by the chosen backend (see the module doc).

    ``tf32``: operand precision of the Triton kernels' dots (``ops.triton.causal._precision``);
    the attention module passes True for half-precision models. The PyTorch backends follow
    torch's own float32 matmul setting.
    """
    which = resolve_backend(backend, a.device, a.dtype)
    if which == "triton" and a.shape[-1] > TRITON_MAX_INPUT_FEATURES and _is_auto(backend):
        which = "batched"  # e.g. performer with num_features > 256: beyond the kernels' tiles
    if which == "triton":
        from .triton import lt_multiply_triton

        return lt_multiply_triton(a, b, c, block_size, include_diag, square, tf32)
    fn = lt_multiply if which == "loop" else lt_multiply_batched
    return fn(a, b, c, block_size, include_diag, square)
