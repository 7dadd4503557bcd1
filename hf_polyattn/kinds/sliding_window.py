"""kind 'sliding_window': exact attention on each query's previous ``window`` keys and nothing beyond them
(Longformer's local attention, Beltagy et al., arXiv:2004.05150). O(n w d) time, O(n w) memory per head; the
decode state is the last ``window`` keys and values, so a token costs O(w d).

With ``sinks`` s > 0 it is StreamingLLM (Xiao et al., arXiv:2309.17453): each query also attends exactly to the
first s real keys of its row, the "attention sinks" a softmax model parks its surplus attention on, under the
same softmax. No kernel part, nothing to train: the training-free way to run a softmax checkpoint at any length
with s + w keys of state. Measured on SmolLM2-135M in this project: a 128-token window alone is 2x worse in
perplexity than 4 sinks + the same window; 4 sinks + 128 gave 45.13 / 37.64 / 36.72 / 36.71 at 256 / 1k / 2k / 4k
tokens against softmax's 43.66 / 31.02 / 29.00 / 27.75 (sinks at their own positions; the rows `streaming` and
`softmax` of recipes/results/SECTION_long_context.md). Scored at
StreamingLLM's positions within the cache instead (``sink_position='window'``, the default: ops/window.py), 4 sinks +
128 broke down less beyond 4k tokens: per-1k perplexity 29.1 / 37.7 / 45.9 / 36.9 over tokens 4k-8k against 31.2 /
50.9 / 62.4 / 67.1 (SmolLM2-135M, 2026-11-24, first 8,192 held-out Tiny Shakespeare tokens). It retrieves nothing
outside the window and the sinks.
``learned_sinks`` adds learnable slots (keys and values at zero until trained).
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch.nn import functional as F

from ..ops.attention import PolyAttention
from ..ops.common import _with_normaliser, to_work
from ..ops.reference import reference_attention
from ..ops.window import slot_scores
from ..ops.window_flash import rows_flash
from ..registry import KindSpec, register_kind
from ._kernel import sink_label, window_memory


class SlidingWindowAttention(PolyAttention):
    # a diagnostic, not a setting (never saved): False sends a cached call with fewer queries than keys through the
    # padded path (all Lk rows, the last Lq kept), which tests/ops/test_sliding_window_rows.py compares the rows with
    cached_rows: bool = True

    @classmethod
    def scoreless_part(cls, config) -> bool:
        return False  # the window (and sinks) alone: every weight comes from a score

    def build_feature_map(self, dim: int, seed: int) -> None:
        return None  # the window alone: no kernel beyond it

    def choose_path(self, q_len: int, kv_len: int, causal: bool) -> str:
        return "window"

    def _recurrent_path(self) -> str:
        return "window"

    def decodes_by_step(self, path: str) -> bool:
        return False  # _next_state keeps the last `window` keys; the window path reads them

    def run_path(self, path, q5, k5, v5, mask, causal, scale, kv0, raw, tf32=None, sinks=None):
        lq, lk = q5.shape[3], k5.shape[3]
        if sinks is not None:  # the sinks are attended through their slots: the window reads them as padding
            mask = sinks.rest(mask)
        if causal and lq < lk and self.cached_rows:
            if self._fused_exact(q5) and self._layer_backend(q5.device, q5.dtype) not in ("triton", "fla"):
                return self._normalise(self._window_rows(q5, k5, v5, mask, scale, sinks)), None, None, None
            if lq <= self.config.window:  # a decode step, a few tokens: the padded path's Lk rows would be waste
                return self._normalise(self._window_rows_dense(q5, k5, v5, mask, scale, sinks)), None, None, None
        vext = _with_normaliser(v5, mask)
        if causal:
            qs = F.pad(q5, (0, 0, lk - lq, 0)) if lq < lk else q5  # bottom-right aligned rows
        elif lq != lk:
            raise ValueError(f"kind='sliding_window' with bidirectional attention needs q_len == kv_len "
                             f"(self-attention), got {lq} and {lk}")
        else:
            qs = q5
        loc, _ = self._window_local(qs, k5, vext, mask, causal, scale, tf32=tf32, sinks=sinks)
        return self._normalise(loc[..., lk - lq :, :]), None, None, None

    def _rows_band(self, lq: int, lk: int, device) -> tuple[int, torch.Tensor, torch.Tensor]:
        """(start, qpos (Lq,), band (Lq, Lk - start) bool) of a causal call's last Lq rows: ``start`` the first key
        the first query's window reaches, ``band`` the keys from there that each row's window holds."""
        w = self.config.window
        start = max(0, lk - lq - w + 1)
        qpos = torch.arange(lk - lq, lk, device=device)
        kpos = torch.arange(start, lk, device=device)
        return start, qpos, (kpos[None, :] <= qpos[:, None]) & (kpos[None, :] > qpos[:, None] - w)

    def _window_rows(self, q5, k5, v5, mask, scale, sinks):
        """loc (B, Hkv, G, Lq, d + 1) of a causal call with fewer queries than keys (a decode step, a chunk after a
        cache), inference on the CPU outside the 'triton' / 'fla' backends: only its Lq rows, over the keys their
        windows reach, through the fused kernel (``window_flash.rows_flash``). The padded path computes all Lk rows
        and keeps the last Lq: a SmolLM2 decode step at a 2,176-key window took 222.0 s there, 0.215 s here (one
        thread, load 5.2: ``python -m recipes.experiments.ruler_matched.window_rows_cost``)."""
        lq, lk = q5.shape[3], k5.shape[3]
        start, qpos, band = self._rows_band(lq, lk, q5.device)
        allowed = band[None, None] if mask is None else band[None, None] & mask[:, None, None, start:]
        allowed = allowed.expand(q5.shape[0], q5.shape[1], lq, lk - start)
        if sinks is not None:
            sinks = replace(sinks, k=sinks.k.float(), v=sinks.v.float())
        loc, _ = rows_flash(q5, k5[:, :, 0, start:], v5[:, :, 0, start:], allowed, scale, qpos, sinks,
                            None if sinks is None or sinks.q is None else sinks.q)
        return loc

    def _window_rows_dense(self, q5, k5, v5, mask, scale, sinks):
        """``_window_rows`` for every other case (half precision, a gradient, CUDA, the 'triton' / 'fla' backends,
        soft-capping, a polynomial window): the call's Lq rows' scores over the keys their windows reach as tensors,
        in float32, weighted by ``exact_weights`` as the padded path weights them. Called for Lq <= window (a decode
        step, a short continuation), where the (Lq, Lq + window - 1) scores per head are at most one tile's; the
        padded path computes Lk >= window rows for them (the same step: 222.0 s padded, 0.367 s here)."""
        lq, lk = q5.shape[3], k5.shape[3]
        start, qpos, allowed = self._rows_band(lq, lk, q5.device)  # (Lq, n)
        n = lk - start
        qs, ks, vext = to_work(q5, k5[:, :, :, start:], _with_normaliser(v5, mask)[:, :, :, start:])
        qs = qs * scale
        if mask is not None:
            allowed = allowed & mask[:, None, None, None, start:]  # (B, 1, 1, Lq, n)
        scores = torch.matmul(qs, ks.transpose(-1, -2))  # (B, Hkv, G, Lq, n)
        if sinks is not None:
            sink_k, sink_v = to_work(sinks.k, sinks.v)
            sink_q = None if sinks.q is None else to_work(sinks.q)[0] * scale
            extra = slot_scores(qs, sink_k, sink_q, sinks.learned)  # (B, Hkv, G, Lq, E)
            seen = sinks.visible(qpos)  # (B, 1, 1, Lq, E)
            lead = torch.broadcast_shapes(allowed.shape[:-1], seen.shape[:-1])
            scores = torch.cat([scores, extra], dim=-1)
            allowed = torch.cat([allowed.expand(*lead, n), seen.expand(*lead, seen.shape[-1])], dim=-1)
        weights, _ = self.exact_weights(scores, allowed, self.config.resolved_local_kernel)
        loc = torch.matmul(weights[..., :n], vext)
        if sinks is not None:
            loc = loc + torch.matmul(weights[..., n:], sink_v)
        return loc


def _validate(config) -> None:
    if not config.window:
        raise ValueError("kind='sliding_window' needs window >= 1: the number of previous keys each query "
                         "attends to (|i - j| < window bidirectional)")
    if config.local_kernel == "polynomial" and config.degree % 2:
        raise ValueError(f"degree must be even for a polynomial window (got {config.degree}): odd powers go "
                         "negative")


def _label(config) -> str:
    label = f"exact {config.resolved_local_kernel} {config.window}-token sliding window" + sink_label(config)
    if config.sinks and config.resolved_local_kernel == "softmax" and not config.learned_sinks:
        label += ": StreamingLLM, training-free"
    return label


def _memory(config) -> str:
    return (f"Generation keeps {window_memory(config)} per layer (constant size) instead of a growing key/value "
            "cache (`hf_polyattn.PolyAttnCache`, picked by `generate()`).")


SPEC = register_kind(KindSpec(
    name="sliding_window",
    module=SlidingWindowAttention,
    title="sliding-window attention (exact local attention alone, Longformer: Beltagy et al., arXiv:2004.05150; with "
          "sinks, StreamingLLM's training-free attention sinks: Xiao et al., arXiv:2309.17453)",
    reference=reference_attention,
    fields=("window", "sinks", "sink_position", "sink_span", "learned_sinks", "local_kernel", "degree",
            "denominator_offset"),
    # 256 keys when named alone (attn_implementation="sliding_window"): Longformer's one-sided window (its 512
    # spans both sides)
    defaults={"window": 256},
    validate=_validate,
    label=_label,
    memory=_memory,
    # the window alone (Longformer-style local attention): exact softmax on the previous 128 keys, nothing beyond
    bench={"sliding-window128": dict(kind="sliding_window", window=128)},
))
