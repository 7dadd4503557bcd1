"""Input helpers shared by the tests of tests/kinds: key padding masks and seeded q / k / v."""

from __future__ import annotations

import torch


def padding_mask(batch: int, n: int, side: str | None) -> torch.Tensor | None:
    """A (batch, n) key padding mask (True = real key), or None for ``side=None``. Only row 0 is padded, except
    for "holes" (row 1 too):

    - "left": row 0's first n // 3 keys; "right": row 0's last n // 3 keys;
    - "holes": row 0 every third key from key 1 on, row 1 its last key;
    - "short": row 0 all but its last 3 keys;
    - "all": all of row 0.
    """
    if side is None:
        return None
    mask = torch.ones(batch, n, dtype=torch.bool)
    if side == "left":
        mask[0, : n // 3] = False
    elif side == "right":
        mask[0, n - n // 3:] = False
    elif side == "holes":
        mask[0, 1::3] = False
        mask[1, -1] = False
    elif side == "short":
        mask[0, :-3] = False
    elif side == "all":
        mask[0] = False
    else:
        raise ValueError(f"unknown padding side {side!r}")
    return mask


def qkv(b: int, h: int, hkv: int, lq: int, lk: int, d: int, *, seed: int, dtype: torch.dtype = torch.float64,
        grad: bool = False, draw_dtype: torch.dtype | None = None):
    """q (b, h, lq, d), k and v (b, hkv, lk, d) from standard normals drawn in that order from one generator seeded
    with ``seed``. They are drawn in ``draw_dtype`` (default ``dtype``) and cast to ``dtype``: a low-precision dtype
    drawn in float64 and cast gives other values than drawn directly. ``grad``: leaves that require grad."""
    gen = torch.Generator().manual_seed(seed)
    draw = dtype if draw_dtype is None else draw_dtype
    q = torch.randn(b, h, lq, d, generator=gen, dtype=draw).to(dtype).requires_grad_(grad)
    k = torch.randn(b, hkv, lk, d, generator=gen, dtype=draw).to(dtype).requires_grad_(grad)
    v = torch.randn(b, hkv, lk, d, generator=gen, dtype=draw).to(dtype).requires_grad_(grad)
    return q, k, v
