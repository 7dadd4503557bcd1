"""Triton kernels for the causal product lt(phi(A) phi(B)^T) C (optional: needs ``triton``).

Importing this package never imports triton, so ``hf_polyattn.ops`` keeps working without it;
the kernels load on the first call of ``lt_multiply_triton``. Run them on CPU (slowly, for tests)
by setting ``TRITON_INTERPRET=1`` before that first call.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["is_available", "lt_multiply_triton"]


@functools.cache
def is_available() -> bool:
    """True when triton can be imported (says nothing about a GPU being present)."""
    try:
        import triton  # noqa: F401
    except Exception:  # a broken install counts as absent: callers fall back to PyTorch
        return False
    return True


def lt_multiply_triton(
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    block_size: int = 256,
    include_diag: bool = True,
    square: bool = False,
    tf32: bool | None = None,
) -> torch.Tensor:
    """Triton twin of ``hf_polyattn.ops.causal.lt_multiply`` (fp32 output); see ``.causal``."""
    from .causal import lt_multiply_triton as impl

    return impl(a, b, c, block_size, include_diag, square, tf32)
