"""Rotary position embedding (RoPE) as the ops side needs it: re-rotating queries that already carry their positions.

RoPE rotates a vector x at position p pair by pair: F pairs of head dims (a_t, b_t), each turned by the angle p f_t
(f the F inverse frequencies),

    x'_a = x_a cos(p f) - x_b sin(p f),    x'_b = x_b cos(p f) + x_a sin(p f),

every other dim left alone. Models differ only in which dims pair: the rotate_half form (transformers' Llama, Qwen,
Gemma, GPT-NeoX) pairs t with t + F on the leading 2F dims, the interleaved form (GPT-J, Cohere, GLM) pairs 2t with
2t + 1, a partial rotary (GPT-NeoX, Phi, StableLM) leaves the dims beyond the rotated ones alone. R(a) R(b) = R(a + b)
and R(-a) = R(a)^T, so a query that arrives as R(p) q~ becomes the query at position p + delta by one more rotation
R(delta): its score with a key R(p_j) k~ is then the score at distance p + delta - p_j.
``PolyAttnConfig.sink_position='window'`` scores the attention sinks that way (``ops/window.py``). The integration
reads the pairs and frequencies of a model (``integration/rope.py``) and sets them on the module; the ops never import
transformers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["RopeRotation"]


@dataclass(frozen=True)
class RopeRotation:
    """The rotations of a model's RoPE: ``inv_freq`` (F,) its inverse frequencies, ``rotary_dim`` = 2F the head dims
    they rotate, ``pairs`` (2, F) the dims (a_t, b_t) pair t turns (integers); None: the rotate_half pairs (t, t + F)
    on the leading 2F dims (GPT-NeoX rotates a quarter of a head; the rest is never rotated).
    :meth:`interleaved` builds GPT-J's pairs (2t, 2t + 1)."""

    inv_freq: torch.Tensor
    rotary_dim: int
    pairs: torch.Tensor | None = None
    # inv_freq and pairs on each (device, dtype) the rotations ran on: a host-to-device copy per layer and call
    # otherwise
    _freqs: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        f = self.inv_freq
        if not isinstance(f, torch.Tensor) or f.dim() != 1 or not f.is_floating_point() or f.numel() == 0:
            raise ValueError(f"inv_freq must be a non-empty 1-D float tensor, got "
                             f"{tuple(f.shape) if isinstance(f, torch.Tensor) else type(f).__name__}")
        if isinstance(self.rotary_dim, bool) or not isinstance(self.rotary_dim, int) or \
                self.rotary_dim != 2 * f.numel():
            raise ValueError(f"rotary_dim must be 2 * len(inv_freq) = {2 * f.numel()} (each frequency turns one "
                             f"pair of dims), got {self.rotary_dim!r}")
        if f.is_meta or not bool(torch.isfinite(f).all()):
            raise ValueError("inv_freq must hold finite values (not on the meta device)")
        p = self.pairs
        if p is None:
            return
        if not isinstance(p, torch.Tensor) or p.is_floating_point() or p.is_complex() or \
                tuple(p.shape) != (2, f.numel()):
            raise ValueError(f"pairs must be an integer tensor of shape (2, len(inv_freq)) = (2, {f.numel()}), got "
                             f"{tuple(p.shape) if isinstance(p, torch.Tensor) else type(p).__name__}")
        flat = p.detach().cpu().reshape(-1)
        if bool((flat < 0).any()) or flat.unique().numel() != flat.numel():
            raise ValueError(f"pairs must name {flat.numel()} distinct non-negative head dims, got {p.tolist()}")
        half = f.numel()
        if torch.equal(p.cpu(), torch.arange(2 * half).reshape(2, half)):
            object.__setattr__(self, "pairs", None)  # the rotate_half layout: one name, the sliced path
        else:
            object.__setattr__(self, "pairs", p.detach().cpu().long())

    @classmethod
    def interleaved(cls, inv_freq: torch.Tensor) -> RopeRotation:
        """GPT-J's layout: frequency t turns dims (2t, 2t + 1) of the leading 2F."""
        n = inv_freq.numel()
        return cls(inv_freq, 2 * n, torch.arange(2 * n).reshape(n, 2).T)

    @property
    def head_dims_needed(self) -> int:
        """The fewest head dims the rotation applies to: its largest paired dim + 1."""
        return self.rotary_dim if self.pairs is None else int(self.pairs.max()) + 1

    def _cached(self, name: str, value: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        key = (name, device, dtype)
        if key not in self._freqs:
            # kept for later calls, which may record gradients: a tensor made under inference_mode could not be
            # saved for backward there
            with torch.inference_mode(False):
                self._freqs[key] = value.detach().to(device=device, dtype=dtype).clone()
        return self._freqs[key]

    def rotate_by(self, x: torch.Tensor, delta: int) -> torch.Tensor:
        """R(delta) x for one integer ``delta`` shared by every row (x (..., d)): ``rotate`` as x * c + x[perm] * s,
        c, s and perm (each dim's partner) made once per delta, device and dtype and kept for the last one. A
        decoding step turns every layer's query by the same delta: the sinks' re-rotation then costs four
        operations a layer instead of about twenty."""
        d = x.shape[-1]
        if d < self.head_dims_needed:
            raise ValueError(f"x has {d} dims, the rotation needs {self.head_dims_needed} (rotary_dim = "
                             f"{self.rotary_dim})")
        work = torch.float64 if x.dtype == torch.float64 else torch.float32
        key = ("by", int(delta), d, x.device, work)
        hit = self._freqs.get("by")
        if hit is None or hit[0] != key:
            hit = self._rotation_by(key, x, d, work)
        _, c, s, perm = hit
        xw = x.to(work)
        # each dim's partner: the rotate_half pairs over every dim swap the two halves, a roll (the index select of
        # the last dim it replaces cost about as much as the rest of the rotation)
        partner = xw.roll(d // 2, -1) if self.pairs is None and self.rotary_dim == d else xw.index_select(-1, perm)
        return (xw * c + partner * s).to(x.dtype)

    def matrix_by(self, delta: int, d: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """R(delta) as a (d, d) matrix M on rows: x @ M is ``rotate_by(x, delta)`` for x (..., d) of ``dtype``, up to
        float rounding (each dim's two products summed by the matmul, which may fuse them); made once per delta,
        device and dtype and kept for the last one. ``ops.decode.fused_step`` turns its sinks' queries with it in
        one operation."""
        if d < self.head_dims_needed:
            raise ValueError(f"x has {d} dims, the rotation needs {self.head_dims_needed} (rotary_dim = "
                             f"{self.rotary_dim})")
        key = ("matrix", int(delta), d, device, dtype)
        hit = self._freqs.get("matrix")
        if hit is None or hit[0] != key:
            hit = self._matrix_by(key, delta, d, device, dtype)
        return hit[1]

    @torch.inference_mode(False)  # kept for later calls, which may record gradients
    def _matrix_by(self, key: tuple, delta: int, d: int, device: torch.device, dtype: torch.dtype) -> tuple:
        # column a_t holds cos at a_t and -sin at b_t, column b_t cos at b_t and sin at a_t, so that row x times it
        # is x_a cos - x_b sin at a_t and x_b cos + x_a sin at b_t; every other dim the identity. The entries'
        # places and that identity are made once per (d, device): a decoding step of the demo's model builds its
        # matrix at its first layer in 22 dispatched aten calls (the profiler's count), 90 through ``rotate_by``'s
        # c, s and perm
        base = self._freqs.get(("matrix_base", d, device, dtype))
        if base is None:
            if self.pairs is None:
                half = self.rotary_dim // 2
                a, b = torch.arange(half, device=device), torch.arange(half, 2 * half, device=device)
            else:
                a, b = self.pairs[0].to(device), self.pairs[1].to(device)
            eye = torch.eye(d, dtype=dtype, device=device)
            eye[a, a] = 0
            eye[b, b] = 0
            places = torch.cat([a * d + a, b * d + b, b * d + a, a * d + b])
            base = self._freqs[("matrix_base", d, device, dtype)] = (eye, places)
        eye, places = base
        angle_dtype = torch.float32 if device.type == "mps" else torch.float64
        angle = int(delta) * self._cached("f", self.inv_freq, device, angle_dtype)
        cos, sin = angle.cos(), angle.sin()
        m = eye.clone()
        m.view(-1)[places] = torch.cat([cos, cos, -sin, sin]).to(dtype)
        self._freqs["matrix"] = hit = (key, m)
        return hit

    @torch.inference_mode(False)  # kept for later calls, which may record gradients
    def _rotation_by(self, key: tuple, x: torch.Tensor, d: int, work: torch.dtype) -> tuple:
        delta = key[1]
        angle_dtype = torch.float32 if x.device.type == "mps" else torch.float64
        angle = int(delta) * self.inv_freq.detach().to(device=x.device, dtype=angle_dtype)
        cos, sin = angle.cos().to(work), angle.sin().to(work)
        if self.pairs is None:
            half = self.rotary_dim // 2
            a, b = torch.arange(half, device=x.device), torch.arange(half, 2 * half, device=x.device)
        else:
            a, b = self.pairs[0].to(x.device), self.pairs[1].to(x.device)
        c = torch.ones(d, dtype=work, device=x.device)
        s = torch.zeros(d, dtype=work, device=x.device)
        perm = torch.arange(d, device=x.device)
        c[a], c[b] = cos, cos
        s[a], s[b] = -sin, sin  # x_a' = x_a cos - x_b sin, x_b' = x_b cos + x_a sin
        perm[a], perm[b] = b, a
        hit = (key, c, s, perm)
        self._freqs["by"] = hit
        return hit

    def rotate(self, x: torch.Tensor, delta_positions: torch.Tensor) -> torch.Tensor:
        """R(delta) x for x (..., n, d) (d >= :attr:`head_dims_needed`) and integer ``delta_positions`` broadcasting
        against x[..., 0]; in x's dtype. The angles delta f are formed in float64 (float32 on devices without it): at
        delta = 8,000 a float32 angle is off by ~5e-4 rad, as much as the rotation the model itself applies."""
        need = self.head_dims_needed
        if x.shape[-1] < need:
            raise ValueError(f"x has {x.shape[-1]} dims, the rotation needs {need} (rotary_dim = {self.rotary_dim})")
        angle_dtype = torch.float32 if x.device.type == "mps" else torch.float64
        angle = delta_positions.to(angle_dtype).unsqueeze(-1) * self._cached("f", self.inv_freq, x.device,
                                                                              angle_dtype)
        work = torch.float64 if x.dtype == torch.float64 else torch.float32
        cos, sin = angle.cos().to(work), angle.sin().to(work)
        if self.pairs is None:
            rd, half = self.rotary_dim, self.rotary_dim // 2
            x1, x2 = x[..., :half].to(work), x[..., half:rd].to(work)
            parts = [x1 * cos - x2 * sin, x2 * cos + x1 * sin]
            if rd < x.shape[-1]:
                parts.append(x[..., rd:].to(work))
            return torch.cat(parts, dim=-1).to(x.dtype)
        a = self._cached("a", self.pairs[0], x.device, torch.long)
        b = self._cached("b", self.pairs[1], x.device, torch.long)
        xw = x.to(work)
        xa, xb = xw.index_select(-1, a), xw.index_select(-1, b)
        shape = torch.broadcast_shapes(xw.shape, (*cos.shape[:-1], xw.shape[-1]))
        out = xw.expand(shape).clone()
        out.index_copy_(-1, a, (xa * cos - xb * sin).expand(*shape[:-1], a.numel()))
        out.index_copy_(-1, b, (xb * cos + xa * sin).expand(*shape[:-1], b.numel()))
        return out.to(x.dtype)
