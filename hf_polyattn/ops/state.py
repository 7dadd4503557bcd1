"""The recurrent state one attention layer carries between calls (chunked prefill, decoding)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields, replace

import torch

__all__ = ["RecurrentState"]


@dataclass
class RecurrentState:
    """State of one layer for chunked prefill / token-by-token decoding.

    ``kv`` = sum over folded keys of phi(k)^T [v 1] (B, Hkv, 1, F, D+1): constant size.
    ``k``/``v``/``mask`` hold the keys not folded yet: those of the current incomplete
    block when ``local_exact`` needs them exactly (< block_size keys), the last ``window``
    keys with a sliding window, none otherwise (all keys for the quadratic polynomial path,
    which has no constant-size state).
    ``length`` counts every key seen.
    ``sink_k``/``sink_v`` (B, Hkv, sinks, D) and ``sink_mask`` (B, sinks) bool: the attention sinks
    (``PolyAttnConfig.sinks``) that have left the window, the first real keys of each row, raw as the
    model made them; a slot is filled (``sink_mask`` True) in order as the row's sinks leave the window.
    None until a key first leaves the window. The state then keeps sinks + window keys: constant size.
    ``seen`` (B,) int64: the real (unpadded) keys each row has seen, where the sinks are scored at positions within
    the window (``PolyAttnConfig.sink_position``: a query's position counts them) and a key was padded; None: every
    key was real (``length`` counts them) or nothing needs them.
    ``conv_q`` (B, Hkv, G, size - 1, D) / ``conv_k`` (B, Hkv, 1, size - 1, D): with ``short_conv`` (``ops/conv.py``)
    the last size - 1 queries, and the size - 1 keys before the first key this state still holds raw (``k``; the
    last ones when it holds none), zero at padded positions and before the sequence: what the convolution of the
    next keys (and of the held ones, when they leave a window) reads. None: no convolution, or nothing seen yet.
    The kind 'delta' keeps its delta-rule state S (B, Hkv, 1, D, D) in ``kv`` (``kinds/delta.py``).
    With ``sparse_cache`` (``ops/sparse.py``) ``k``/``v``/``mask`` hold the last window + sparse_chunk - 1 keys: the
    first ``sparse_skip`` (B,) real ones of each row belong to complete blocks (kept raw for the short convolution
    only), the rest (at most window + sparse_chunk - 1) are the block waiting for selection and the window; ``kv`` is
    referenced at the last complete block's last key, and
    ``sparse_k``/``sparse_v`` (B, Hkv, sparse_cache, D) are the keys and values of the sparse cache (raw),
    ``sparse_mask`` (B, Hkv, sparse_cache) which slots hold one, ``sparse_kin`` their kernel inputs (after the short
    convolution, projection and LayerNorm; None where those are the raw keys) and ``sparse_logs`` (decay only) the
    log-decay from each cached key to ``kv``'s reference (<= 0). With ``sparse_score='attention'``
    ``sparse_q`` (B, Hkv, G, sparse_chunk, D) are the last sparse_chunk queries (the model's own, zero where
    ``sparse_q_mask`` (B, sparse_chunk) is False: no real query there) and ``sparse_score`` (B, Hkv, sparse_cache)
    float32 the score each cached key had when last kept (``ops/sparse.py``, ``attention_score``).
    """

    kv: torch.Tensor | None
    k: torch.Tensor | None
    v: torch.Tensor | None
    mask: torch.Tensor | None
    length: int = 0
    sink_k: torch.Tensor | None = None
    sink_v: torch.Tensor | None = None
    sink_mask: torch.Tensor | None = None
    seen: torch.Tensor | None = None
    conv_q: torch.Tensor | None = None
    conv_k: torch.Tensor | None = None
    sparse_k: torch.Tensor | None = None
    sparse_v: torch.Tensor | None = None
    sparse_mask: torch.Tensor | None = None
    sparse_kin: torch.Tensor | None = None
    sparse_logs: torch.Tensor | None = None
    sparse_skip: torch.Tensor | None = None
    sparse_q: torch.Tensor | None = None
    sparse_q_mask: torch.Tensor | None = None
    sparse_score: torch.Tensor | None = None

    @property
    def sinks(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(sink_k, sink_v, sink_mask), or None before any sink left the window."""
        return None if self.sink_k is None else (self.sink_k, self.sink_v, self.sink_mask)

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the state holds."""
        return [t for f in fields(self) if isinstance(t := getattr(self, f.name), torch.Tensor)]

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> RecurrentState:
        """The state with ``fn`` applied to each of its tensors (None stays None, ``length`` is kept)."""
        return replace(self, **{f.name: fn(t) for f in fields(self) if isinstance(t := getattr(self, f.name),
                                                                                   torch.Tensor)})

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def index_select(self, index: torch.Tensor) -> RecurrentState:
        """Reorder/select batch rows (beam search, num_return_sequences)."""
        return self.map(lambda t: t.index_select(0, index.to(t.device)))

    def repeat_interleave(self, repeats: int) -> RecurrentState:
        return self.map(lambda t: t.repeat_interleave(repeats, dim=0))
