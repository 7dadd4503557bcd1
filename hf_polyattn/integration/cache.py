"""A constant-memory cache for ``generate()``: one ``RecurrentState`` per layer.

A softmax ``DynamicCache`` keeps every key and value (2 * L * Hkv * D numbers per layer,
growing with each token). The kernelised kinds only need the running sum
phi(K)^T [V 1] (``RecurrentState.kv``, F x (D+1) per kv head) plus, with
``local_exact``, the keys of the current incomplete block (< block_size of them): the
memory per sequence does not depend on how many tokens were generated. The exception
is ``kind="polynomial"`` on its quadratic path (tensor features too many), whose state
keeps every key: exact polynomial attention has no constant-size state.

Protocol with transformers 5.x: the attention module calls
``past_key_values.update(k, v, layer_idx)`` *before* the attention function. Our layer's
``update`` returns the new keys/values unchanged (nothing is stored there); the attention
function, which finds the layer through a forward pre-hook (``state.py``), runs the
recurrent step and writes the new state back into ``layer.state``.

A layer with softmax heads (``PolyAttnConfig.softmax_heads``, ``ops/hybrid.py``) keeps a ``HybridState``: the
softmax kv heads' keys and values in full (growing by one per token, as a ``DynamicCache`` would for those heads)
beside the other heads' constant-size state; ``nbytes()`` counts both.
"""

from __future__ import annotations

import dataclasses

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicCache, DynamicLayer

from ..ops import HybridState, RecurrentState
from .compatibility import CACHE_ARGUMENT

__all__ = ["PolyAttnCache", "PolyAttnCacheLayer", "polyattn_layer_of"]


def _state_tensors(state) -> list[torch.Tensor]:
    """Every tensor of a layer state (a dataclass: ``RecurrentState``, ``HybridState``, ...), nested states included."""
    found = []
    for f in dataclasses.fields(state):
        value = getattr(state, f.name)
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif dataclasses.is_dataclass(value):
            found += _state_tensors(value)
    return found


def _move_state(state, device):
    """``state`` with every tensor on ``device``, nested states included (any state dataclass)."""
    if state is None:
        return None

    def mv(value):
        if isinstance(value, torch.Tensor):
            return value.to(device, non_blocking=True)
        return _move_state(value, device) if dataclasses.is_dataclass(value) else value

    return dataclasses.replace(state, **{f.name: mv(getattr(state, f.name)) for f in dataclasses.fields(state)})


def _as_index(indices: torch.Tensor | list | slice, batch: int) -> torch.Tensor:
    if isinstance(indices, slice):
        return torch.arange(batch)[indices]
    t = torch.as_tensor(indices)
    if t.dtype == torch.bool:
        t = t.nonzero().flatten()
    return t.long().flatten()


class PolyAttnCacheLayer(CacheLayerMixin):
    """One layer of a :class:`PolyAttnCache`: its attention module's state (``RecurrentState``, or ``HybridState`` for
    a layer with softmax heads) instead of keys/values."""

    is_compileable = False
    # A folded state cannot give tokens back: crop(n < 0) would need the keys we dropped.
    is_croppable = False
    is_sliding = False

    def __init__(self, **kwargs):
        super().__init__()
        self.state: RecurrentState | HybridState | None = None

    def __repr__(self) -> str:
        return f"PolyAttnCacheLayer(length={self.get_seq_length()}, nbytes={self.nbytes()})"

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        # Only the new tokens go to the attention function: it folds them into ``state``.
        return key_states, value_states

    def get_seq_length(self) -> int:
        return 0 if self.state is None else int(self.state.length)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # The 2-D padding mask covers past + new tokens (what generate() passes); the
        # attention function keeps its last Lk columns (the past is folded already).
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.state = None
        self.is_initialized = False

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.state is not None:
            self.state = self.state.index_select(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.state is None:
            return
        tensors = _state_tensors(self.state)
        if tensors:  # every tensor of a state leads with the batch
            self.state = self.state.index_select(_as_index(indices, tensors[0].shape[0]))

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.state is not None:
            self.state = self.state.repeat_interleave(repeats)

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove == 0:
            return
        raise ValueError(
            "a PolyAttnCache holds a folded recurrent state and cannot drop tokens (crop"
            f"({tokens_to_remove})): assisted/speculative decoding and cache rollback are not supported "
            "with hf_polyattn attention"
        )

    def offload(self):
        self.state = _move_state(self.state, "cpu")

    def prefetch(self):
        if self.is_initialized:
            self.state = _move_state(self.state, self.device)

    def nbytes(self) -> int:
        return 0 if self.state is None else self.state.nbytes()


class PolyAttnCache(Cache):
    """Cache of recurrent states for polyattn models; ``generate()`` picks it automatically.

    ``PolyAttnCache(model_or_config)`` pre-builds one layer per hidden layer;
    ``PolyAttnCache()`` adds layers as they are used. ``nbytes()`` is the memory held.
    """

    def __init__(self, config=None):
        if config is not None and hasattr(config, "config") and not hasattr(config, "num_hidden_layers"):
            config = config.config  # a model was passed
        if config is not None:
            text = config.get_text_config(decoder=True)
            super().__init__(layers=[PolyAttnCacheLayer() for _ in range(text.num_hidden_layers)])
        else:
            super().__init__(layer_class_to_replicate=PolyAttnCacheLayer)

    def nbytes(self) -> int:
        """Bytes held by every layer's state (keys kept for local blocks included)."""
        return sum(layer.nbytes() for layer in self.layers if isinstance(layer, PolyAttnCacheLayer))


def polyattn_layer_of(cache, layer_idx) -> PolyAttnCacheLayer:
    """The :class:`PolyAttnCacheLayer` for ``layer_idx`` inside ``cache``, creating it.

    A plain ``DynamicCache`` (what a model's forward creates with ``use_cache=True``, or a
    user passes) gets its still-empty layer replaced by a ``PolyAttnCacheLayer``: constant
    memory whatever the entry point. Any other cache type is refused (a StaticCache or a
    quantized cache stores keys we never use).
    """
    if not isinstance(layer_idx, int) or isinstance(layer_idx, bool):
        raise ValueError("caching needs an attention module with an int `layer_idx`; this module has "
                         f"layer_idx={layer_idx!r}")
    if not (isinstance(cache, PolyAttnCache) or type(cache) is DynamicCache):
        raise ValueError(
            f"hf_polyattn attention cannot use a {type(cache).__name__}: its kernels keep a recurrent state, not "
            "keys/values. Let generate() create the cache (cache_implementation=None), or pass "
            f"{CACHE_ARGUMENT}=hf_polyattn.PolyAttnCache(model) (a plain DynamicCache also works)."
        )
    layers = cache.layers
    while len(layers) <= layer_idx:
        layers.append(PolyAttnCacheLayer())
    layer = layers[layer_idx]
    if isinstance(layer, PolyAttnCacheLayer):
        return layer
    if type(layer) is not DynamicLayer:
        raise ValueError(
            f"cache layer {layer_idx} is a {type(layer).__name__} (sliding window / special layer): not supported "
            "by hf_polyattn attention"
        )
    if layer.get_seq_length() > 0:
        raise ValueError(
            f"cache layer {layer_idx} already holds {layer.get_seq_length()} softmax keys/values (a DynamicCache "
            "filled by another attention implementation): start from an empty cache with hf_polyattn attention"
        )
    layer = PolyAttnCacheLayer()
    layers[layer_idx] = layer
    return layer
