"""Kernelised attention: one module per attention layer, any kind of ``PolyAttnConfig``.

Layouts: queries (B, H, Lq, D), keys/values (B, Hkv, Lk, D) with H a multiple of Hkv
(grouped-query attention). Internally the query heads are viewed as (B, Hkv, G, Lq, D)
and keys/values as (B, Hkv, 1, Lk, D), so a kv head's features and prefix states are
computed once and broadcast to its G query heads (never repeated in memory).

Causal rows are bottom-right aligned: with Lq < Lk, query i sits at position Lk - Lq + i
(a chunk of new tokens after a past). Everything is computed in float32 (float64 stays
float64) and returned in the input dtype: degree-4..8 polynomials of O(10) scores reach
1e4..1e8 per weight and sums over 32k keys ~1e12, far past float16's 65504.

Output = (num_local + s * num_far) / (den_local + s * den_far + offset), where the "far"
part is the linear-time kernel product phi(Q) phi(K)^T [V 1] (block algorithm of
``causal.lt_multiply``), the "local" part the exact kernel on the diagonal blocks when
``local_exact`` is set, and s = exp(-m) the softmax row stabiliser (1 otherwise).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from ..config import PolyAttnConfig
from .backend import lt_product
from .causal import lt_multiply_cumsum
from .feature_maps import (
    FEATURE_MAPS,
    FeatureMap,
    PolynomialFeatureMap,
)
from .sketches import project, symmetric_square
from .window import shifted_lt, window_scores, window_tiles

__all__ = ["HeadLayerNorm", "HeadProjection", "PolyAttention", "RecurrentState", "layer_seed"]

_QUADRATIC_CHUNK = 1024  # query rows per rematerialised chunk of the quadratic path
# Diagonal blocks per rematerialised group of the exact local part. CPU: 8 (measured, see
# _local_exact). Accelerators: 64, so 32k tokens at b=256 take 2 groups (~40 launches each way)
# instead of 16; a group's transient scores are 64 b^2 floats per head (16 MiB at b=256).
# Chosen to cut launches, not yet measured on a GPU (recipes/results/PENDING.md).
_LOCAL_GROUP = {"cpu": 8}
_LOCAL_GROUP_ACCELERATOR = 64
_TENSOR_CHUNK_ELEMENTS = 2**20  # feature elements per row of heads in one chunk of the exact tensor path


def layer_seed(seed: int, layer_idx: int) -> int:
    """Independent sketches per layer (the paper samples one per head and layer)."""
    return (seed * 1_000_003 + layer_idx * 7919) % (2**62)


class HeadLayerNorm(nn.Module):
    """LayerNorm over the head dimension with its own affine parameters per head."""

    def __init__(self, heads: int, groups: int, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(heads, groups, 1, dim))
        self.bias = nn.Parameter(torch.zeros(heads, groups, 1, dim))

    @torch.no_grad()
    def reset_parameters(self) -> None:
        self.weight.fill_(1.0)
        self.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.layer_norm(x, x.shape[-1:], eps=self.eps)
        return y * self.weight.to(y.dtype) + self.bias.to(y.dtype)


class HeadProjection(nn.Module):
    """A learnable per-kv-head map x -> x W (d -> d') of q and k before the kernel (Hedgehog /
    LoLCATs' trainable feature projection). W starts as the identity padded with zeros, so
    (qW).(kW) = q.k: an untrained projection leaves dot-product kernels as they were (for
    d' = d every kernel; a coordinatewise map such as elu+1 also sees the d' - d zeros)."""

    def __init__(self, heads: int, dim: int, out_dim: int):
        super().__init__()
        self.dim, self.out_dim = dim, out_dim
        self.weight = nn.Parameter(torch.zeros(heads, 1, dim, out_dim))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        eye = torch.eye(self.dim, self.out_dim, dtype=torch.float64, device="cpu")
        self.weight.copy_(eye.expand(self.weight.shape).to(self.weight.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return project(x, self.weight)


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


def _int_power(x: torch.Tensor, p: int) -> torch.Tensor:
    """x**p by repeated squaring: 2 multiplies for p=4 instead of aten::pow, which took 180 ms
    (+130 ms backward) on the 8k x 256 x 4 local blocks against ~25 ms for the multiplies."""
    result = None
    base = x
    while p:
        if p & 1:
            result = base if result is None else result * base
        p >>= 1
        if p:
            base = base * base
    return torch.ones_like(x) if result is None else result


_WARNED_LEFT_PADDING = False


def _warn_if_misaligned_left_padding(mask: torch.Tensor, block: int) -> None:
    """local_exact blocks sit at absolute positions: say so once when left padding shifts them."""
    global _WARNED_LEFT_PADDING
    if _WARNED_LEFT_PADDING:
        return
    pads = (~mask).cumprod(dim=1).sum(dim=1)  # leading padded keys per row
    if bool(((pads % block) != 0).any()):
        _WARNED_LEFT_PADDING = True
        warnings.warn(
            "local_exact with left padding that is not a multiple of block_size: the exact diagonal blocks are "
            "aligned to absolute positions, so a left-padded row is computed with shifted block boundaries and "
            "differs from the same row unpadded. Pad on the right (or by a multiple of block_size) for "
            "padding-invariant outputs.",
            stacklevel=3,
        )


def _with_normaliser(v5: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """[v, 1]: values with the normaliser's column of ones, both zeroed at padded keys (mask False)
    so that they add nothing anywhere."""
    vext = torch.cat([v5, torch.ones_like(v5[..., :1])], dim=-1)
    if mask is not None:
        vext = vext * mask[:, None, None, :, None].to(vext.dtype)
    return vext


def _safe_divide(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """num / den, 0 where den == 0 (a query that sees no key, or relu's all-zero rows)."""
    ok = den > 0
    return torch.where(ok, num / torch.where(ok, den, torch.ones_like(den)), torch.zeros_like(num))


class PolyAttention(nn.Module):
    """One attention layer's polynomial / polysketch / linear / performer attention.

    Holds the layer's state (sketches, feature parameters, q/k LayerNorms, polynomial
    coefficients), all initialised deterministically from ``config.seed`` and
    ``layer_idx``. ``forward`` returns (B, H, Lq, D) in the dtype of ``query``.
    """

    def __init__(self, config: PolyAttnConfig, num_heads: int, head_dim: int, num_kv_heads: int | None = None,
                 layer_idx: int = 0):
        super().__init__()
        if not isinstance(config, PolyAttnConfig):
            raise TypeError(f"config must be a PolyAttnConfig, got {type(config).__name__}")
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        for name, val in (("num_heads", num_heads), ("head_dim", head_dim), ("num_kv_heads", num_kv_heads)):
            if isinstance(val, bool) or not isinstance(val, int) or val < 1:
                raise ValueError(f"{name} must be an int >= 1, got {val!r}")
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        self.config = config
        self.num_heads, self.head_dim, self.num_kv_heads = num_heads, head_dim, num_kv_heads
        self.groups = num_heads // num_kv_heads
        self.layer_idx = layer_idx
        seed = layer_seed(config.seed, layer_idx)
        # the dimension the kernel sees: head_dim, or feature_proj after the learnable projection
        kdim = config.feature_proj or head_dim
        if config.feature_proj:
            if config.feature_proj < head_dim:
                raise ValueError(f"feature_proj must be 0 (off) or >= head_dim ({head_dim}) so that the projection "
                                 f"can start as the identity, got {config.feature_proj}")
            self.feature_proj = HeadProjection(num_kv_heads, head_dim, config.feature_proj)
        self.kernel_dim = kdim
        if config.qk_norm:
            self.q_norm = HeadLayerNorm(num_kv_heads, self.groups, kdim)
            self.k_norm = HeadLayerNorm(num_kv_heads, 1, kdim)
        if config.poly_coefficients is not None:
            coeffs = torch.tensor(config.poly_coefficients, dtype=torch.float32)
            if config.learn_coefficients:
                self.coefficients = nn.Parameter(coeffs)
            else:
                self.register_buffer("coefficients", coeffs)
        if config.window_mix:
            # LoLCATs' per-head factor on the far part (init 1 = today's plain sum)
            self.window_mix = nn.Parameter(torch.ones(num_kv_heads, self.groups, 1, 1))
        kind = config.kind
        fm: FeatureMap | None
        if kind == "sliding_window":
            fm = None  # the window alone: no kernel beyond it
        elif kind == "polynomial":
            fm = PolynomialFeatureMap(
                kdim, config.degree, config.alpha, config.beta,
                coefficients=(lambda: self.coefficients) if config.poly_coefficients is not None else None,
                num_coefficients=len(config.poly_coefficients or ()),
            )
        elif kind == "polysketch":
            fm = FEATURE_MAPS["polysketch"](num_kv_heads, kdim, config.degree, config.sketch_size,
                                            config.sketch, seed)
        elif kind == "performer":
            fm = FEATURE_MAPS["performer"](num_kv_heads, kdim, config.num_features, seed)
        elif getattr(FEATURE_MAPS[config.feature_map], "per_head", False):
            fm = FEATURE_MAPS[config.feature_map](num_kv_heads, kdim)
        else:
            fm = FEATURE_MAPS[config.feature_map](kdim)
        self.feature_map = fm

    # ------------------------------------------------------------------ state
    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Re-initialise every parameter and buffer deterministically from the seed."""
        for m in self.modules():
            if m is not self and hasattr(m, "reset_parameters"):
                m.reset_parameters()
        if self.config.poly_coefficients is not None:
            self.coefficients.copy_(torch.tensor(self.config.poly_coefficients, dtype=torch.float64, device="cpu"))
        if self.config.window_mix:
            self.window_mix.fill_(1.0)

    def extra_repr(self) -> str:
        return (f"kind={self.config.kind}, heads={self.num_heads}, kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}, features={self.num_features}")

    @property
    def num_features(self) -> int:
        return 0 if self.feature_map is None else self.feature_map.num_features

    def exact_path(self, q_len: int, kv_len: int, causal: bool) -> str:
        """Which exact path the polynomial kind takes ('tensor' or 'quadratic').

        Rule for 'auto': the tensor path (phi = symmetric tensor power, C(d+p-1, p)
        features F) when F <= max_tensor_features and its flop count
        4 (Lq + Lk) F (d + 1) (+ 2 Lq b F for the causal diagonal blocks) is below the
        quadratic one, 4 Lq Lk d (halved when causal). E.g. d=16, p=2: F=136, tensor from
        about Lk=350 on; d=64, p=4: F=766,480, always quadratic.
        """
        cfg = self.config
        if cfg.kind != "polynomial":
            raise ValueError("exact_path is defined for kind='polynomial' only")
        if cfg.exact_path != "auto":
            return cfg.exact_path
        feats = self.num_features
        if feats > cfg.max_tensor_features:
            return "quadratic"
        d = self.kernel_dim
        quad = 4 * q_len * kv_len * d * (0.5 if causal else 1.0)
        tensor = 4 * (q_len + kv_len) * feats * (d + 1) + (2 * q_len * cfg.block_size * feats if causal else 0)
        return "tensor" if tensor < quad else "quadratic"

    def _recurrent_path(self) -> str:
        """The path of a recurrent state (fixed for the whole generation)."""
        if self.config.kind == "sliding_window":
            return "window"
        if self.config.kind != "polynomial":
            return "linear"
        if self.config.exact_path == "quadratic" or (
            self.config.exact_path == "auto" and self.num_features > self.config.max_tensor_features
        ):
            return "quadratic"
        return "tensor"

    def init_state(self) -> RecurrentState:
        return RecurrentState(None, None, None, None, 0)

    # ---------------------------------------------------------------- forward
    def _check_inputs(self, q, k, v, key_padding_mask, causal):
        for name, t in (("query", q), ("key", k), ("value", v)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dim() != 4:
                raise ValueError(f"{name} must be 4-D (batch, heads, length, head_dim), got shape {tuple(t.shape)}")
            if not t.is_floating_point():
                raise TypeError(f"{name} must be floating point (float32/bfloat16/float16/float64), got {t.dtype}")
        if k.dtype != q.dtype or v.dtype != q.dtype:
            raise TypeError(f"query, key and value need one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
        if k.device != q.device or v.device != q.device:
            raise ValueError(f"query, key and value need one device, got {q.device}, {k.device}, {v.device}")
        b, h, lq, d = q.shape
        if h != self.num_heads or d != self.head_dim:
            raise ValueError(f"query must have {self.num_heads} heads of size {self.head_dim}, "
                             f"got shape {tuple(q.shape)}")
        if k.shape != v.shape or k.shape[0] != b or k.shape[1] != self.num_kv_heads or k.shape[3] != d:
            raise ValueError(f"key and value must be ({b}, {self.num_kv_heads}, Lk, {d}), got {tuple(k.shape)} "
                             f"and {tuple(v.shape)}")
        if key_padding_mask is not None:
            if not isinstance(key_padding_mask, torch.Tensor) or key_padding_mask.dtype != torch.bool:
                raise TypeError("key_padding_mask must be a bool tensor (batch, kv_len), True = keep")
            if key_padding_mask.shape != (b, k.shape[2]):
                raise ValueError(f"key_padding_mask must have shape ({b}, {k.shape[2]}), got "
                                 f"{tuple(key_padding_mask.shape)}")
            if key_padding_mask.device != q.device:
                raise ValueError(f"key_padding_mask is on {key_padding_mask.device}, query on {q.device}")

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, causal: bool,
                scaling: float | None = None, key_padding_mask: torch.Tensor | None = None,
                state: RecurrentState | None = None):
        """Attention output (B, H, Lq, D); with ``state`` returns (output, new_state).

        ``scaling`` multiplies q.k before the kernel (default 1/sqrt(D), as softmax).
        ``key_padding_mask`` (B, Lk) bool: False keys contribute nothing.
        ``state``: causal only; ``query``, ``key``, ``value`` are the next Lq tokens.
        """
        self._check_inputs(query, key, value, key_padding_mask, causal)
        lq, lk = query.shape[2], key.shape[2]
        if causal and lq > lk:
            raise ValueError(f"causal attention needs q_len <= kv_len, got {lq} > {lk}")
        if state is not None:
            if not causal:
                raise ValueError("a recurrent state is for causal attention only")
            if lq != lk:
                raise ValueError(f"with a state, query and key must be the same new tokens, got {lq} and {lk}")
        scale = 1.0 / math.sqrt(self.head_dim) if scaling is None else float(scaling)
        out_dtype = query.dtype
        work = torch.float64 if query.dtype == torch.float64 else torch.float32
        bsz = query.shape[0]
        q5 = query.to(work).reshape(bsz, self.num_kv_heads, self.groups, lq, self.head_dim)
        k5 = key.to(work).unsqueeze(2)
        v5 = value.to(work).unsqueeze(2)
        mask = key_padding_mask
        kv0 = None
        if state is not None:
            if state.k is not None:
                k5 = torch.cat([state.k.to(work).unsqueeze(2), k5], dim=3)
                v5 = torch.cat([state.v.to(work).unsqueeze(2), v5], dim=3)
                if state.mask is not None or mask is not None:
                    old = state.mask if state.mask is not None else torch.ones(
                        bsz, state.k.shape[2], dtype=torch.bool, device=query.device)
                    new = mask if mask is not None else torch.ones(bsz, lk, dtype=torch.bool, device=query.device)
                    mask = torch.cat([old, new], dim=1)
            kv0 = state.kv
            path = self._recurrent_path()
        elif self.config.kind == "polynomial":
            path = self.exact_path(lq, lk, causal)
        elif self.config.kind == "sliding_window":
            path = "window"
        else:
            path = "linear"

        raw = (q5, k5)  # the model's own q, k: a sliding window's exact part scores with them
        q5, k5 = self.kernel_inputs(q5, k5)
        if path == "tensor" and work == torch.float32:
            # Exact tensor-power features cancel: (q.k)^p is a sum of C(d+p-1, p) products of
            # mixed sign, each up to (|q||k|)^p. In float32 that lost 1.2e-4 against a float64
            # reference where the quadratic path loses 6.5e-7, enough to change greedy tokens
            # between cache (this path) and no cache (quadratic). F <= max_tensor_features
            # bounds the float64 cost; the state is float64 too.
            q5, k5, v5 = q5.double(), k5.double(), v5.double()
        if state is not None and lq == 1 and path not in ("quadratic", "window"):
            out, new_state = self._decode_step(q5, k5, v5, mask, scale, state, key, value, raw)
            return out.reshape(bsz, self.num_heads, 1, self.head_dim).to(out_dtype), new_state
        fk = vext = kv_end = None
        if path == "quadratic":
            out = self._quadratic(q5, k5, v5, mask, causal, scale)
        elif path == "window":
            out = self._window_only(q5, k5, v5, mask, causal, scale)
        elif path == "tensor":
            out, kv_end = self._tensor(q5, k5, v5, mask, causal, scale, kv0)
        else:
            # half-precision models: the Triton kernels' dots take tf32 operands (fp32 accumulation)
            tf32 = True if out_dtype in (torch.bfloat16, torch.float16) else None
            out, fk, vext = self._linear(q5, k5, v5, mask, causal, scale, kv0, raw, tf32)
        out = out.reshape(bsz, self.num_heads, lq, self.head_dim).to(out_dtype)
        if state is None:
            return out
        if path == "tensor":
            return out, RecurrentState(kv_end, None, None, None, state.length + lk)
        return out, self._next_state(state, key, value, key_padding_mask, k5, v5, mask, fk, vext, path)

    def kernel_inputs(self, q5: torch.Tensor, k5: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q, k as the kernel sees them: the learnable projection (feature_proj), then the q/k
        LayerNorm (qk_norm): q' = LayerNorm(q W), the calibration probe's map in PEERS.md."""
        if self.config.feature_proj:
            q5, k5 = self.feature_proj(q5), self.feature_proj(k5)
        if self.config.qk_norm:
            q5, k5 = self.q_norm(q5), self.k_norm(k5)
        return q5, k5

    def _decode_step(self, q5, k5, v5, mask, scale, state, key, value, raw):
        """One new token with a recurrent state: O(F d) work, no block machinery.

        q5 is the new query, k5/v5 the unfolded keys (the current block's buffer when
        local_exact, else just the new key) followed by the new one. The generic chunk path
        gives the same numbers (tested) but costs ~5 ms per layer for a single token in
        small-op overheads; this path is a handful of matmuls.
        """
        cfg = self.config
        vext = _with_normaliser(v5, mask)
        q_in, k_in = self._feature_inputs(q5, scale), self._feature_inputs(k5, scale)
        q_log_scale = None
        if cfg.kind == "performer":
            fq, q_log_scale = self.feature_map.forward_with_log_scale(q_in, True)
        else:
            fq = self.feature_map(q_in, True)
        local = cfg.resolved_local_kernel
        total = state.length + 1
        if cfg.window:
            return self._decode_window(raw[0], raw[1], k_in, vext, fq, q_log_scale, mask, scale, state, key, value,
                                       total)
        if local is None:
            kv = torch.matmul(self.feature_map(k_in, False).transpose(-1, -2), vext)
            kv = kv if state.kv is None else state.kv + kv
            num = torch.matmul(fq, kv)
            return self._normalise(num), RecurrentState(kv, None, None, None, total)
        # exact kernel over the current block (all unfolded keys precede or equal the query)
        x = torch.matmul(q5 * scale, k5.transpose(-1, -2))  # (B, Hkv, G, 1, L)
        allowed = None if mask is None else mask[:, None, None, None, :]
        far = torch.matmul(fq, state.kv) if state.kv is not None else None
        if local == "softmax":
            if allowed is not None:
                x = x.masked_fill(~allowed, float("-inf"))
            m = x.amax(dim=-1, keepdim=True).clamp_min(0.0)
            num = torch.matmul(torch.exp(x - m), vext)
            if far is not None:
                log_far = -m if q_log_scale is None else q_log_scale - m
                num = num + torch.exp(log_far) * far
        else:
            w = self._exact_kernel(x, "polynomial")
            if allowed is not None:
                w = w.masked_fill(~allowed, 0.0)
            num = torch.matmul(w, vext)
            if far is not None:
                num = num + (far if q_log_scale is None else torch.exp(q_log_scale) * far)
        if total % cfg.block_size == 0:  # the block is complete: fold it into the state
            kv = torch.matmul(self.feature_map(k_in, False).transpose(-1, -2), vext)
            kv = kv if state.kv is None else state.kv + kv
            return self._normalise(num), RecurrentState(kv, None, None, None, total)
        raw_k = key if state.k is None else torch.cat([state.k, key], dim=2)
        raw_v = value if state.v is None else torch.cat([state.v, value], dim=2)
        return self._normalise(num), RecurrentState(state.kv, raw_k, raw_v, mask, total)

    def _decode_window(self, q5, k5, k_in, vext, fq, q_log_scale, mask, scale, state, key, value, total):
        """One token with a sliding window: fold the key that leaves the window, exact on the rest.

        The state keeps the last ``window`` raw keys/values (constant size) and the kernel
        state of every key before them.
        """
        w = self.config.window
        fold = max(0, k5.shape[3] - w)  # 0 or 1: the key now w positions behind the query
        kv = state.kv
        if fold:
            add = torch.matmul(self.feature_map(k_in[..., :fold, :], False).transpose(-1, -2), vext[..., :fold, :])
            kv = add if kv is None else kv + add
        kw, vw = k5[..., fold:, :], vext[..., fold:, :]
        x = torch.matmul(q5 * scale, kw.transpose(-1, -2))  # (B, Hkv, G, 1, <= w)
        allowed = None if mask is None else mask[:, None, None, None, fold:]
        log_far = None
        if self.config.resolved_local_kernel == "softmax":
            if allowed is not None:
                x = x.masked_fill(~allowed, float("-inf"))
            m = x.amax(dim=-1, keepdim=True).clamp_min(0.0)
            num = torch.matmul(torch.exp(x - m), vw)
            log_far = -m
        else:
            wts = self._exact_kernel(x, "polynomial")
            if allowed is not None:
                wts = wts.masked_fill(~allowed, 0.0)
            num = torch.matmul(wts, vw)
        if kv is not None:
            far = torch.matmul(fq, kv)
            if q_log_scale is not None:
                log_far = q_log_scale if log_far is None else log_far + q_log_scale
            if log_far is not None:
                far = torch.exp(log_far) * far
            if self.config.window_mix:
                far = self.window_mix.to(far.dtype) * far
            num = num + far
        raw_k = key if state.k is None else torch.cat([state.k, key], dim=2)
        raw_v = value if state.v is None else torch.cat([state.v, value], dim=2)
        new_mask = None if mask is None else mask[:, fold:]
        return self._normalise(num), RecurrentState(kv, raw_k[:, :, fold:], raw_v[:, :, fold:], new_mask, total)

    # ---------------------------------------------------------------- kernels
    def _feature_inputs(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        # linear maps act on raw (or LayerNorm-ed) q/k as in Katharopoulos et al.; the
        # polynomial-type and FAVOR+ maps target (s q.k)^p / exp(s q.k): sqrt(s) per side.
        return x if self.config.kind == "linear" else x * math.sqrt(scale)

    @property
    def _exact_power(self) -> int:
        """p of the exact weights base^p: 2 for squared coefficient polynomials, else the degree."""
        return 2 if self.config.poly_coefficients is not None else self.config.degree

    def _exact_base(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        """(base, p) with weights base^p for scores x = s q.k: this config's polynomial."""
        cfg = self.config
        if cfg.poly_coefficients is not None:
            a = self.coefficients.to(x.dtype)
            acc = torch.zeros_like(x) + a[-1]
            for i in range(a.shape[0] - 2, -1, -1):
                acc = acc * x + a[i]
            return acc, self._exact_power
        if cfg.kind == "polynomial" and (cfg.alpha != 0.0 or cfg.beta != 1.0):
            x = (x + cfg.alpha) / cfg.beta
        return x, self._exact_power

    def _exact_kernel(self, x: torch.Tensor, kernel: str) -> torch.Tensor:
        """Weights from scores x = s q.k for 'polynomial' (this config's polynomial)."""
        if kernel != "polynomial":
            raise AssertionError(kernel)
        return _int_power(*self._exact_base(x))

    def _quadratic(self, q5, k5, v5, mask, causal, scale):
        """Exact polynomial attention in O(Lq Lk) time, query chunks rematerialised in backward.

        Each row's bases are divided by their largest allowed magnitude m before the power
        (weights (b/m)^p <= 1; the factor m^p cancels in the ratio, the denominator offset
        becomes offset / m^p). Without it, degree 16 at q, k entries of 0.01 underflowed every
        weight to 0 in float32 and the safe division returned all-zero rows (40 of 40 in a
        test), a silent wrong answer; degree 8 at 0.003 lost 5% to subnormals.
        """
        lq, lk = q5.shape[3], k5.shape[3]
        vext = _with_normaliser(v5, mask)

        def chunk(qc, start):
            base, p = self._exact_base(torch.matmul(qc * scale, k5.transpose(-1, -2)))
            allowed = torch.ones(base.shape[-2:], dtype=torch.bool, device=qc.device)
            if causal:
                rows = torch.arange(start, start + qc.shape[3], device=qc.device) + (lk - lq)
                allowed = torch.arange(lk, device=qc.device)[None, :] <= rows[:, None]
            if mask is not None:
                allowed = allowed & mask[:, None, None, None, :]
            base = base.masked_fill(~allowed, 0.0)
            # the ratio does not depend on m: detached, as softmax's row max
            m = base.detach().abs().amax(dim=-1, keepdim=True)
            m = torch.where(m > 0, m, torch.ones_like(m))  # a row with no key (or only zero bases)
            return torch.matmul(_int_power(base / m, p), vext), m

        outs, scales = [], []
        for s in range(0, lq, _QUADRATIC_CHUNK):
            qc = q5[..., s : s + _QUADRATIC_CHUNK, :]
            if torch.is_grad_enabled() and (qc.requires_grad or k5.requires_grad or vext.requires_grad
                                            or any(t.requires_grad for t in self.parameters())):
                num, m = checkpoint(chunk, qc, s, use_reentrant=False)
            else:
                num, m = chunk(qc, s)
            outs.append(num)
            scales.append(m)
        num = torch.cat(outs, dim=3)
        offset = self.config.denominator_offset
        if not offset:
            return self._normalise(num)
        m = torch.cat(scales, dim=3)
        # offset / m^p in log space; inf where m^p underflows: then the weights are negligible
        # against the offset and the output is 0, the true value to float precision
        return self._normalise(num, offset * torch.exp(-self._exact_power * torch.log(m)))

    def tensor_chunk(self) -> int:
        """Keys (and queries) per chunk of the exact tensor path: ``_TENSOR_CHUNK_ELEMENTS``
        features per row of heads at most, a multiple of ``block_size``."""
        block = self.config.block_size
        rows = max(1, _TENSOR_CHUNK_ELEMENTS // self.num_features)
        return max(block, rows // block * block)

    def _tensor(self, q5, k5, v5, mask, causal, scale, kv0):
        """Exact polynomial attention in linear time with tensor-power features, chunk by chunk.

        Never more than ``tensor_chunk()`` rows of features at once: forward peak
        ~ (B H chunk F + B Hkv F (D+1)) elements besides inputs and outputs, and each chunk
        is rematerialised in backward, which stores only the per-chunk (F x (D+1)) prefix
        states. All at once the n x F features peaked at 33.8 GB for d=64, p=2 (F=2,080),
        n=32k, H=16 on an H100; at chunk 768 they are 0.8 GB in float64.
        Returns the normalised output and the state after the last key (for the cache).
        """
        lq, lk = q5.shape[3], k5.shape[3]
        vext = _with_normaliser(v5, mask)
        fm, block = self.feature_map, self.config.block_size
        root = math.sqrt(scale)
        size = self.tensor_chunk()
        grad = torch.is_grad_enabled() and (
            any(t.requires_grad for t in (q5, k5, vext)) or any(p.requires_grad for p in self.parameters()))

        def run(fn, *args):
            return checkpoint(fn, *args, use_reentrant=False) if grad else fn(*args)

        def keys(kc, vc):
            return torch.matmul(fm(kc * root, False).transpose(-1, -2), vc)

        if not causal:
            kv = kv0
            for s in range(0, lk, size):
                add = run(keys, k5[..., s : s + size, :], vext[..., s : s + size, :])
                kv = add if kv is None else kv + add

            def read(qc, kv):
                return torch.matmul(fm(qc * root, True), kv)

            num = torch.cat([run(read, q5[..., s : s + size, :], kv) for s in range(0, lq, size)], dim=3)
            return self._normalise(num), kv

        qs = F.pad(q5, (0, 0, lk - lq, 0)) if lq < lk else q5  # bottom-right aligned rows
        backend = self.config.backend

        def causal_chunk(qc, kc, vc, kv):
            fq, fk = fm(qc * root, True), fm(kc * root, False)
            num = lt_product(fq, fk, vc, block, True, False, backend)
            if kv is not None:
                num = num + torch.matmul(fq, kv)
            add = torch.matmul(fk.transpose(-1, -2), vc)
            return num, add if kv is None else kv + add

        kv, outs = kv0, []
        for s in range(0, lk, size):
            num, kv = run(causal_chunk, qs[..., s : s + size, :], k5[..., s : s + size, :],
                          vext[..., s : s + size, :], kv)
            outs.append(num)
        num = torch.cat(outs, dim=3)[..., lk - lq :, :]
        return self._normalise(num), kv

    def _normalise(self, num: torch.Tensor, offset: torch.Tensor | float | None = None) -> torch.Tensor:
        """num[..., :d] / (num[..., d] + offset); offset defaults to the config's denominator_offset
        (a per-row tensor when the weights were rescaled, see _quadratic)."""
        d = self.head_dim
        off = self.config.denominator_offset if offset is None else offset
        return _safe_divide(num[..., :d], num[..., d:] + off)

    def _linear(self, q5, k5, v5, mask, causal, scale, kv0, raw, tf32=None):
        cfg = self.config
        lq, lk = q5.shape[3], k5.shape[3]
        q_log_scale = None
        # polysketch: the block algorithm squares the r-dim sketches itself, block by block
        # (r(r+1)/2 features never stored); other maps hand over their features.
        square = cfg.kind == "polysketch"
        if square:
            fq = self.feature_map.sketch_features(self._feature_inputs(q5, scale))
            fk = self.feature_map.sketch_features(self._feature_inputs(k5, scale))
        elif cfg.kind == "performer":
            # FAVOR+ query features carry a per-row stabiliser exp(-c): cancels in the ratio,
            # but the exact softmax blocks must be put on the same scale (far_scale below).
            fq, q_log_scale = self.feature_map.forward_with_log_scale(self._feature_inputs(q5, scale), True)
            fk = self.feature_map(self._feature_inputs(k5, scale), False)
        else:
            fq = self.feature_map(self._feature_inputs(q5, scale), True)
            fk = self.feature_map(self._feature_inputs(k5, scale), False)

        def full(x):
            return symmetric_square(x) if square else x

        vext = _with_normaliser(v5, mask)
        if cfg.window:
            out = self._windowed(raw[0], raw[1], fq, fk, vext, mask, causal, scale, kv0, q_log_scale, square, tf32)
            return out, (fk, square), vext
        local = cfg.resolved_local_kernel
        block = cfg.block_size
        if local is not None and mask is not None and kv0 is None:
            _warn_if_misaligned_left_padding(mask, block)
        if causal:
            if lq < lk:
                fq = F.pad(fq, (0, 0, lk - lq, 0))
            if cfg.causal_algorithm == "cumsum":
                num = lt_multiply_cumsum(full(fq), full(fk), vext)
            else:
                num = lt_product(fq, fk, vext, block, local is None, square, cfg.backend, tf32)
            if kv0 is not None:
                num = num + torch.matmul(full(fq), kv0)
            if local is not None:
                qs = F.pad(q5, (0, 0, lk - lq, 0)) if lq < lk else q5
                if q_log_scale is not None:
                    q_log_scale = F.pad(q_log_scale, (0, 0, lk - lq, 0)) if lq < lk else q_log_scale
                loc, far_scale = self._local_exact(qs, k5, vext, mask, True, scale, local, q_log_scale)
                num = loc + num if far_scale is None else loc + far_scale * num
            num = num[..., lk - lq :, :]
        else:
            fq, fk = full(fq), full(fk)
            kv = torch.matmul(fk.transpose(-1, -2), vext)
            if local is None:
                num = torch.matmul(fq, kv)
            else:
                if lq != lk:
                    raise ValueError("local_exact with bidirectional attention needs q_len == kv_len "
                                     f"(self-attention), got {lq} and {lk}")
                n_pad = -(-lk // block) * block
                fqb = F.pad(fq, (0, 0, 0, n_pad - lq)).unflatten(3, (n_pad // block, block))
                fkb = F.pad(fk, (0, 0, 0, n_pad - lk)).unflatten(3, (n_pad // block, block))
                vb = F.pad(vext, (0, 0, 0, n_pad - lk)).unflatten(3, (n_pad // block, block))
                own = torch.matmul(fkb.transpose(-1, -2), vb)  # (.., nb, F, e)
                far = torch.matmul(fqb, kv.unsqueeze(3) - own).flatten(3, 4)[..., :lq, :]
                loc, far_scale = self._local_exact(q5, k5, vext, mask, False, scale, local, q_log_scale)
                num = loc + far if far_scale is None else loc + far_scale * far
        return self._normalise(num), (fk, square), vext

    def _windowed(self, q5, k5, fq, fk, vext, mask, causal, scale, kv0, q_log_scale, square, tf32=None):
        """Sliding-window hybrid (ops/window.py): exact on the previous ``window`` keys, kernel before.

        q5, k5 are the model's own q, k (no projection, no qk LayerNorm): the exact part is the
        model's softmax (or polynomial) on its own scores, as in LoLCATs; fq, fk the features.
        """
        cfg = self.config
        w, block, backend = cfg.window, cfg.block_size, cfg.backend
        lq, lk = q5.shape[3], k5.shape[3]
        if causal:
            pad = lk - lq  # bottom-right aligned rows: queries sit at the last lq key positions
            qs, fqs = (F.pad(q5, (0, 0, pad, 0)), F.pad(fq, (0, 0, pad, 0))) if pad else (q5, fq)
            if q_log_scale is not None and pad:
                q_log_scale = F.pad(q_log_scale, (0, 0, pad, 0))
            far = shifted_lt(fqs, fk, vext, w, block, square, backend, tf32)
            if kv0 is not None:
                far = far + torch.matmul(symmetric_square(fqs) if square else fqs, kv0)
        else:
            if lq != lk:
                raise ValueError(f"window={w} with bidirectional attention needs q_len == kv_len (self-attention), "
                                 f"got {lq} and {lk}")
            qs = q5

            def flip(t):
                return t.flip(-2)

            far = shifted_lt(fq, fk, vext, w, block, square, backend, tf32) + flip(
                shifted_lt(flip(fq), flip(fk), flip(vext), w, block, square, backend, tf32))
        grad = torch.is_grad_enabled() and (
            any(t is not None and t.requires_grad for t in (qs, k5, vext, q_log_scale))
            or any(p.requires_grad for p in self.parameters()))
        args = (qs, k5, vext, mask, causal, scale, q_log_scale)
        # rematerialised in backward: the (n x 2w) scores and weights are not kept
        loc, far_scale = checkpoint(self._window_exact, *args, use_reentrant=False) if grad else \
            self._window_exact(*args)
        num = loc + (far if far_scale is None else far_scale * far)
        return self._normalise(num[..., lk - lq :, :])

    def _window_only(self, q5, k5, v5, mask, causal, scale):
        """kind='sliding_window': exact attention on each query's window and nothing beyond it
        (Longformer's local attention). O(n w d) time, O(n w) memory per head; the decode state is
        the last ``window`` keys and values (kept by ``_next_state``), so a token costs O(w d)."""
        lq, lk = q5.shape[3], k5.shape[3]
        vext = _with_normaliser(v5, mask)
        if causal:
            qs = F.pad(q5, (0, 0, lk - lq, 0)) if lq < lk else q5  # bottom-right aligned rows
        elif lq != lk:
            raise ValueError(f"kind='sliding_window' with bidirectional attention needs q_len == kv_len "
                             f"(self-attention), got {lq} and {lk}")
        else:
            qs = q5
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in (qs, k5, vext))
        args = (qs, k5, vext, mask, causal, scale, None)
        loc, _ = checkpoint(self._window_exact, *args, use_reentrant=False) if grad else self._window_exact(*args)
        return self._normalise(loc[..., lk - lq :, :])

    def _window_exact(self, qs, ks, vext, mask, causal, scale, q_log_scale):
        """Exact weights on each query's window and the factor that puts the far part on their scale."""
        w = self.config.window
        n = qs.shape[3]
        scores, allowed = window_scores(qs, ks, w, causal, scale, mask)  # (B, Hkv, G, tiles, w, span)
        values = window_tiles(vext, w, causal)
        log_far = None
        if self.config.resolved_local_kernel == "softmax":
            x = scores.masked_fill(~allowed, float("-inf"))
            # row stabiliser m >= 0 as in _local_blocks: exp(x - m) <= 1, far part times exp(-m)
            m = x.amax(dim=-1, keepdim=True).clamp_min(0.0).detach()
            weights = torch.exp(x - m)
            log_far = -m.flatten(3, 4)[..., :n, :]
        else:
            weights = self._exact_kernel(scores, "polynomial").masked_fill(~allowed, 0.0)
        loc = torch.matmul(weights, values).flatten(3, 4)[..., :n, :]
        if q_log_scale is not None:  # FAVOR+ query features come divided by exp(c)
            log_far = q_log_scale if log_far is None else log_far + q_log_scale
        far_scale = None if log_far is None else torch.exp(log_far)
        if self.config.window_mix:
            mix = self.window_mix.to(loc.dtype)
            far_scale = mix if far_scale is None else far_scale * mix
        return loc, far_scale

    def _local_exact(self, qs, ks, vext, mask, causal, scale, kernel, q_log_scale=None):
        """The exact diagonal blocks, a group of blocks at a time (``_LOCAL_GROUP``), each group rematerialised.

        Blocks do not interact, so groups are independent. All at once, the (n x b) scores,
        their powers and weights (and their gradients) made a transient peak of ~2000 floats
        per token and head: 481 MiB at n=16k, H=4, b=256 (SDPA: 208 MiB in the same run).
        Per group and recomputed in backward, only the inputs and outputs stay alive.
        """
        span = _LOCAL_GROUP.get(ks.device.type, _LOCAL_GROUP_ACCELERATOR) * self.config.block_size
        n = ks.shape[3]
        grad = torch.is_grad_enabled() and (
            any(t is not None and t.requires_grad for t in (qs, ks, vext, q_log_scale))
            or any(p.requires_grad for p in self.parameters()))
        locs, scales = [], []
        for s in range(0, n, span):
            args = (qs[..., s : s + span, :], ks[..., s : s + span, :], vext[..., s : s + span, :],
                    None if mask is None else mask[:, s : s + span], causal, scale, kernel,
                    None if q_log_scale is None else q_log_scale[..., s : s + span, :])
            loc, far_scale = checkpoint(self._local_blocks, *args, use_reentrant=False) if grad else \
                self._local_blocks(*args)
            locs.append(loc)
            scales.append(far_scale)
        loc = locs[0] if len(locs) == 1 else torch.cat(locs, dim=3)
        if scales[0] is None:
            return loc, None
        return loc, scales[0] if len(scales) == 1 else torch.cat(scales, dim=3)

    def _local_blocks(self, qs, ks, vext, mask, causal, scale, kernel, q_log_scale=None):
        """Exact kernel on the b x b diagonal blocks (query and key rows aligned)."""
        block = self.config.block_size
        n = ks.shape[3]
        n_pad = -(-n // block) * block
        nb = n_pad // block
        qb = F.pad(qs, (0, 0, 0, n_pad - n)).unflatten(3, (nb, block))
        kb = F.pad(ks, (0, 0, 0, n_pad - n)).unflatten(3, (nb, block))
        vb = F.pad(vext, (0, 0, 0, n_pad - n)).unflatten(3, (nb, block))
        x = torch.matmul(qb * scale, kb.transpose(-1, -2))  # (B, Hkv, G, nb, b, b)
        valid = torch.arange(n_pad, device=qs.device) < n
        allowed = valid.view(nb, 1, block)
        if mask is not None:
            allowed = allowed & F.pad(mask, (0, n_pad - n)).view(mask.shape[0], 1, 1, nb, 1, block)
        if causal:
            allowed = allowed & torch.ones(block, block, dtype=torch.bool, device=qs.device).tril()
        if kernel == "softmax":
            x = x.masked_fill(~allowed, float("-inf"))
            # Row stabiliser m >= 0: local weights exp(x - m) <= 1; far part scaled by exp(-m)
            # (detached: the ratio does not depend on m). Clamped at 0 so a row with no
            # visible local key (m = -inf) gives exp(-m) = 1 and no NaN.
            m = x.amax(dim=-1, keepdim=True).clamp_min(0.0).detach().flatten(3, 4)
            w = torch.exp(x - m.unflatten(3, (nb, block)))
            log_far = -m[..., :n, :]
            if q_log_scale is not None:
                log_far = log_far + q_log_scale
            far_scale = torch.exp(log_far)
        else:
            w = self._exact_kernel(x, "polynomial").masked_fill(~allowed, 0.0)
            # FAVOR+ query features come divided by exp(c): undo it against unscaled exact weights
            far_scale = None if q_log_scale is None else torch.exp(q_log_scale)
        loc = torch.matmul(w, vb).flatten(3, 4)[..., :n, :]
        return loc, far_scale

    # ---------------------------------------------------------------- state
    def _next_state(self, state, key, value, key_mask, k5, v5, mask, fk, vext, path) -> RecurrentState:
        total = state.length + key.shape[2]
        if path == "quadratic":
            keep = k5.shape[3]
        elif self.config.window:
            keep = min(self.config.window, total)  # the window's raw keys; everything older is folded
        elif self.config.resolved_local_kernel is not None:
            keep = total % self.config.block_size
        else:
            keep = 0
        fold = fk[0].shape[3] - keep if fk is not None else 0
        kv = state.kv
        if fold > 0:
            feats = fk[0][..., :fold, :]
            feats = symmetric_square(feats) if fk[1] else feats
            add = torch.matmul(feats.transpose(-1, -2), vext[..., :fold, :])
            kv = add if kv is None else kv + add
        if keep == 0:
            return RecurrentState(kv, None, None, None, total)
        # Store raw keys/values: the forward re-applies the LayerNorm to the buffer.
        raw_k = torch.cat([state.k, key], dim=2) if state.k is not None else key
        raw_v = torch.cat([state.v, value], dim=2) if state.v is not None else value
        new_mask = None
        if mask is not None:
            new_mask = mask[:, -keep:]
        return RecurrentState(kv, raw_k[:, :, -keep:], raw_v[:, :, -keep:], new_mask, total)
