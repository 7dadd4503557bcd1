"""Nystromformer (Xiong et al. 2021, arXiv:2102.03902): Nystrom approximation of the softmax matrix.

With m landmark queries Q~ and keys K~ (segment means of the queries and keys), the n x n softmax
matrix is approximated by three softmax kernels and the pseudo-inverse of the middle one:

    out = softmax(s Q K~^T) pinv(softmax(s Q~ K~^T)) softmax(s Q~ K^T) V
          (n x m)            (m x m)                 (m x n)

evaluated right to left, O(n m d + m^3) time and O(n m) memory. pinv is the iterative
Moore-Penrose method of the paper (Razavi et al. 2014): Z_0 = A^T / (||A||_1 ||A||_inf),
Z_{j+1} = Z_j (13 I - A Z_j (15 I - A Z_j (7 I - A Z_j))) / 4, ``pinv_iterations`` times (6 as in
the paper).

Choices of this implementation:

* Landmarks are padding-aware segment means: a row's real tokens, in order, are cut into m
  segments (token of rank r among n_real goes to segment floor(r m / n_real), so n need not be a
  multiple of m: segment sizes differ by at most one); a landmark is the mean over its segment's
  real tokens only. Padded keys get no weight in the third kernel. A padded row (left, right or
  with holes) therefore equals the same row unpadded. Query landmarks use the key mask when
  q_len == kv_len (self-attention), all queries otherwise. Padded query positions get an output
  like any query (as with softmax attention); the model ignores them.
* The norms of Z_0 are taken per (batch row, head) matrix (the reference code takes one maximum
  over the whole batch), so batch rows stay independent.
* A row with n_real <= m real keys gets exact softmax attention: every segment then holds at
  most one key, the landmark keys are the keys themselves, and the output is
  softmax(s Q K~^T) V~ over the non-empty segments (the first kernel times the landmark values),
  still O(n m). In particular every sequence of at most ``num_landmarks`` tokens is exact.
* The paper's optional depthwise-convolution skip connection on V is not included (it would add
  parameters a pretrained checkpoint does not have).
* Bidirectional only: landmarks summarise the whole sequence.
"""

from __future__ import annotations

import math

import torch

from ..ops.base import KVCacheAttention
from ..registry import KindSpec, Option, register_kind

__all__ = ["NystromAttention", "iterative_pinv", "nystrom_reference"]


def _options(config) -> tuple[int, int]:
    o = config.options
    return int(o["num_landmarks"]), int(o["pinv_iterations"])


def iterative_pinv(a: torch.Tensor, iterations: int) -> torch.Tensor:
    """Moore-Penrose pseudo-inverse of the (..., m, m) matrices ``a`` by the iteration of the paper."""
    eye = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)
    norm1 = a.abs().sum(-2).amax(-1)  # max column sum
    norm_inf = a.abs().sum(-1).amax(-1)  # max row sum
    den = norm1 * norm_inf
    den = torch.where(den > 0, den, torch.ones_like(den))  # an all-zero matrix (all-padding row): Z = 0
    z = a.transpose(-1, -2) / den[..., None, None]
    for _ in range(iterations):
        az = a @ z
        z = 0.25 * z @ (13 * eye - az @ (15 * eye - az @ (7 * eye - az)))
    return z


def _masked_softmax(scores: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """softmax over the last dim restricted to ``keep`` (broadcast); 0 for a row that keeps nothing.
    Dropped entries get the dtype's lowest finite value (exp underflows to exactly 0 next to any kept
    entry; no inf - inf NaN, in the forward or the backward), and a row with nothing kept is zeroed."""
    w = torch.softmax(scores.masked_fill(~keep, torch.finfo(scores.dtype).min), -1)
    return w * keep


def _segments(mask: torch.Tensor | None, b: int, n: int, m: int, dtype, device):
    """(b, m, n) averaging matrix (row j = mean over segment j's real tokens), (b, m) non-empty
    segments and (b,) real-token counts."""
    if mask is None:
        mask = torch.ones(b, n, dtype=torch.bool, device=device)
    count = mask.sum(1)  # (b,)
    rank = torch.cumsum(mask.to(torch.long), 1) - 1
    seg = torch.div(rank * m, count.clamp(min=1)[:, None], rounding_mode="floor")
    seg = torch.where(mask, seg, torch.full_like(seg, m))  # padded tokens: in no segment
    member = (seg[:, None, :] == torch.arange(m, device=device)[None, :, None]).to(dtype)  # (b, m, n)
    size = member.sum(-1)  # (b, m)
    avg = member / torch.where(size > 0, size, torch.ones_like(size))[..., None]
    return avg, size > 0, count


class NystromAttention(KVCacheAttention):
    """Nystromformer attention with segment-mean landmarks and the iterative pseudo-inverse."""

    supports_causal = False

    def __init__(self, config, num_heads, head_dim, num_kv_heads=None, layer_idx=0):
        super().__init__(config, num_heads, head_dim, num_kv_heads, layer_idx)
        self.num_landmarks, self.pinv_iterations = _options(config)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, num_landmarks={self.num_landmarks}, pinv_iterations={self.pinv_iterations}"

    def attend(self, q, k, v, *, causal, scale, mask):
        b, h, lq, d = q.shape
        hkv, lk = k.shape[1], k.shape[2]
        g, m = self.groups, self.num_landmarks
        q = q * scale
        avg_k, live_k, n_real = _segments(mask, b, lk, m, q.dtype, q.device)
        kl = avg_k[:, None] @ k  # (b, hkv, m, d) landmark keys
        vl = avg_k[:, None] @ v  # landmark values (the exact path of short rows)
        # kernel 1, (b, h, lq, m); query head h reads kv head h // g
        a1 = _masked_softmax((q.reshape(b, hkv, g * lq, d) @ kl.transpose(2, 3)).reshape(b, h, lq, m),
                             live_k[:, None, None, :])
        if lk <= m:  # every row has at most m keys: exact softmax
            return (a1.reshape(b, hkv, g * lq, m) @ vl).reshape(b, h, lq, d)
        avg_q, _, _ = _segments(mask if lq == lk else None, b, lq, m, q.dtype, q.device)
        ql = avg_q[:, None] @ q  # (b, h, m, d) landmark queries
        qlg = ql.reshape(b, hkv, g * m, d)
        a2 = _masked_softmax((qlg @ kl.transpose(2, 3)).reshape(b, h, m, m), live_k[:, None, None, :])
        keep = torch.ones(b, lk, dtype=torch.bool, device=q.device) if mask is None else mask
        a3 = _masked_softmax(qlg @ k.transpose(2, 3), keep[:, None, None, :])  # (b, hkv, g m, lk)
        a3v = (a3 @ v).reshape(b, h, m, d)
        w = iterative_pinv(a2, self.pinv_iterations) @ a3v  # (b, h, m, d)
        exact = (n_real <= m)[:, None, None, None]
        w = torch.where(exact, vl.repeat_interleave(g, 1), w)
        return a1 @ w


def nystrom_reference(module, q, k, v, *, causal, scaling=None, key_padding_mask=None):
    """Naive Nystromformer, one batch row and head at a time, on the row's real tokens: explicit
    segment lists, explicit landmark means, exact softmax when n_real <= num_landmarks."""
    if causal:
        raise ValueError("nystrom is bidirectional only")
    b, h, lq, d = q.shape
    lk = k.shape[2]
    scale = 1.0 / math.sqrt(d) if scaling is None else float(scaling)
    g, m, iters = h // k.shape[1], module.num_landmarks, module.pinv_iterations
    out = torch.zeros(b, h, lq, d, dtype=q.dtype, device=q.device)
    for i in range(b):
        keep = torch.ones(lk, dtype=torch.bool, device=q.device) if key_padding_mask is None else key_padding_mask[i]
        keys = keep.nonzero().flatten().tolist()
        queries = keys if (key_padding_mask is not None and lq == lk) else list(range(lq))
        n = len(keys)
        if n == 0:
            continue
        for hh in range(h):
            qh = q[i, hh] * scale
            kh, vh = k[i, hh // g][keys], v[i, hh // g][keys]
            if n <= m:
                out[i, hh] = torch.softmax(qh @ kh.T, -1) @ vh
                continue
            kseg = [[r for r in range(n) if (r * m) // n == j] for j in range(m)]
            nq = len(queries)
            qseg = [[queries[r] for r in range(nq) if (r * m) // nq == j] for j in range(m)]
            kl = torch.stack([kh[s].mean(0) for s in kseg])
            ql = torch.stack([qh[s].mean(0) if s else torch.zeros(d, dtype=q.dtype, device=q.device) for s in qseg])
            a1 = torch.softmax(qh @ kl.T, -1)
            a2 = torch.softmax(ql @ kl.T, -1)
            a3 = torch.softmax(ql @ kh.T, -1)
            z = a2.T / (a2.abs().sum(0).max() * a2.abs().sum(1).max())
            eye = torch.eye(m, dtype=q.dtype, device=q.device)
            for _ in range(iters):
                z = 0.25 * z @ (13 * eye - a2 @ z @ (15 * eye - a2 @ z @ (7 * eye - a2 @ z)))
            out[i, hh] = a1 @ (z @ (a3 @ vh))
    return out


def _label(config) -> str:
    m, iters = _options(config)
    return f"m={m}, pinv_iterations={iters}"


register_kind(KindSpec(
    name="nystrom",
    module=NystromAttention,
    title="Nystromformer (Xiong et al. 2021, \"Nystromformer: A Nystrom-Based Algorithm for Approximating "
          "Self-Attention\", arXiv:2102.03902)",
    reference=nystrom_reference,
    causal=False,
    bidirectional=True,
    linear_time=True,
    fields=(),
    options={
        "num_landmarks": Option(64, "m: landmark queries / keys (segment means); sequences of at most m real "
                                    "tokens get exact softmax (the paper uses 64)", minimum=1, maximum=4096),
        "pinv_iterations": Option(6, "iterations of the Moore-Penrose pseudo-inverse (the paper uses 6)",
                                  minimum=1, maximum=100),
    },
    label=_label,
    memory="Bidirectional only (encoders): it serves no generation and keeps no decoding state.",
    bench={"nystrom-64": {"kind": "nystrom", "options": {"num_landmarks": 64}}},
))
