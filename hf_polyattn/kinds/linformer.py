"""Linformer (Wang, Li, Khabsa, Fang, Ma 2020, arXiv:2006.04768): low-rank attention along the sequence.

Each layer learns two projections E, F of shape (k, max_length). The n keys and values of a head
are projected along the sequence to k rows, K' = E[:, :n] K and V' = F[:, :n] V, and every query
attends to the k projected keys with an ordinary softmax:

    out = softmax(scale * Q K'^T) V'            O(n k d) time, O(n k) memory

Choices of this implementation (the paper leaves them open or does not treat them):

* One E and one F per layer, shared by all heads (the paper's "headwise sharing", which it reports
  to match per-head projections); E and F stay separate (no key-value sharing).
* Retrofitting a pretrained softmax model: E and F start as segment means. Row j averages the keys
  (values) at positions [floor(j L / k), floor((j + 1) L / k)) with L = max_length, so a projected
  key / value is the mean key / value of a segment of about L / k consecutive tokens. The converted
  layer then is softmax attention over segment summaries: a query weights a segment by
  exp(q . mean key) and reads its mean value, which is close to softmax attention whenever keys and
  values vary slowly inside a segment, and exact for a segment of one token (k = max_length and
  n = max_length gives plain softmax attention). A random Gaussian init (the JL view of the paper)
  would destroy what the pretrained model attends to until it is retrained.
* A sequence of n < max_length tokens uses the first n columns of E and F (the paper fixes n).
* Padding (not treated by the paper): a row's real keys and values are moved to the front, in order,
  before projecting, so they meet the columns 0..n_real-1 of E and F (the positions they would have
  unpadded, as the ``position_ids`` of a left-padded batch do), and padded ones are zeroed: a padded
  key or value contributes nothing, and a padded row (left, right or with holes) equals the same
  row unpadded. A projected row j none of whose non-zero E or F entries meets a real key (an
  all-padding segment, or a segment past the end of a short sequence) is exactly zero: it would still
  take softmax weight exp(0) and dilute the output, so it is masked (no weight). Once training makes
  E and F dense no row is masked and this is the paper's formula.
* Bidirectional only: a projected key mixes keys from the whole sequence, so it cannot be causal.
"""

from __future__ import annotations

import math

import torch

from ..ops.base import KVCacheAttention
from ..registry import KindSpec, Option, register_kind

__all__ = ["LinformerAttention", "linformer_reference", "segment_mean_projection"]


def segment_mean_projection(k: int, length: int) -> torch.Tensor:
    """(k, length) float64: row j averages positions [floor(j L / k), floor((j + 1) L / k))."""
    bounds = [(j * length) // k for j in range(k + 1)]
    proj = torch.zeros(k, length, dtype=torch.float64)
    for j in range(k):
        proj[j, bounds[j]:bounds[j + 1]] = 1.0 / (bounds[j + 1] - bounds[j])
    return proj


def _options(config) -> tuple[int, int]:
    o = config.options
    return int(o["projection_length"]), int(o["max_length"])


def _check_length(n: int, max_length: int) -> None:
    if n > max_length:
        raise ValueError(f"linformer: the sequence has {n} keys but its projections E, F were built for "
                         f"max_length={max_length}; convert with options={{'max_length': >= {n}}} or shorten the input")


def _masked_softmax(scores: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """softmax over the last dim restricted to ``keep`` (broadcast); 0 for a row that keeps nothing.
    Dropped entries get the dtype's lowest finite value (exp underflows to exactly 0 next to any kept
    entry; no inf - inf NaN, in the forward or the backward), and a row with nothing kept is zeroed."""
    w = torch.softmax(scores.masked_fill(~keep, torch.finfo(scores.dtype).min), -1)
    return w * keep


class LinformerAttention(KVCacheAttention):
    """Linformer attention: softmax over k learned projections of the keys along the sequence."""

    supports_causal = False

    def __init__(self, config, num_heads, head_dim, num_kv_heads=None, layer_idx=0):
        super().__init__(config, num_heads, head_dim, num_kv_heads, layer_idx)
        self.projection_length, self.max_length = _options(config)
        # E (keys) and F (values), one pair per layer shared by every head
        self.key_projection = torch.nn.Parameter(torch.empty(self.projection_length, self.max_length))
        self.value_projection = torch.nn.Parameter(torch.empty(self.projection_length, self.max_length))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Segment means (deterministic, no randomness): the converted layer starts as softmax over segments."""
        init = segment_mean_projection(self.projection_length, self.max_length)
        for p in (self.key_projection, self.value_projection):
            p.copy_(init.to(device=p.device, dtype=p.dtype))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, projection_length={self.projection_length}, max_length={self.max_length}"

    def attend(self, q, k, v, *, causal, scale, mask):
        b, h, lq, d = q.shape
        hkv, lk = k.shape[1], k.shape[2]
        _check_length(lk, self.max_length)
        e = self.key_projection[:, :lk].to(q.dtype)
        f = self.value_projection[:, :lk].to(q.dtype)
        touches = ((e != 0) | (f != 0)).to(q.dtype)  # (kp, lk): which positions each projected row reads
        if mask is None:
            live = (touches.sum(-1) > 0).expand(b, -1)  # (b, kp)
        else:
            # real keys to the front, in order (stable sort), padded ones zeroed at the back
            order = torch.argsort((~mask).to(torch.int8), dim=1, stable=True)
            idx = order[:, None, :, None].expand(b, hkv, lk, d)
            drop = ~mask[:, None, :, None]
            k = torch.gather(k.masked_fill(drop, 0.0), 2, idx)
            v = torch.gather(v.masked_fill(drop, 0.0), 2, idx)
            present = torch.arange(lk, device=q.device)[None, :] < mask.sum(1, keepdim=True)  # (b, lk)
            live = (present.to(q.dtype) @ touches.transpose(0, 1)) > 0  # (b, kp)
        kp = (k.transpose(2, 3) @ e.transpose(0, 1)).transpose(2, 3)  # (b, hkv, kp, d) = E K
        vp = (v.transpose(2, 3) @ f.transpose(0, 1)).transpose(2, 3)  # (b, hkv, kp, d) = F V
        g = self.groups
        qg = q.reshape(b, hkv, g * lq, d)  # query head h reads kv head h // g
        scores = (qg * scale) @ kp.transpose(2, 3)  # (b, hkv, g lq, kp)
        w = _masked_softmax(scores, live[:, None, None, :])
        return (w @ vp).reshape(b, h, lq, d)


def linformer_reference(module, q, k, v, *, causal, scaling=None, key_padding_mask=None):
    """Naive Linformer, one batch row at a time: keep the row's real keys, project them with the first
    n_real columns of E, F, drop projected rows that read no real key, softmax, sum."""
    if causal:
        raise ValueError("linformer is bidirectional only")
    b, h, lq, d = q.shape
    scale = 1.0 / math.sqrt(d) if scaling is None else float(scaling)
    g = h // k.shape[1]
    rows = []
    for i in range(b):
        keep = (torch.ones(k.shape[2], dtype=torch.bool, device=q.device) if key_padding_mask is None
                else key_padding_mask[i])
        kb, vb = k[i][:, keep], v[i][:, keep]  # (hkv, n, d)
        n = kb.shape[1]
        e = module.key_projection[:, :n].to(q.dtype)
        f = module.value_projection[:, :n].to(q.dtype)
        valid = ((e != 0) | (f != 0)).any(1)  # (kp,)
        kp = torch.einsum("jn,hnd->hjd", e, kb).repeat_interleave(g, 0)
        vp = torch.einsum("jn,hnd->hjd", f, vb).repeat_interleave(g, 0)
        s = scale * torch.einsum("hqd,hjd->hqj", q[i], kp)
        s = s[..., valid]
        out = torch.zeros(h, lq, d, dtype=q.dtype, device=q.device)
        if s.shape[-1]:
            out = torch.softmax(s, -1) @ vp[:, valid]
        rows.append(out)
    return torch.stack(rows)


def _validate(config) -> None:
    k, length = _options(config)
    if k > length:
        raise ValueError(f"projection_length must be <= max_length ({length}) for kind='linformer', got {k}")


def _label(config) -> str:
    k, length = _options(config)
    return f"k={k}, max_length={length}"


register_kind(KindSpec(
    name="linformer",
    module=LinformerAttention,
    title="Linformer (Wang et al. 2020, \"Linformer: Self-Attention with Linear Complexity\", arXiv:2006.04768)",
    reference=linformer_reference,
    causal=False,
    bidirectional=True,
    linear_time=True,
    fields=(),
    options={
        "projection_length": Option(256, "k: keys and values are projected along the sequence to k rows "
                                         "(the paper's main setting)", minimum=1, maximum=65536),
        "max_length": Option(4096, "longest sequence the projections E, F (k x max_length, one pair per layer, "
                                   "shared by all heads) serve; a longer input raises ValueError",
                             minimum=1, maximum=1 << 20),
    },
    validate=_validate,
    label=_label,
    memory="Bidirectional only (encoders): it serves no generation and keeps no decoding state.",
    bench={"linformer-k256": {"kind": "linformer", "options": {"projection_length": 256, "max_length": 32768}}},
))
