"""A short causal depthwise convolution over the sequence, on q and k before a kernel's feature map.

LAWCAT (arXiv:2509.18467) and Gated DeltaNet (arXiv:2412.06464) put a causal depthwise conv1D of a few taps on q and
k before their linear attention: each channel of each head mixes its own last ``size`` inputs,

    y_t = sum_{j=0}^{size-1} w_j x_{t - size + 1 + j}        (w per head and channel; x_t = 0 before the sequence)

so a key can carry a trace of the tokens just before it (what "the token after 'passkey is'" needs) at O(n size d)
cost. ``PolyAttnConfig.short_conv`` = size (0: off). The weights start as the identity (w_{size-1} = 1, the rest 0):
y = x exactly, so a converted model computes what it computed without the option until training moves them.

Causal and padding-safe: padded positions (key padding mask False) are zeroed before the convolution, so a
left-padded row convolves its first real token with zeros, as the unpadded row does. Decoding keeps the last
``size - 1`` inputs before the first key it still holds raw (``RecurrentState.conv_q`` / ``conv_k``): constant
memory, and the chunk path and the token-by-token path convolve the same inputs.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["ShortConv", "causal_conv", "reference_causal_conv"]


def causal_conv(x: torch.Tensor, weight: torch.Tensor, tail: torch.Tensor | None = None):
    """(y, inputs) for x (..., L, d) and ``weight`` (..., d, size) broadcasting over x's leading dims: y (..., L, d)
    as in the module doc, ``inputs`` = [tail, x] (..., size - 1 + L, d), the rows y read. ``tail`` (..., size - 1, d):
    the inputs before x (None: zeros, the start of a sequence). Computed in the dtype of x (callers pass float32 or
    float64); a sum of ``size`` shifted products, nothing L x L or L x size x d."""
    size = weight.shape[-1]
    n = x.shape[-2]
    if tail is None:
        inputs = F.pad(x, (0, 0, size - 1, 0))
    else:
        inputs = torch.cat([tail.to(x.dtype).expand(*x.shape[:-2], size - 1, x.shape[-1]), x], dim=-2)
    w = weight.to(x.dtype)
    y = inputs[..., size - 1 :, :] * w[..., size - 1].unsqueeze(-2)
    for j in range(size - 1):
        y = y + inputs[..., j : j + n, :] * w[..., j].unsqueeze(-2)
    return y, inputs


def reference_causal_conv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The definition, one output row at a time: y_t = sum_j w_j x_{t - size + 1 + j}, zero before the sequence."""
    size, n = weight.shape[-1], x.shape[-2]
    rows = []
    for t in range(n):
        acc = torch.zeros_like(x[..., 0, :])
        for j in range(size):
            s = t - size + 1 + j
            if s >= 0:
                acc = acc + weight[..., j].to(x.dtype) * x[..., s, :]
        rows.append(acc)
    return torch.stack(rows, dim=-2)


class ShortConv(nn.Module):
    """The causal depthwise convolution of one side (queries or keys): weight (heads, groups, dim, size), one filter
    per head and channel, initialised to the identity (module doc)."""

    def __init__(self, heads: int, groups: int, dim: int, size: int):
        super().__init__()
        self.size = size
        self.weight = nn.Parameter(torch.zeros(heads, groups, dim, size))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        self.weight.zero_()
        self.weight[..., -1] = 1.0

    def forward(self, x: torch.Tensor, tail: torch.Tensor | None = None):
        """(y, inputs) of ``causal_conv`` for x (B, heads, groups, L, dim)."""
        return causal_conv(x, self.weight, tail)

    def extra_repr(self) -> str:
        return f"size={self.size}"
