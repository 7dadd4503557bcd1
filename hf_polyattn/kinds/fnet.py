"""FNet (Lee-Thorp, Ainslie, Eckstein, Ontanon 2021, arXiv:2105.03824): Fourier token mixing.

FNet replaces self-attention by y = Re(DFT_seq(DFT_hidden(x))), with no parameters. Inside an
attention module there is no hidden state x, only per-head queries, keys and values, so this kind
mixes the values: for every head,

    out = Re(F_n V F_d)        F_n[j, t] = exp(-2 pi i j t / n) / sqrt(n)   (V: n x d, one head)

the real part of the 2-D DFT of the head's values over (sequence, head_dim), computed with the FFT
in O(n d log(n d)). Queries, keys and the softmax scale are unused (queries only give the output
shape; a grouped-query model's heads that share a kv head give the same output).

Orthonormal scaling (``norm="ortho"``): F_n and F_d are unitary, so ||out||_F <= ||V||_F for every
n. The unnormalised DFT grows like sqrt(n d) on noise and n d on a constant (the zero frequency sums
every entry), so a pretrained model's output projection would see inputs ever larger with the
context; softmax attention outputs convex combinations of values, which stay on the scale of V,
and the orthonormal DFT keeps the same energy as V at any length.

Padding (not treated by the paper, whose inputs are fixed-length): the DFT of a row runs over its
real tokens only. Real tokens are moved to the front in order, rows are grouped by their number of
real tokens, each group gets the FFT over exactly that length, and the result goes back to the real
positions; padded query positions return 0. A padded row (left, right or with holes) therefore
equals the same row unpadded.

Bidirectional only (every output mixes every token); q_len must equal kv_len.
"""

from __future__ import annotations

import math

import torch

from ..ops.base import KVCacheAttention
from ..registry import KindSpec, register_kind

__all__ = ["FNetAttention", "fnet_reference"]


def _check_lengths(lq: int, lk: int) -> None:
    if lq != lk:
        raise ValueError(f"fnet mixes a sequence with itself (Fourier transform of the values): it needs "
                         f"q_len == kv_len, got {lq} and {lk}")


def _fourier(x: torch.Tensor) -> torch.Tensor:
    """Re(orthonormal 2-D DFT) over the last two dims."""
    return torch.fft.fft2(x, dim=(-2, -1), norm="ortho").real


class FNetAttention(KVCacheAttention):
    """FNet Fourier mixing of each head's values (no parameters)."""

    supports_causal = False

    def attend(self, q, k, v, *, causal, scale, mask):
        b, h, lq, d = q.shape
        hkv, lk = v.shape[1], v.shape[2]
        _check_lengths(lq, lk)
        if mask is None:
            out = _fourier(v)
        else:
            order = torch.argsort((~mask).to(torch.int8), dim=1, stable=True)  # real tokens first, in order
            idx = order[:, None, :, None].expand(b, hkv, lk, d)
            packed = torch.gather(v.masked_fill(~mask[:, None, :, None], 0.0), 2, idx)
            counts = mask.sum(1)
            mixed = torch.zeros_like(packed)
            for n in sorted(set(counts.tolist()) - {0}):
                rows = (counts == n).nonzero().flatten()
                part = _fourier(packed.index_select(0, rows)[:, :, :n])
                part = torch.nn.functional.pad(part, (0, 0, 0, lk - n))  # zeros at the padded slots
                mixed = mixed.index_copy(0, rows, part)
            out = torch.zeros_like(mixed).scatter(2, idx, mixed)  # back to the real positions
        return out.repeat_interleave(self.groups, dim=1)


def fnet_reference(module, q, k, v, *, causal, scaling=None, key_padding_mask=None):
    """Naive FNet, one batch row at a time: explicit cos / sin DFT matrices on the row's real values,
    Re(F_n V F_d) = C_n V C_d - S_n V S_d; 0 at padded positions."""
    if causal:
        raise ValueError("fnet is bidirectional only")
    b, h, lq, d = q.shape
    _check_lengths(lq, v.shape[2])
    g = h // v.shape[1]

    def cos_sin(n):
        t = torch.arange(n, dtype=torch.float64, device=v.device)
        ang = 2 * math.pi * torch.outer(t, t) / n
        return (torch.cos(ang) / math.sqrt(n)).to(v.dtype), (torch.sin(ang) / math.sqrt(n)).to(v.dtype)

    out = torch.zeros(b, h, lq, d, dtype=v.dtype, device=v.device)
    cd, sd = cos_sin(d)
    for i in range(b):
        keep = torch.ones(lq, dtype=torch.bool, device=v.device) if key_padding_mask is None else key_padding_mask[i]
        pos = keep.nonzero().flatten()
        if not len(pos):
            continue
        cn, sn = cos_sin(len(pos))
        vi = v[i][:, pos]  # (hkv, n, d)
        mixed = cn @ vi @ cd - sn @ vi @ sd
        out[i][:, pos] = mixed.repeat_interleave(g, 0)
    return out


register_kind(KindSpec(
    name="fnet",
    module=FNetAttention,
    title="FNet Fourier token mixing (Lee-Thorp et al. 2021, \"FNet: Mixing Tokens with Fourier Transforms\", "
          "arXiv:2105.03824), per head on the values",
    reference=fnet_reference,
    causal=False,
    bidirectional=True,
    linear_time=True,  # O(n log n) by the FFT: no n x n matrix, near-linear
    fields=(),
    options={},
    memory="Bidirectional only (encoders): it serves no generation and keeps no decoding state.",
    cross_attention=False,  # defined within one sequence
    bench={"fnet": {"kind": "fnet"}},
))
