"""kind 'sliding_window': exact attention on each query's previous ``window`` keys and nothing beyond them
(Longformer's local attention, Beltagy et al., arXiv:2004.05150). O(n w d) time, O(n w) memory per head; the
decode state is the last ``window`` keys and values, so a token costs O(w d)."""

from __future__ import annotations

from torch.nn import functional as F

from ..ops.attention import PolyAttention
from ..ops.common import _with_normaliser
from ..ops.reference import reference_attention
from ..registry import KindSpec, register_kind


class SlidingWindowAttention(PolyAttention):
    def build_feature_map(self, dim: int, seed: int) -> None:
        return None  # the window alone: no kernel beyond it

    def choose_path(self, q_len: int, kv_len: int, causal: bool) -> str:
        return "window"

    def _recurrent_path(self) -> str:
        return "window"

    def decodes_by_step(self, path: str) -> bool:
        return False  # _next_state keeps the last `window` keys; the window path reads them

    def run_path(self, path, q5, k5, v5, mask, causal, scale, kv0, raw, tf32=None):
        lq, lk = q5.shape[3], k5.shape[3]
        vext = _with_normaliser(v5, mask)
        if causal:
            qs = F.pad(q5, (0, 0, lk - lq, 0)) if lq < lk else q5  # bottom-right aligned rows
        elif lq != lk:
            raise ValueError(f"kind='sliding_window' with bidirectional attention needs q_len == kv_len "
                             f"(self-attention), got {lq} and {lk}")
        else:
            qs = q5
        loc, _ = self._window_local(qs, k5, vext, mask, causal, scale, tf32=tf32)
        return self._normalise(loc[..., lk - lq :, :]), None, None, None


def _validate(config) -> None:
    if not config.window:
        raise ValueError("kind='sliding_window' needs window >= 1: the number of previous keys each query "
                         "attends to (|i - j| < window bidirectional)")
    if config.local_kernel == "polynomial" and config.degree % 2:
        raise ValueError(f"degree must be even for a polynomial window (got {config.degree}): odd powers go "
                         "negative")


def _label(config) -> str:
    return f"exact {config.resolved_local_kernel} {config.window}-token sliding window"


def _memory(config) -> str:
    return (f"Generation keeps the last {config.window} keys and values per layer (constant size) instead of a "
            "growing key/value cache (`hf_polyattn.PolyAttnCache`, picked by `generate()`).")


SPEC = register_kind(KindSpec(
    name="sliding_window",
    module=SlidingWindowAttention,
    title="sliding-window attention (exact local attention alone, Longformer: Beltagy et al., arXiv:2004.05150)",
    reference=reference_attention,
    fields=("window", "local_kernel", "degree", "denominator_offset"),
    # 256 keys when named alone (attn_implementation="sliding_window"): Longformer's one-sided window (its 512
    # spans both sides)
    defaults={"window": 256},
    validate=_validate,
    label=_label,
    memory=_memory,
    # the window alone (Longformer-style local attention): exact softmax on the previous 128 keys, nothing beyond
    bench={"sliding-window128": dict(kind="sliding_window", window=128)},
))
