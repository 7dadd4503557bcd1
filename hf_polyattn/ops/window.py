"""Sliding-window hybrid attention: exact weights on the previous w keys, the linear-time
kernel on every key before them, one normaliser (LoLCATs' formulation).

For a causal query i (positions of keys, bottom-right aligned):

    window  W(i) = { j : i - w < j <= i }          exact kernel (softmax or polynomial)
    far     R(i) = { j : j <= i - w }              phi(q_i) . phi(k_j)

    out_i = (sum_W e_ij v_j + s_i sum_R phi_ij v_j) / (sum_W e_ij + s_i sum_R phi_ij)

with s_i = exp(-m_i) (times a learnable per-head mixing factor when asked) for a softmax
window whose row stabiliser is m_i, and s_i = 1 for a polynomial window. Bidirectional
(BERT): W(i) = { j : |i - j| < w }, R(i) = the rest.

Why not the block-diagonal ``local_exact``: there the first query of each block sees only
itself exactly; the calibration probe in PEERS.md got 62.6 perplexity with a 64-token exact
window against 95.3 without on SmolLM2. A sliding window is also translation invariant, so
left padding changes nothing (block boundaries shift with it).

Linear time: the far part is the ordinary causal product with queries shifted by w
(``lt(phi(Q)[w:], phi(K)[:-w]) V[:-w]``: row i sums keys j <= i - w), so it runs on every
backend of ``backend.lt_product``; the window is computed in tiles of w queries against
their 2w (bidirectional 3w) candidate keys: O(n w d) time, O(n w) memory per head (on the
'triton' backend, ``ops/triton/local.py`` instead: nothing n x w stored).
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from .backend import lt_product

__all__ = ["shifted_lt", "window_scores", "window_tiles"]


def shifted_lt(fq: torch.Tensor, fk: torch.Tensor, vext: torch.Tensor, shift: int, block: int, square: bool,
               backend: str = "auto", tf32: bool | None = None) -> torch.Tensor:
    """Row i = sum_{j <= i - shift} phi(q_i).phi(k_j) vext_j (zero for i < shift).

    fq (..., n, f), fk (..., n, f), vext (..., n, e), broadcastable leading dims.
    """
    n = fq.shape[-2]
    lead = torch.broadcast_shapes(fq.shape[:-2], fk.shape[:-2], vext.shape[:-2])
    if shift >= n:
        # Every key lies inside the window: the far part is empty, yet it stays in the autograd graph through a
        # sum over zero rows of each input (exactly 0 forward, zero gradients backward), so the kernel's
        # parameters get a zero gradient instead of none. DDP's reducer waits for every parameter each step
        # ("Expected to have finished reduction ... parameters that were not used in producing loss" at
        # context <= window), and an attention-transfer loss of such layers had no grad_fn at all. Chosen over
        # DDP's find_unused_parameters, which walks the autograd graph on every step of every run to serve
        # this one case and would still leave the transfer loss without a grad_fn.
        empty = fq[..., :0, :].sum() + fk[..., :0, :].sum() + vext[..., :0, :].sum()
        return vext.new_zeros(*lead, n, vext.shape[-1]) + empty.to(vext.dtype)
    out = lt_product(fq[..., shift:, :], fk[..., : n - shift, :], vext[..., : n - shift, :], block, True, square,
                     backend, tf32)
    return F.pad(out, (0, 0, shift, 0))


def window_tiles(x: torch.Tensor, window: int, causal: bool) -> torch.Tensor:
    """Candidate keys of each tile of ``window`` queries: (..., tiles, span, d).

    Tile t holds queries [t w, (t+1) w); its candidates are keys [(t-1) w, (t+1) w) when
    causal, [(t-1) w, (t+2) w) otherwise (zero-padded at both ends). A strided view: no copy
    until the matmul reads it.
    """
    n = x.shape[-2]
    tiles = -(-n // window)
    after = tiles * window - n + (0 if causal else window)
    padded = F.pad(x, (0, 0, window, after))
    span = 2 * window if causal else 3 * window
    return padded.unfold(-2, span, window).transpose(-1, -2)


def window_scores(q: torch.Tensor, k: torch.Tensor, window: int, causal: bool, scale: float,
                  key_mask: torch.Tensor | None):
    """Scores s q.k of every query against its tile's candidate keys, and which are in its window.

    q (B, Hkv, G, n, d), k (B, Hkv, 1, n, d), key_mask (B, n) bool or None.
    Returns scores (B, Hkv, G, tiles, w, span) and allowed (broadcastable bool): j in W(i),
    0 <= j < n and not padded.
    """
    n = q.shape[-2]
    tiles = -(-n // window)
    qt = F.pad(q, (0, 0, 0, tiles * window - n)).unflatten(-2, (tiles, window))
    kt = window_tiles(k, window, causal)
    scores = torch.matmul(qt * scale, kt.transpose(-1, -2))
    span = kt.shape[-2]
    qpos = torch.arange(tiles * window, device=q.device).view(tiles, window, 1)
    kpos = (torch.arange(tiles, device=q.device).view(tiles, 1, 1) * window - window
            + torch.arange(span, device=q.device).view(1, 1, span))
    dist = qpos - kpos
    allowed = (dist < window) & (kpos >= 0) & (kpos < n) & (qpos < n)
    allowed = allowed & ((dist >= 0) if causal else (dist > -window))
    if key_mask is not None:
        km = window_tiles(key_mask[:, None, None, :, None].to(q.dtype), window, causal)[..., 0] > 0
        allowed = allowed & km.unsqueeze(-2)
    return scores, allowed
