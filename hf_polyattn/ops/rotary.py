"""Rotary position embedding (RoPE) as the ops side needs it: re-rotating queries that already carry their positions.

RoPE in the rotate_half form (transformers' Llama, Mistral, Qwen2, GPT-NeoX) rotates a vector x at position p as

    R(p) x = x * cos(p f) + rotate_half(x) * sin(p f)        on the first 2F dims (the rest unrotated),

f the F inverse frequencies repeated to 2F. R(a) R(b) = R(a + b) and R(-a) = R(a)^T, so a query that arrives as
R(p) q~ becomes the query at position p + delta by one more rotation R(delta): its score with a key R(p_j) k~ is then
the score at distance p + delta - p_j. ``PolyAttnConfig.sink_position='window'`` scores the attention sinks that way
(``ops/window.py``). The integration reads the frequencies of a model (``integration/rope.py``) and sets them on the
module; the ops never import transformers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["RopeRotation"]


@dataclass(frozen=True)
class RopeRotation:
    """The rotations of a model's RoPE: ``inv_freq`` (F,) its inverse frequencies, ``rotary_dim`` = 2F the leading
    head dims they rotate (GPT-NeoX rotates a quarter of a head; the rest is never rotated)."""

    inv_freq: torch.Tensor
    rotary_dim: int
    # inv_freq on each (device, dtype) the rotations ran on: a host-to-device copy per layer and call otherwise
    _freqs: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        f = self.inv_freq
        if not isinstance(f, torch.Tensor) or f.dim() != 1 or not f.is_floating_point() or f.numel() == 0:
            raise ValueError(f"inv_freq must be a non-empty 1-D float tensor, got "
                             f"{tuple(f.shape) if isinstance(f, torch.Tensor) else type(f).__name__}")
        if isinstance(self.rotary_dim, bool) or not isinstance(self.rotary_dim, int) or \
                self.rotary_dim != 2 * f.numel():
            raise ValueError(f"rotary_dim must be 2 * len(inv_freq) = {2 * f.numel()} (rotate_half pairs dim i with "
                             f"dim i + F), got {self.rotary_dim!r}")
        if f.is_meta or not bool(torch.isfinite(f).all()):
            raise ValueError("inv_freq must hold finite values (not on the meta device)")

    def _freq(self, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        key = (device, dtype)
        if key not in self._freqs:
            self._freqs[key] = self.inv_freq.detach().to(device=device, dtype=dtype)
        return self._freqs[key]

    def rotate(self, x: torch.Tensor, delta_positions: torch.Tensor) -> torch.Tensor:
        """R(delta) x for x (..., n, d) (d >= rotary_dim) and integer ``delta_positions`` broadcasting against
        x[..., 0]; in x's dtype. The angles delta f are formed in float64 (float32 on devices without it): at
        delta = 8,000 a float32 angle is off by ~5e-4 rad, as much as the rotation the model itself applies."""
        rd = self.rotary_dim
        if x.shape[-1] < rd:
            raise ValueError(f"x has {x.shape[-1]} dims, the rotation needs rotary_dim = {rd}")
        angle_dtype = torch.float32 if x.device.type == "mps" else torch.float64
        angle = delta_positions.to(angle_dtype).unsqueeze(-1) * self._freq(x.device, angle_dtype)
        work = torch.float64 if x.dtype == torch.float64 else torch.float32
        cos, sin = angle.cos().to(work), angle.sin().to(work)
        half = rd // 2
        x1, x2 = x[..., :half].to(work), x[..., half:rd].to(work)
        parts = [x1 * cos - x2 * sin, x2 * cos + x1 * sin]
        if rd < x.shape[-1]:
            parts.append(x[..., rd:].to(work))
        return torch.cat(parts, dim=-1).to(x.dtype)
