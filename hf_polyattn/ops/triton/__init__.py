"""Triton kernels (optional: need ``triton``): the causal product lt(phi(A) phi(B)^T) C and the exact
diagonal blocks of ``local_exact`` (``local_blocks_triton``).

Importing this package never imports triton, so ``hf_polyattn.ops`` keeps working without it;
the kernels load on the first call of ``lt_multiply_triton`` / ``local_blocks_triton``. Run them on CPU
(slowly, for tests) by setting ``TRITON_INTERPRET=1`` before that first call.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["LOCAL_MAX_HEAD_DIM", "is_available", "local_blocks_triton", "lt_multiply_triton"]

# the local blocks' limit on the q/k and value head dims (ops/triton/local.py MAX_HEAD_DIM)
LOCAL_MAX_HEAD_DIM = 128


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
    activation: str | None = None,
    decay: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Triton twin of ``hf_polyattn.ops.causal.lt_multiply`` (fp32 output); see ``.causal``."""
    from .causal import lt_multiply_triton as impl

    return impl(a, b, c, block_size, include_diag, square, tf32, activation, decay)


def local_blocks_triton(*args, **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Triton twin of ``LocalExactMixin._local_blocks`` (exact diagonal blocks; fp32 output): the arguments and
    their checks are those of ``.local.local_blocks_triton``, imported on this first call."""
    from .local import local_blocks_triton as impl

    return impl(*args, **kwargs)
