"""What every kind's attention module shares: construction checks, input checks, the state protocol.

A kind's module (``PolyAttention`` for the kernel kinds, one class per other kind in
``hf_polyattn/kinds/``) is built as ``cls(config, num_heads, head_dim, num_kv_heads, layer_idx)``
and called as ``module(query, key, value, causal=..., scaling=..., key_padding_mask=..., state=...)``
with queries (B, H, Lq, D), keys/values (B, Hkv, Lk, D), H a multiple of Hkv (grouped-query
attention); it returns (B, H, Lq, D) in the query's dtype, or (output, new state) when a
``state`` is given (causal only: the integration's cache hands it over).

:class:`KVCacheAttention` is the base of kinds defined on whole sequences (Linformer, BigBird,
Reformer, ...): they implement ``attend`` once, and decoding keeps every key and value (like a
softmax KV cache) and recomputes the new rows bottom-right aligned, so the outputs with and
without a cache are the same rows of the same definition.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..config import PolyAttnConfig
from .common import check_softcap
from .state import RecurrentState

__all__ = ["AttentionBase", "KVCacheAttention", "join_masks", "layer_seed", "softmax_heads_of"]


def layer_seed(seed: int, layer_idx: int) -> int:
    """Independent random tensors per layer (the paper samples one sketch per head and layer)."""
    return (seed * 1_000_003 + layer_idx * 7919) % (2**62)


def join_masks(past: torch.Tensor | None, new: torch.Tensor | None, past_len: int, new_len: int, batch: int,
               device: torch.device) -> torch.Tensor | None:
    """The (B, past_len + new_len) key padding mask of stored keys followed by new ones (None: nothing padded)."""
    if past is None and new is None:
        return None
    past = past if past is not None else torch.ones(batch, past_len, dtype=torch.bool, device=device)
    new = new if new is not None else torch.ones(batch, new_len, dtype=torch.bool, device=device)
    return torch.cat([past, new], dim=1)


def softmax_heads_of(config: PolyAttnConfig, layer_idx: int) -> tuple[int, ...]:
    """The kv heads of layer ``layer_idx`` that ``config.softmax_heads`` keeps as exact softmax, ascending."""
    return tuple(sorted(h for layer, h in config.softmax_heads or () if layer == layer_idx))


class AttentionBase(nn.Module):
    """Base of every kind's module: validated sizes, input checks, deterministic re-initialisation."""

    # Whether the class runs the kv heads that ``config.softmax_heads`` names in its layer as softmax (the hybrid,
    # ``ops/hybrid.py``); any other module built for such a layer would silently run them as the kind.
    runs_softmax_heads = False

    def __init__(self, config: PolyAttnConfig, num_heads: int, head_dim: int, num_kv_heads: int | None = None,
                 layer_idx: int = 0):
        super().__init__()
        if not isinstance(config, PolyAttnConfig):
            raise TypeError(f"config must be a PolyAttnConfig, got {type(config).__name__}")
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        for name, val in (("num_heads", num_heads), ("head_dim", head_dim), ("num_kv_heads", num_kv_heads),
                          ("layer_idx", layer_idx)):
            if isinstance(val, bool) or not isinstance(val, int) or val < (0 if name == "layer_idx" else 1):
                raise ValueError(f"{name} must be an int >= {0 if name == 'layer_idx' else 1}, got {val!r}")
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        soft = softmax_heads_of(config, layer_idx)
        if soft and not self.runs_softmax_heads:
            raise ValueError(f"config.softmax_heads names kv heads {list(soft)} of layer {layer_idx}, which "
                             f"{type(self).__name__} would run as kind={config.kind!r}: build the layer with "
                             "hf_polyattn.ops.build_attention (or hf_polyattn.convert)")
        self.config = config
        # The model's RoPE (``ops.rotary.RopeRotation``), set by the integration for a RoPE model whose sinks are
        # scored at positions within the window (``sink_position='window'``); None: q and k carry no rotary
        # positions (GPT-2, BERT) or nothing reads them.
        self.rope = None
        self.__dict__["_softcap"] = None
        self.num_heads, self.head_dim, self.num_kv_heads = num_heads, head_dim, num_kv_heads
        self.groups = num_heads // num_kv_heads
        self.layer_idx = layer_idx

    @property
    def softcap(self) -> float | None:
        """The model's attention logit soft-cap c of this layer (Gemma 2's ``attn_logit_softcapping``), applied as
        c tanh(s / c) to every score s = s q.k the layer forms (``common.soft_cap``); None: no capping. Set by the
        integration from the layer's call site (not saved with the weights: read from the model again at every
        load); setting it refuses (ValueError) a layer that would not honour it (``softcap_refusal``)."""
        return self.__dict__["_softcap"]

    @softcap.setter
    def softcap(self, value) -> None:
        value = check_softcap(value)
        if value is not None:
            reason = type(self).softcap_refusal(self.config, self.layer_idx, self.num_kv_heads)
            if reason is not None:
                raise ValueError(reason)
        self.__dict__["_softcap"] = value

    @classmethod
    def softcap_refusal(cls, config: PolyAttnConfig, layer_idx: int, num_kv_heads: int,
                        exact_elsewhere: bool = False) -> str | None:
        """Why a layer of this class under ``config`` cannot honour a logit soft-cap, or None when it can.
        ``exact_elsewhere``: other heads of the layer are exact softmax (a hybrid's), so the layer has an exact part
        even where this class has none. Here: the kind applies no cap at all (its own scores, if any, are formed
        where hf_polyattn does not cap them)."""
        return (f"kind={config.kind!r} does not apply attention logit soft-capping c tanh(score / c) (it is "
                "implemented by the kernel kinds' exact parts: window, sinks, local_exact blocks, softmax heads, and "
                "by kind='polynomial'); dropping it would silently change the model")

    @property
    def seed(self) -> int:
        """This layer's seed for random tensors (sketches, features, hashes, random blocks)."""
        return layer_seed(self.config.seed, self.layer_idx)

    @property
    def num_features(self) -> int:
        """Features per key of a kernel kind's state (0: the kind keeps no kernel state)."""
        return 0

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Re-initialise every parameter and buffer deterministically from the seed."""
        for m in self.modules():
            if m is not self and hasattr(m, "reset_parameters"):
                m.reset_parameters()

    def extra_repr(self) -> str:
        return (f"kind={self.config.kind}, heads={self.num_heads}, kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}, features={self.num_features}")

    def init_state(self) -> RecurrentState:
        return RecurrentState(None, None, None, None, 0)

    def check_inputs(self, q, k, v, key_padding_mask, causal) -> None:
        """Clear errors for every malformed call: types, ranks, dtypes, devices, shapes, mask."""
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
        if not isinstance(causal, bool):
            raise TypeError(f"causal must be a bool, got {causal!r}")

    def check_call(self, q, k, v, key_padding_mask, causal, state) -> tuple[int, int]:
        """``check_inputs``, then what the direction and a state allow; returns (q_len, kv_len)."""
        self.check_inputs(q, k, v, key_padding_mask, causal)
        lq, lk = q.shape[2], k.shape[2]
        if causal and lq > lk:
            raise ValueError(f"causal attention needs q_len <= kv_len, got {lq} > {lk}")
        if state is not None:
            if not causal:
                raise ValueError("a recurrent state is for causal attention only")
            if lq != lk:
                raise ValueError(f"with a state, query and key must be the same new tokens, got {lq} and {lk}")
        return lq, lk


class KVCacheAttention(AttentionBase):
    """A kind defined on whole sequences by :meth:`attend`; its decoding state keeps every key.

    ``forward`` checks the call, computes in float32 (float64 stays float64) and casts back,
    and with a ``state`` prepends the stored keys/values/mask and stores the new ones.
    Set ``supports_causal`` / ``supports_bidirectional`` to False for a kind that cannot
    serve that direction: the call then fails with a ValueError naming the kind.
    """

    supports_causal = True
    supports_bidirectional = True

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, scale: float,
               mask: torch.Tensor | None) -> torch.Tensor:
        """(B, H, Lq, D) from q (B, H, Lq, D), k, v (B, Hkv, Lk, D) in the working dtype; causal rows
        bottom-right aligned (query i at position Lk - Lq + i); ``mask`` (B, Lk) bool, False = padded key."""
        raise NotImplementedError

    def read_keys(self, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
        """The keys ``attend`` reads (B, Hkv, L, D), also what a state stores: the layer's keys; a
        shared-QK kind (Reformer) returns its keys made from the queries."""
        return key

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, causal: bool,
                scaling: float | None = None, key_padding_mask: torch.Tensor | None = None,
                state: RecurrentState | None = None):
        self.check_inputs(query, key, value, key_padding_mask, causal)
        kind = self.config.kind
        if causal and not self.supports_causal:
            raise ValueError(f"kind={kind!r} is bidirectional only (every query reads every key): it cannot serve "
                             "causal attention (a decoder / causal LM); pick a causal kind")
        if not causal and not self.supports_bidirectional:
            raise ValueError(f"kind={kind!r} is causal only: it cannot serve bidirectional attention")
        lq, lk = self.check_call(query, key, value, key_padding_mask, causal, state)
        scale = 1.0 / math.sqrt(self.head_dim) if scaling is None else float(scaling)
        work = torch.float64 if query.dtype == torch.float64 else torch.float32
        mask = key_padding_mask
        keys = self.read_keys(query, key)
        if state is not None and state.k is not None:
            keys = torch.cat([state.k.to(keys.dtype), keys], dim=2)
            value = torch.cat([state.v.to(value.dtype), value], dim=2)
            mask = join_masks(state.mask, mask, state.k.shape[2], lk, query.shape[0], query.device)
        out = self.attend(query.to(work), keys.to(work), value.to(work), causal=causal, scale=scale, mask=mask)
        out = out.to(query.dtype)
        if state is None:
            return out
        return out, RecurrentState(None, keys, value, mask, state.length + lk)
