"""Exact sliding-window softmax attention: a model's own local layers, kept as they are.

Gemma 2 / 3, Mistral, Ministral, OLMo 3, EXAONE 4, Qwen2 (``use_sliding_window``) and ModernBERT compute some or all
of their layers as softmax over each query's last W keys. Those layers are already O(n W), so a retrofit keeps them
exact (``PolyAttnConfig.sliding_layers='exact'``) and gives the kind to the full-attention layers only. This module
computes them as transformers' eager / SDPA attention does under the model's sliding mask, ``W`` being the
``sliding_window`` the model passes to its attention function:

* causal: key j is visible to query i iff 0 <= i - j < W (``masking_utils.sliding_window_overlay``: kv > q - W);
* bidirectional: |i - j| < W (ModernBERT passes W = its half window + 1, Gemma 3's bidirectional overlay is
  |i - j| < W: the same rule);
* soft-capping: scores s q.k become c tanh(s q.k / c) (Gemma 2's ``attn_logit_softcapping``, as its
  ``eager_attention_forward``), before the mask and the softmax.

Causal rows are bottom-right aligned (query i at key position Lk - Lq + i, a chunk after a past) and a key padding
mask drops padded keys; a row that sees no key (a left-padded query) gives 0, as every kind of the library does.
Float32 math (float64 stays), the output in the query's dtype. Queries go in tiles of ``TILE`` against the keys their
windows reach: memory O(Lq (TILE + W)) per head, never Lq x Lk.

Decoding keeps the last W - 1 keys and values of each row (and their padding mask): every key a later query can
see besides its own. The state is a ``RecurrentState(None, k, v, mask, length)`` of constant size.

Pure PyTorch: never imports transformers.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .base import join_masks
from .common import check_softcap, soft_cap, to_work
from .state import RecurrentState

__all__ = ["TILE", "SlidingWindowSoftmax", "sliding_window_softmax"]

# queries per tile: with W = 4,096 (Mistral) a tile's scores are 256 x 4,351 per head (4.5 MB in float32)
TILE = 256


def sliding_window_softmax(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, window: int, causal: bool,
                           scale: float, softcap: float | None = None,
                           key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax attention of q (B, H, Lq, D) over the keys k, v (B, Hkv, Lk, D) within ``window`` (module
    docstring), H a multiple of Hkv; ``key_padding_mask`` (B, Lk) bool, False = padded. Returns (B, H, Lq, D) in
    q's dtype."""
    b, h, lq, d = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    if not causal and lq != lk:
        raise ValueError(f"bidirectional sliding-window attention needs q_len == kv_len (self-attention), got {lq} "
                         f"and {lk}")
    qw, kw, vw = to_work(q, k, v)
    q5 = qw.reshape(b, hkv, h // hkv, lq, d)
    k5, v5 = kw.unsqueeze(2), vw.unsqueeze(2)
    offset = lk - lq  # key position of query 0 (0 when bidirectional)
    reach = 0 if causal else window - 1  # keys after a query that it sees
    outs = []
    for start in range(0, lq, TILE):
        stop = min(lq, start + TILE)
        lo = max(0, offset + start - window + 1)
        hi = min(lk, offset + stop + reach)
        scores = torch.matmul(q5[..., start:stop, :], k5[..., lo:hi, :].transpose(-1, -2)) * scale
        scores = soft_cap(scores, softcap)
        dist = (torch.arange(offset + start, offset + stop, device=q.device)[:, None]
                - torch.arange(lo, hi, device=q.device)[None, :])
        allowed = (dist < window) & (dist > -window if not causal else dist >= 0)
        allowed = allowed[None, None, None]
        if key_padding_mask is not None:
            allowed = allowed & key_padding_mask[:, None, None, None, lo:hi]
        seen = allowed.any(-1, keepdim=True)
        # a row with no key reads every key (finite forward and backward) and is zeroed after
        weights = torch.softmax(scores.masked_fill(~(allowed | ~seen), float("-inf")), dim=-1)
        outs.append(torch.matmul(weights, v5[..., lo:hi, :]).masked_fill(~seen, 0.0))
    return torch.cat(outs, dim=3).reshape(b, h, lq, d).to(q.dtype)


class SlidingWindowSoftmax(nn.Module):
    """One sliding-window layer of a model, kept exact: :func:`sliding_window_softmax` at the layer's ``window`` and
    ``softcap``, with the decoding state of its last ``window - 1`` keys. No parameters.

    Called like a kind's module: ``(query, key, value, causal=..., scaling=..., key_padding_mask=..., state=...)``
    returns (B, H, Lq, D), or (output, new state) with a ``state`` (causal only; the next Lq tokens).
    """

    def __init__(self, window: int, softcap: float | None = None, layer_idx: int = 0):
        super().__init__()
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be an int >= 1 (the keys each query sees, itself included), got {window!r}")
        self.window, self.softcap, self.layer_idx = window, check_softcap(softcap), layer_idx

    def extra_repr(self) -> str:
        return f"window={self.window}, softcap={self.softcap}, exact softmax"

    def init_state(self) -> RecurrentState:
        return RecurrentState(None, None, None, None, 0)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, causal: bool,
                scaling: float | None = None, key_padding_mask: torch.Tensor | None = None,
                state: RecurrentState | None = None):
        scale = 1.0 / math.sqrt(query.shape[-1]) if scaling is None else float(scaling)
        call = dict(window=self.window, causal=causal, scale=scale, softcap=self.softcap)
        if state is None:
            return sliding_window_softmax(query, key, value, key_padding_mask=key_padding_mask, **call)
        if not causal:
            raise ValueError("a decoding state is for causal attention only")
        lk = key.shape[2]
        mask = key_padding_mask
        if state.k is not None:
            mask = join_masks(state.mask, mask, state.k.shape[2], lk, query.shape[0], query.device)
            key, value = torch.cat([state.k, key], dim=2), torch.cat([state.v, value], dim=2)
        out = sliding_window_softmax(query, key, value, key_padding_mask=mask, **call)
        start = max(0, key.shape[2] - (self.window - 1))  # the keys a later query can still see
        kept = RecurrentState(None, key[:, :, start:], value[:, :, start:], None if mask is None else mask[:, start:],
                              state.length + lk)
        return out, kept
