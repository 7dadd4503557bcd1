"""The recurrent state one attention layer carries between calls (chunked prefill, decoding)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["RecurrentState"]


@dataclass
class RecurrentState:
    """State of one layer for chunked prefill / token-by-token decoding.

    ``kv`` = sum over folded keys of phi(k)^T [v 1] (B, Hkv, 1, F, D+1): constant size.
    ``k``/``v``/``mask`` hold the keys not folded yet: those of the current incomplete
    block when ``local_exact`` needs them exactly (< block_size keys), none otherwise
    (all keys for the quadratic polynomial path, which has no constant-size state).
    ``length`` counts every key seen.
    """

    kv: torch.Tensor | None
    k: torch.Tensor | None
    v: torch.Tensor | None
    mask: torch.Tensor | None
    length: int = 0

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.kv, self.k, self.v, self.mask) if t is not None)

    def index_select(self, index: torch.Tensor) -> RecurrentState:
        """Reorder/select batch rows (beam search, num_return_sequences)."""
        def sel(t):
            return None if t is None else t.index_select(0, index.to(t.device))
        return RecurrentState(sel(self.kv), sel(self.k), sel(self.v), sel(self.mask), self.length)

    def repeat_interleave(self, repeats: int) -> RecurrentState:
        def rep(t):
            return None if t is None else t.repeat_interleave(repeats, dim=0)
        return RecurrentState(rep(self.kv), rep(self.k), rep(self.v), rep(self.mask), self.length)
