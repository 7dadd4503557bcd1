"""Decode memory of a converted model, computed from its config: what generation keeps per token and in total.

A softmax model's ``DynamicCache`` keeps every key and value: ``2 x Hkv x D`` numbers per token and layer, in the
model's dtype. A converted model keeps, per layer:

* for each softmax kv head (``PolyAttnConfig.softmax_heads``): its keys and values of every token, like softmax;
* for each other kv head, by the kind's module class (``KindSpec.module``):
  - ``KVCacheAttention`` kinds (linformer, nystrom, fnet, bigbird, reformer): every key and value, like softmax
    (what the module's ``read_keys`` returns: reformer's shared-QK keys come one per query head);
  - linear-time ``PolyAttention`` kinds (linear, polysketch, performer, taylor, sliding_window): a constant-size
    state, ``F x (D + 1)`` numbers of the kernel (F features per key, a normaliser column; float32, float64 for a
    float64 model) plus the keys the exact local part keeps (the last ``window`` keys and values, ``sinks`` more with
    a bool mask of ``sinks`` entries per layer, or up to ``block_size - 1`` keys of the current ``local_exact``
    block: the most it holds);
  - anything else (the quadratic ``polynomial`` kind): not computed here (``None``).

``tests/integration/test_decode_memory.py`` checks these numbers against ``PolyAttnCache.nbytes()`` after a prefill.
Batch size 1 and unpadded rows (padding adds a bool mask entry per softmax-head token).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import PolyAttnConfig

__all__ = ["DEFAULT_LENGTHS", "DecodeMemory", "cache_dims", "decode_memory"]

DEFAULT_LENGTHS = (4096, 16384, 32768)


@dataclass(frozen=True)
class DecodeMemory:
    """Bytes a decoding cache holds after ``length`` tokens: ``constant + per_token * length`` (batch 1)."""

    per_token: int
    constant: int

    def total(self, length: int) -> int:
        return self.constant + self.per_token * length


def cache_dims(config) -> tuple[int, int, int, int]:
    """(layers, query heads, kv heads per layer, head_dim) of a transformers config's decoder."""
    text = config.get_text_config(decoder=True)
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return text.num_hidden_layers, heads, kv_heads, head_dim


def model_dtype(config) -> torch.dtype:
    """The dtype a checkpoint's config records (``dtype``, ``torch_dtype`` in older files); float32 without one."""
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else torch.float32


def _kernel_head_bytes(cfg: PolyAttnConfig, heads: int, kv_heads: int, head_dim: int, element: int,
                       state_element: int) -> tuple[int, int] | None:
    """(constant bytes per kernel kv head, per-token bytes per kernel kv head) of ``cfg``'s kind; None when the
    kind's state is not one of the two shapes above."""
    from ..ops import KVCacheAttention, PolyAttention, build_attention

    module_class = cfg.spec.module_class()
    if not (issubclass(module_class, KVCacheAttention)
            or (issubclass(module_class, PolyAttention) and cfg.spec.linear_time)):
        return None
    module = build_attention(cfg.replace(softmax_heads=None), heads, head_dim, kv_heads, 0)
    if isinstance(module, KVCacheAttention):
        # the state stores what read_keys returns: the layer's keys, or one per query head where a kind makes its
        # keys from the queries (reformer's shared QK); the values per kv head
        q, k = torch.zeros(1, heads, 1, head_dim), torch.zeros(1, kv_heads, 1, head_dim)
        key_heads = module.read_keys(q, k).shape[1]
        return 0, (key_heads // kv_heads + 1) * head_dim * element
    # the number of features per key, read from the module itself (feature_proj, sketch size, hedgehog's doubling)
    features = module.num_features
    constant = features * (head_dim + 1) * state_element
    keys = cfg.window + cfg.sinks if cfg.window else (cfg.block_size - 1 if cfg.local_exact else 0)
    return constant + 2 * keys * head_dim * element, 0


def decode_memory(config, cfg: PolyAttnConfig | None, *, dtype: torch.dtype | None = None) -> DecodeMemory | None:
    """What a batch-1 decoding cache holds for a model with transformers config ``config`` running ``cfg``
    (None: the softmax model itself), in ``dtype`` (default: the config's); None where the kind's state is not
    computed here (module docstring)."""
    layers, heads, kv_heads, head_dim = cache_dims(config)
    dtype = dtype or model_dtype(config)
    element = torch.empty((), dtype=dtype).element_size()
    state_element = max(element, 4)  # the kernel state accumulates in float32 (float64 stays float64)
    softmax_token = 2 * head_dim * element
    if cfg is None:
        return DecodeMemory(per_token=layers * kv_heads * softmax_token, constant=0)
    per_head = _kernel_head_bytes(cfg, heads, kv_heads, head_dim, element, state_element)
    if per_head is None:
        return None
    head_constant, head_token = per_head
    soft = {}
    for layer, _ in cfg.softmax_heads or ():
        soft[layer] = soft.get(layer, 0) + 1
    per_token = constant = 0
    for layer in range(layers):
        n_soft = soft.get(layer, 0)
        n_kernel = kv_heads - n_soft
        per_token += n_soft * softmax_token + n_kernel * head_token
        constant += n_kernel * head_constant
        if n_kernel and cfg.window and cfg.sinks:
            constant += cfg.sinks  # the bool mask of the sinks (batch x sinks), one per layer's kernel state
    return DecodeMemory(per_token=per_token, constant=constant)
