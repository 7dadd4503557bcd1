"""The exact sliding window of an inference call on the CPU, through PyTorch's fused flash-attention kernel.

``LocalExactMixin._window_exact`` forms each tile's scores (w queries x 2w candidate keys), masks, exponentiates and
multiplies them as separate tensors. That is what training needs (the weights are rematerialised in backward), but
without a gradient it is memory traffic: at 16k tokens a SmolLM2-shaped layer (6 query heads, 2 kv heads, d = 64,
w = 128) spent 0.49 s of one thread there, against 0.17 s for the same tiles through
``torch.ops.aten._scaled_dot_product_flash_attention_for_cpu``, which fuses the mask, the running max, the
exponentials and both products and returns each row's log-sum-exp.

The tiles: queries [t w, (t+1) w) of every query head of a kv head (its G heads stacked as G w rows) against keys
[(t-1) w, (t+1) w) (a strided view of the keys padded by w in front, no copy), one shared (G w, 2w) mask for the
window's band. Tiles whose candidates hold a key the call leaves out (key padding, or the sinks, which the window
reads as padding: ``Sinks.rest``) get their own masks in a second call. The sinks themselves are a few extra keys per
query (``Sinks``), scored apart and merged under the same normaliser, as in ``_window_exact``.

Returned like ``_window_exact``: the numerator and normaliser column ``loc`` = sum_j exp(x_j - m) [v_j, 1] and the
log of the factor ``-m`` that puts the kernel part on their scale, for m = max(0, the row's log-sum-exp over the
window and its sinks) (``_window_exact`` takes the row's largest score: any m >= it gives the same output, and the
log-sum-exp is what the fused kernel returns). A row that sees no key gets loc = 0 and m = 0, as there.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from .window import Sinks, slot_scores

__all__ = ["flash_window_available", "rows_flash", "window_flash"]

_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def flash_window_available(q: torch.Tensor) -> bool:
    """Whether ``window_flash`` serves tensors like ``q``: float32 on the CPU, PyTorch's fused kernel present."""
    return _FLASH is not None and q.device.type == "cpu" and q.dtype == torch.float32


def _band(window: int, rows: int, device) -> torch.Tensor:
    """(rows, 2w) bool: query i of a tile (row r = i mod w, its head's rows stacked) sees candidate c when
    i < c <= i + w (candidates start w keys before the tile)."""
    i = torch.arange(rows, device=device)[:, None] % window
    c = torch.arange(2 * window, device=device)[None, :]
    return (c > i) & (c <= i + window)


def _range(idx: torch.Tensor) -> tuple[int, int] | None:
    """(start, count) when the sorted indices ``idx`` are consecutive (the clean tiles of a call without padding:
    every tile but the first), else None."""
    n = idx.numel()
    start = int(idx[0])
    return (start, n) if int(idx[-1]) - start + 1 == n else None


def _take(x: torch.Tensor, idx: torch.Tensor, at: tuple[int, int] | None) -> torch.Tensor:
    """x's tiles ``idx`` along dim 1: a view for a consecutive range (an index_select copies them: at batch 8 x 4k
    tokens each copy of a layer's tiles is tens of MiB, which glibc maps fresh from the kernel, page faults
    included, every call)."""
    return x.narrow(1, *at) if at is not None else x.index_select(1, idx)


def window_flash(qs: torch.Tensor, ks: torch.Tensor, vext: torch.Tensor, mask: torch.Tensor | None, window: int,
                 scale: float, sinks: Sinks | None = None, sink_q: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(loc (B, Hkv, G, n, d + 1), -m (B, Hkv, G, n, 1)) of the causal window of w = ``window`` keys (module
    docstring). qs (B, Hkv, G, n, d) the model's own queries (rows bottom-right aligned), ks (B, Hkv, 1, n, d),
    vext (B, Hkv, 1, n, d + 1) [v, 1], ``mask`` (B or 1, n) the keys the window reads (False: padded or a sink),
    ``sinks`` the slots attended besides (``sink_q``: the queries re-rotated for them, aligned with qs, or None)."""
    b, hkv, g, n, d = qs.shape
    w = window
    tiles = -(-n // w)
    rows = g * w
    # queries: (B Hkv, tiles, G w, d), the G heads of a kv head stacked within each tile
    q = F.pad(qs, (0, 0, 0, tiles * w - n)).view(b, hkv, g, tiles, w, d).permute(0, 1, 3, 2, 4, 5)
    q = q.reshape(b * hkv, tiles, rows, d)
    # candidates: keys (t-1) w .. (t+1) w - 1 of tile t, a strided view
    kp = F.pad(ks[:, :, 0], (0, 0, w, tiles * w - n))
    vp = F.pad(vext[:, :, 0, :, :d], (0, 0, w, tiles * w - n))
    kt = kp.unfold(2, 2 * w, w).transpose(-1, -2).reshape(b * hkv, tiles, 2 * w, d)
    vt = vp.unfold(2, 2 * w, w).transpose(-1, -2).reshape(b * hkv, tiles, 2 * w, d)
    band = _band(w, rows, qs.device)
    # candidates the call leaves out (padding, positions before 0 or past n, sinks read through their slots): the
    # tiles holding any get their own masks
    real = torch.ones(1, n, dtype=torch.bool, device=qs.device) if mask is None else mask
    real = F.pad(real, (w, tiles * w - n), value=False)  # (B or 1, (tiles + 1) w)
    cand = real.unfold(1, 2 * w, w)  # (B or 1, tiles, 2w)
    clean = cand.all(-1).all(0)  # (tiles,)
    out = torch.empty(b * hkv, tiles, rows, d, dtype=q.dtype, device=q.device)
    lse = torch.empty(b * hkv, tiles, rows, dtype=q.dtype, device=q.device)
    neg = torch.tensor(float("-inf"), dtype=q.dtype, device=q.device)
    zero = torch.zeros((), dtype=q.dtype, device=q.device)
    idx_clean = clean.nonzero().squeeze(1)
    if idx_clean.numel():
        m_band = torch.where(band, zero, neg)
        at = _range(idx_clean)
        o, lse_part = _FLASH(_take(q, idx_clean, at), _take(kt, idx_clean, at), _take(vt, idx_clean, at),
                             0.0, False, attn_mask=m_band, scale=scale)
        if at is not None:
            out.narrow(1, *at).copy_(o)
            lse.narrow(1, *at).copy_(lse_part)
        else:
            out.index_copy_(1, idx_clean, o)
            lse.index_copy_(1, idx_clean, lse_part)
    idx_dirty = (~clean).nonzero().squeeze(1)
    if idx_dirty.numel():
        allowed = band[None, None] & cand.index_select(1, idx_dirty)[:, :, None, :]  # (B or 1, Td, rows, 2w)
        allowed = allowed[:, None].expand(b, hkv, -1, -1, -1).reshape(b * hkv, idx_dirty.numel(), rows, 2 * w)
        seen = allowed.any(-1)
        # a row that sees no key reads one (finite) and is zeroed after: the kernel's own -inf row would be NaN
        allowed = allowed | ~seen[..., None]
        o, lse_part = _FLASH(q.index_select(1, idx_dirty), kt.index_select(1, idx_dirty), vt.index_select(1, idx_dirty),
                      0.0, False, attn_mask=torch.where(allowed.contiguous(), zero, neg), scale=scale)
        out.index_copy_(1, idx_dirty, torch.where(seen[..., None], o, zero))
        lse.index_copy_(1, idx_dirty, torch.where(seen, lse_part, neg))

    def back(x):  # (B Hkv, tiles, G w, e) -> (B, Hkv, G, n, e)
        e = x.shape[-1]
        x = x.view(b, hkv, tiles, g, w, e).permute(0, 1, 3, 2, 4, 5).reshape(b, hkv, g, tiles * w, e)
        return x[..., :n, :]

    return _with_sinks(back(out), back(lse.unsqueeze(-1)), qs, scale, torch.arange(n, device=qs.device), sinks,
                       sink_q)


def _with_sinks(out: torch.Tensor, lse: torch.Tensor, qs: torch.Tensor, scale: float, qpos: torch.Tensor,
                sinks: Sinks | None, sink_q: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(loc, -m) from the fused kernel's normalised output ``out`` (B, Hkv, G, r, d) and log-sum-exp ``lse`` (..,
    1) (-inf for a row that saw no key, whose ``out`` is 0) of the queries ``qs`` at positions ``qpos`` (r,), with
    the sinks' slots scored apart and merged under the same normaliser (module docstring)."""
    top = lse
    extra = None
    if sinks is not None:
        # (B, Hkv, G, r, E) scores of the slots (a few per query), visible from their positions on
        extra = slot_scores(qs * scale, sinks.k, None if sink_q is None else sink_q * scale, sinks.learned)
        extra = extra.masked_fill(~sinks.visible(qpos), float("-inf"))  # (B, 1, 1, r, E)
        top = torch.maximum(top, extra.amax(-1, keepdim=True))
    m = torch.where(torch.isfinite(top), top.clamp_min(0.0), 0.0)
    weight = torch.exp(lse - m)  # the keys' mass on the scale exp(-m): 0 for a row that sees none
    loc = torch.cat([out * weight, weight], dim=-1)
    if extra is not None:
        loc = loc + torch.matmul(torch.exp(extra - m), sinks.v)
    return loc, -m


def rows_flash(qs: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, allowed: torch.Tensor, scale: float,
               qpos: torch.Tensor, sinks: Sinks | None = None, sink_q: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(loc (B, Hkv, G, r, d + 1), -m (B, Hkv, G, r, 1)) of r query rows over keys of their own, as
    ``window_flash`` returns them: the sparse cache's rows (``SparseMixin._sparse_rows``: a block's queries over
    its window, its pending keys and the cache). qs (B, Hkv, G, r, d) the model's own queries at positions
    ``qpos`` (r,); keys, values (B, Hkv, n, d) one kv head's, shared by its G query heads (a stride-0 view, no
    copy); ``allowed`` (B, Hkv, r, n) bool, the keys each row reads; ``sinks`` / ``sink_q`` as in window_flash.
    One fused call per block instead of the scores' products, mask, max and exponentials as tensors: a 4,096-token
    prefill of the linear-only preset's SmolLM2 (3 kv heads a layer, 64 rows against 191 + 512 keys a block) took
    26.1 s against 32.2 s, best of 2 alternating, 2 threads of the project's 2-core CPU
    (recipes/experiments/retrieval/fused_rows_cost.py; the other repeat 31.8 against 33.2 s)."""
    b, hkv, g, r, d = qs.shape
    n, bh = keys.shape[2], b * hkv
    seen = allowed.any(-1, keepdim=True)  # (B, Hkv, r, 1)
    blind = not bool(seen.all())
    if blind:  # a row that sees no key reads one (finite) and is zeroed after: the kernel's own -inf row is NaN
        allowed = allowed | ~seen
    mask = torch.where(allowed, 0.0, float("-inf")).to(qs.dtype).view(bh, 1, r, n)
    out, lse = _FLASH(qs.reshape(bh, g, r, d), keys.reshape(bh, 1, n, d).expand(bh, g, n, d),
                      values.reshape(bh, 1, n, d).expand(bh, g, n, d), 0.0, False, attn_mask=mask, scale=scale)
    out, lse = out.view(b, hkv, g, r, d), lse.view(b, hkv, g, r, 1)
    if blind:
        seen = seen.unsqueeze(2)  # (B, Hkv, 1, r, 1)
        out, lse = torch.where(seen, out, 0.0), torch.where(seen, lse, float("-inf"))
    return _with_sinks(out, lse, qs, scale, qpos, sinks, sink_q)
