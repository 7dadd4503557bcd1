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

``decode_memory(model_or_config, lengths)`` states those bytes before anything runs: per token and in total after
a prompt of each length, for the polyattn model and for the same model with softmax attention (a ``DynamicCache``),
from the configs alone (what a model card prints); ``cache_nbytes(cache)`` measures a real cache.
"""

from __future__ import annotations

import dataclasses

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicCache, DynamicLayer

from ..ops import AttentionBase, HybridAttention, HybridState, KVCacheAttention, PolyAttention, RecurrentState
from ..ops.common import work_dtype

__all__ = ["DecodeMemory", "PolyAttnCache", "PolyAttnCacheLayer", "cache_nbytes", "decode_memory",
           "polyattn_layer_of"]


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
            "past_key_values=hf_polyattn.PolyAttnCache(model) (a plain DynamicCache also works)."
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


# ----------------------------------------------------------------------------------------------- decode memory


def cache_nbytes(cache) -> int:
    """Bytes a generation cache holds: ``PolyAttnCache.nbytes()``, or the keys and values of every layer of a
    transformers cache (``DynamicCache``; its sliding-window layers hold what they kept)."""
    if isinstance(cache, PolyAttnCache):
        return cache.nbytes()
    if not isinstance(cache, Cache):
        raise TypeError(f"cache must be a transformers Cache, got {type(cache).__name__}")
    total = 0
    for layer in cache.layers:
        if isinstance(layer, PolyAttnCacheLayer):  # a DynamicCache whose layers a polyattn model replaced
            total += layer.nbytes()
            continue
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


@dataclasses.dataclass(frozen=True)
class DecodeMemory:
    """Bytes of a generation cache after prompts of ``lengths`` tokens (``batch`` unpadded rows, weights in
    ``dtype``), from :func:`decode_memory`.

    ``per_token``: what the cache grows by with each token, for good (the softmax heads' keys and values; 0 for a
    model whose every head keeps a constant-size state); ``total[i]``: the whole cache after ``lengths[i]`` tokens
    (the constant states, windows and sinks included). ``softmax_*``: the same model with softmax attention and
    transformers' ``DynamicCache`` (what ``generate()`` gives it). ``kind``: the polyattn kind, None for a softmax
    model (its figures are then the softmax ones).
    """

    kind: str | None
    dtype: torch.dtype
    batch: int
    lengths: tuple[int, ...]
    per_token: int
    total: tuple[int, ...]
    softmax_per_token: int
    softmax_total: tuple[int, ...]

    def rows(self) -> list[dict]:
        """One dict per length: length, bytes, softmax_bytes, ratio (softmax bytes / bytes)."""
        return [{"length": n, "bytes": b, "softmax_bytes": s, "ratio": s / b if b else None}
                for n, b, s in zip(self.lengths, self.total, self.softmax_total)]


def _layer_state_bytes(module: AttentionBase, n: int, batch: int, item: int, work: torch.dtype) -> tuple[int, int]:
    """(bytes per token kept for good, the other bytes) of one layer's decoding state after ``n`` unpadded tokens.

    Mirrors what the modules store (``ops/recurrent.py`` ``_next_state`` / ``_decode_window``, ``ops/hybrid.py``,
    ``KVCacheAttention``); ``tests/integration/test_decode_memory.py`` checks it against real caches. ``item``: bytes
    of one number in the model's dtype (keys and values are kept as the model made them); ``work``: the working
    dtype (the kernel state F x (D + 1) accumulates in fp32 for a half-precision model)."""
    hk, d = module.num_kv_heads, module.head_dim
    if isinstance(module, HybridAttention):
        grows = 2 * batch * len(module.softmax_kv_heads) * d * item
        if module.kernel is None:
            return grows, 0
        kernel_grows, fixed = _layer_state_bytes(module.kernel, n, batch, item, work)
        return grows + kernel_grows, fixed
    if isinstance(module, KVCacheAttention):  # every key and value (a shared-QK Reformer: keys from the queries)
        shared = getattr(module, "shared_qk", False)
        keys = module.num_heads * torch.empty((), dtype=work).element_size() if shared else hk * item
        return batch * d * (keys + hk * item), 0
    if not isinstance(module, PolyAttention):
        raise ValueError(f"decode_memory: the decoding state of {type(module).__name__} (kind "
                         f"{module.config.kind!r}) is not modelled")
    cfg = module.config
    key_value = 2 * batch * hk * d * item
    path = module._recurrent_path()
    if path == "quadratic":  # exact polynomial without tensor features: every key
        return key_value, 0
    if cfg.window:
        keep = min(cfg.window, n)  # the window's raw keys and values
    elif cfg.resolved_local_kernel is not None:
        keep = n % cfg.block_size  # the keys of the current incomplete block
    else:
        keep = 0
    fixed = keep * key_value
    if module.num_features and n > keep:  # a key was folded: phi(K)^T [V 1], (B, Hkv, F, D + 1)
        # in the dtype the path computes in: the working dtype, float64 for exact tensor features
        probe = torch.empty(0, device="meta", dtype=work)
        state_item = module.path_inputs(path, probe, probe, probe)[0].element_size()
        fixed += batch * hk * module.num_features * (d + 1) * state_item
    if cfg.window and cfg.sinks and n > cfg.window:  # the sink slots (all of them once a key left) + their flags
        fixed += cfg.sinks * key_value + batch * cfg.sinks
    return 0, fixed


def _polyattn_modules(model_or_config, dtype: torch.dtype) -> tuple[str | None, list[AttentionBase]]:
    """(kind, one attention module per layer): a model's own ``polyattn`` modules, or modules built from a
    config's ``polyattn`` settings and head sizes; (None, []) for a softmax model or config."""
    from .settings import CONFIG_KEY, polyattn_kind, resolve_polyattn_config

    if isinstance(model_or_config, torch.nn.Module):
        found = [m._modules["polyattn"] for m in model_or_config.modules()
                 if isinstance(m._modules.get("polyattn"), AttentionBase)]
        return (found[0].config.kind if found else None), found
    config = model_or_config
    cfg = resolve_polyattn_config(config) if polyattn_kind(config) else None
    stored = getattr(config, CONFIG_KEY, None)
    if cfg is None and isinstance(stored, dict):  # a config read from disk without the kind as its implementation
        from ..config import PolyAttnConfig

        cfg = PolyAttnConfig.from_dict(stored)
    if cfg is None:
        return None, []
    from ..ops import build_attention

    text = config.get_text_config(decoder=True)
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    with torch.device("meta"):  # sizes only: no memory, no random draws
        return cfg.kind, [build_attention(cfg, heads, head_dim, kv_heads, i).to(dtype)
                          for i in range(text.num_hidden_layers)]


def _model_dtype(model_or_config, dtype) -> torch.dtype:
    if dtype is not None:
        return getattr(torch, dtype) if isinstance(dtype, str) else dtype
    if isinstance(model_or_config, torch.nn.Module):
        return next((p.dtype for p in model_or_config.parameters() if p.is_floating_point()), torch.float32)
    stored = getattr(model_or_config.get_text_config(decoder=True), "dtype", None)
    if isinstance(stored, str) and stored != "auto":
        stored = getattr(torch, stored, None)
    return stored if isinstance(stored, torch.dtype) else torch.float32


def decode_memory(model_or_config, lengths=(4096, 16384, 32768), *, batch: int = 1,
                  dtype: torch.dtype | str | None = None) -> DecodeMemory:
    """The bytes of a generation cache after prompts of ``lengths`` tokens, from the configs alone.

    ``model_or_config``: a polyattn model (or a softmax one), or its transformers config (``config.polyattn`` read,
    nothing loaded: the layers are built on the meta device for their sizes). ``dtype``: the weights' dtype
    (default: the model's, else the config's ``dtype``, else float32). ``batch``: unpadded rows.

    Softmax (``DynamicCache``): 2 x layers x kv_heads x head_dim x dtype bytes per token and row. A polyattn model
    (``PolyAttnCache``): per layer, its softmax kv heads' keys and values per token, plus the other heads' constant
    state: the kernel state F x (head_dim + 1) per kv head in the working dtype (fp32 for half precision), the
    window's last ``window`` keys and values, ``sinks`` sink keys and values and their flags; with ``local_exact``
    the keys of the current incomplete block. Padded prompts add a key padding flag (1 byte) per key kept and 8
    bytes per row; not counted here. Raises ValueError for a kind whose state is not modelled and for a softmax
    config whose cache is not a plain ``DynamicCache`` of full layers (sliding-window layers).
    """
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch must be an int >= 1, got {batch!r}")
    lengths = tuple(lengths)
    if not lengths or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in lengths):
        raise ValueError(f"lengths must be ints >= 1, got {lengths!r}")
    config = model_or_config.config if isinstance(model_or_config, torch.nn.Module) else model_or_config
    if not hasattr(config, "get_text_config"):
        raise TypeError(f"decode_memory needs a transformers model or config, got {type(model_or_config).__name__}")
    dt = _model_dtype(model_or_config, dtype)
    item = torch.empty((), dtype=dt).element_size()
    work = work_dtype(dt)
    kind, modules = _polyattn_modules(model_or_config, dt)
    text = config.get_text_config(decoder=True)
    if modules:  # the layers' own head sizes
        softmax_per_token = sum(2 * batch * m.num_kv_heads * m.head_dim * item for m in modules)
    else:
        odd = {type(layer).__name__ for layer in DynamicCache(config=config).layers if type(layer) is not DynamicLayer}
        if odd:
            raise ValueError(f"decode_memory: this model's DynamicCache has {sorted(odd)} layers (sliding window / "
                             "shared layers), whose size is not modelled")
        heads = text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        softmax_per_token = 2 * batch * text.num_hidden_layers * kv_heads * head_dim * item
    softmax_total = tuple(softmax_per_token * n for n in lengths)
    if not modules:
        return DecodeMemory(None, dt, batch, lengths, softmax_per_token, softmax_total, softmax_per_token,
                            softmax_total)
    per_token = sum(_layer_state_bytes(m, 1, batch, item, work)[0] for m in modules)
    total = tuple(per_token * n + sum(_layer_state_bytes(m, n, batch, item, work)[1] for m in modules)
                  for n in lengths)
    return DecodeMemory(kind, dt, batch, lengths, per_token, total, softmax_per_token, softmax_total)
