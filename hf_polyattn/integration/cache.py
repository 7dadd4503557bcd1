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
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

from ..ops import AttentionBase, HybridAttention, HybridState, KVCacheAttention, PolyAttention, RecurrentState
from ..ops.common import work_dtype
from .compatibility import CACHE_ARGUMENT, attention_dims
from .settings import CONFIG_KEY, polyattn_kind, resolve_polyattn_config

__all__ = ["DecodeMemory", "PolyAttnCache", "PolyAttnCacheLayer", "cache_layers", "cache_nbytes", "check_cache_layers",
           "check_own_cache",
           "decode_memory", "polyattn_layer_of"]


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

    ``PolyAttnCache(model_or_config)`` pre-builds one layer per hidden layer (``cache_layers``: transformers' own
    layer for a convolution / DeltaNet layer);
    ``PolyAttnCache()`` adds layers as they are used. ``nbytes()`` is the memory held.
    """

    def __init__(self, config=None):
        if config is not None and hasattr(config, "config") and not hasattr(config, "num_hidden_layers"):
            config = config.config  # a model was passed
        if config is not None:
            super().__init__(layers=cache_layers(config))
        else:
            super().__init__(layer_class_to_replicate=PolyAttnCacheLayer)

    def nbytes(self) -> int:
        """Bytes held by every layer's state (keys kept for local blocks included; a convolution layer's inputs)."""
        return sum(_layer_nbytes(layer) for layer in self.layers)


def _mixer_layer_class(layer_type: str) -> type | None:
    """The class transformers' ``DynamicCache(config=...)`` gives layers of ``layer_type`` when they keep a state of
    their own instead of attention keys (``LinearAttentionCacheLayerMixin``: LFM2's short convolutions 'conv',
    Qwen3-Next's 'linear_attention'), else None."""
    from transformers.cache_utils import DYNAMIC_LAYER_TYPE_MAPPING, LinearAttentionCacheLayerMixin

    cls = DYNAMIC_LAYER_TYPE_MAPPING.get(layer_type)
    return cls if isinstance(cls, type) and issubclass(cls, LinearAttentionCacheLayerMixin) else None


def cache_layers(config) -> list:
    """One cache layer per hidden layer of ``config``'s decoder: a :class:`PolyAttnCacheLayer` for every attention
    layer, and for a layer that is no attention layer (LFM2's convolutions: a conv state of kernel-size inputs,
    constant) the layer transformers' own ``DynamicCache(config=...)`` gives it, which its module reads and writes
    (``get_conv_state``). ValueError for a layer that keeps both in one cache layer (Falcon-H1's 'hybrid'): a
    ``PolyAttnCacheLayer`` holds no conv state (``check_cache_layers`` refuses such a model at convert)."""
    from transformers.cache_utils import get_layer_types_and_kwargs

    text = config.get_text_config(decoder=True)
    layers = []
    for idx, (layer_type, kwargs) in enumerate(zip(*get_layer_types_and_kwargs(text))):
        cls = _mixer_layer_class(layer_type)
        if cls is None:
            layers.append(PolyAttnCacheLayer())
        elif issubclass(cls, CacheLayerMixin):  # e.g. LinearAttentionAndFullAttentionLayer
            raise ValueError(
                f"layer {idx} of model_type {text.model_type!r} is a {layer_type!r} layer (config.layer_types): its "
                f"attention and a convolution / state-space mixer share one cache layer ({cls.__name__}), and "
                "hf_polyattn's PolyAttnCacheLayer keeps the attention's recurrent state only: generation with "
                "hf_polyattn attention is not supported for this model")
        else:
            layers.append(cls(**kwargs))
    return layers


def check_cache_layers(config) -> None:
    """Refuse (ValueError, at convert / from_pretrained) a decoder whose generation cache ``cache_layers`` cannot
    build, rather than a failure in ``generate()``."""
    if getattr(config, "is_encoder_decoder", False) or not hasattr(config, "get_text_config"):
        return
    if getattr(config.get_text_config(decoder=True), "layer_types", None) is not None:
        cache_layers(config)


def own_cache_classes(model) -> list[type]:
    """The ``Cache`` classes the model's modeling module defines for itself (MiniMax's ``MiniMaxCache``, which holds
    its lightning-attention layers' states): its forward creates one in place of a ``DynamicCache`` and refuses any
    other cache."""
    import sys

    modeling = sys.modules.get(type(model).__module__)
    if modeling is None:
        return []
    return [obj for obj in vars(modeling).values()
            if isinstance(obj, type) and issubclass(obj, Cache) and obj.__module__ == modeling.__name__]


def check_own_cache(model) -> None:
    """Refuse (ValueError, at convert / from_pretrained) a decoder that keeps its generation cache in a class of its
    own: hf_polyattn attention writes its recurrent state into a ``PolyAttnCacheLayer`` of a ``PolyAttnCache`` or a
    ``DynamicCache`` (``polyattn_layer_of``), and the model's forward hands it its own cache (MiniMax creates a
    MiniMaxCache and refuses a PolyAttnCache), so the converted model would fail at its first cached forward."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "is_encoder_decoder", False):
        return
    own = own_cache_classes(model)
    if own:
        names = ", ".join(c.__name__ for c in own)
        raise ValueError(
            f"model_type {getattr(config, 'model_type', None)!r} ({type(model).__name__}) keeps its generation cache "
            f"in a class of its own ({names}, defined in {type(model).__module__}), which its forward creates in place "
            f"of a DynamicCache and which generate() requires: hf_polyattn attention cannot use a {own[0].__name__} "
            "(it keeps a recurrent state in a PolyAttnCache layer, not keys/values), so the converted model would "
            "fail at its first cached forward; this model is not supported by hf_polyattn attention")


def _layer_nbytes(layer) -> int:
    """Bytes one cache layer holds: a ``PolyAttnCacheLayer``'s state, a transformers layer's keys and values and its
    conv / recurrent states (LFM2's convolution layers)."""
    if isinstance(layer, PolyAttnCacheLayer):
        return layer.nbytes()
    tensors = [getattr(layer, "keys", None), getattr(layer, "values", None)]
    for name in ("conv_states", "recurrent_states"):
        tensors += list((getattr(layer, name, None) or {}).values())
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


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
    # DynamicCache(config=...) (what a model's forward makes with use_cache=True) gives a model's sliding layers a
    # DynamicSlidingWindowLayer: still empty, it is replaced like a DynamicLayer (a kept-exact sliding layer's state
    # holds its own last window - 1 keys)
    if type(layer) not in (DynamicLayer, DynamicSlidingWindowLayer):
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
    transformers cache (``DynamicCache``; its sliding-window layers hold what they kept; a convolution layer its
    conv states)."""
    if isinstance(cache, PolyAttnCache):
        return cache.nbytes()
    if not isinstance(cache, Cache):
        raise TypeError(f"cache must be a transformers Cache, got {type(cache).__name__}")
    # a DynamicCache whose layers a polyattn model replaced holds PolyAttnCacheLayers too
    return sum(_layer_nbytes(layer) for layer in cache.layers)


@dataclasses.dataclass(frozen=True)
class DecodeMemory:
    """Bytes of a generation cache after prompts of ``lengths`` tokens and ``decoded`` tokens generated from each
    (``batch`` unpadded rows, weights in ``dtype``), from :func:`decode_memory`.

    ``per_token``: what the cache stores per token for good (the softmax heads' keys and values; 0 for a model whose
    every head keeps a constant-size state); ``total[i]``: the whole cache (the constant states, windows, sinks and
    the softmax heads' room for the next tokens included). ``softmax_*``: the same model with softmax attention and
    transformers' ``DynamicCache`` (what ``generate()`` gives it). ``kind``: the polyattn kind, None for a softmax
    model (its figures are then the softmax ones).
    """

    kind: str | None
    dtype: torch.dtype
    batch: int
    decoded: int
    lengths: tuple[int, ...]
    per_token: int
    total: tuple[int, ...]
    softmax_per_token: int
    softmax_total: tuple[int, ...]

    def rows(self) -> list[dict]:
        """One dict per length: length, bytes, softmax_bytes, ratio (softmax bytes / bytes)."""
        return [{"length": n, "bytes": b, "softmax_bytes": s, "ratio": s / b if b else None}
                for n, b, s in zip(self.lengths, self.total, self.softmax_total)]


def _softmax_buffer_tokens(prompt: int, decoded: int) -> int:
    """Positions of a softmax head's key buffer after a prompt of ``prompt`` tokens (one call) and ``decoded``
    single-token steps, without a recorded gradient (``generate()``): ``ops.hybrid.buffer_length`` of the prompt,
    grown again each time a token finds it full."""
    from ..ops.hybrid import buffer_length

    size = buffer_length(prompt)
    while size < prompt + decoded:
        size = buffer_length(size + 1)
    return size


def _decodes_on_ring(module: PolyAttention) -> bool:
    """Whether the module's single-token steps keep a ``WindowRing`` (``ops/decode.py``) instead of its state."""
    from ..ops.decode import ring_supported

    with torch.no_grad():
        return ring_supported(module, RecurrentState(None, None, None, None, 0))


def _kept_per_token(module: AttentionBase, batch: int, item: int, work: torch.dtype) -> int:
    """Bytes one layer's state keeps for good per token: a hybrid's softmax heads' keys and values, every key of a
    kind that keeps them all (``KVCacheAttention``, the exact polynomial's quadratic path); 0 for a constant state."""
    if isinstance(module, HybridAttention):
        kernel = 0 if module.kernel is None else _kept_per_token(module.kernel, batch, item, work)
        return 2 * batch * len(module.softmax_kv_heads) * module.head_dim * item + kernel
    if isinstance(module, KVCacheAttention) or (isinstance(module, PolyAttention)
                                                and module._recurrent_path() == "quadratic"):
        return _layer_state_bytes(module, 2, 0, batch, item, work) - _layer_state_bytes(module, 1, 0, batch, item,
                                                                                         work)
    return 0


def _layer_state_bytes(module: AttentionBase, prompt: int, decoded: int, batch: int, item: int,
                       work: torch.dtype, capacity: int | None = None) -> int:
    """Bytes of one layer's decoding state after a prompt of ``prompt`` unpadded tokens (one call) and ``decoded``
    single-token steps.

    Mirrors what the modules store (``ops/recurrent.py``, ``ops/decode.py``, ``ops/hybrid.py``, ``kinds/delta.py``,
    ``KVCacheAttention``); ``tests/integration/test_decode_memory.py`` checks it against real caches. ``item``: bytes
    of one number in the model's dtype (keys and values are kept as the model made them); ``work``: the working
    dtype (kernel states, rings and convolution inputs are kept in it: fp32 for a half-precision model)."""
    hk, d, n = module.num_kv_heads, module.head_dim, prompt + decoded
    w_item = torch.empty((), dtype=work).element_size()
    if isinstance(module, HybridAttention):  # the softmax heads' buffers, with room for the next tokens
        positions = _softmax_buffer_tokens(prompt, decoded) if capacity is None else capacity
        grows = 2 * batch * len(module.softmax_kv_heads) * d * item * positions
        kernel = 0 if module.kernel is None else _layer_state_bytes(module.kernel, prompt, decoded, batch, item, work)
        return grows + kernel
    if isinstance(module, KVCacheAttention):  # every key and value (a shared-QK Reformer: keys from the queries)
        keys = module.num_heads * w_item if getattr(module, "shared_qk", False) else hk * item
        return n * batch * d * (keys + hk * item)
    if not isinstance(module, PolyAttention):
        raise ValueError(f"decode_memory: the decoding state of {type(module).__name__} (kind "
                         f"{module.config.kind!r}) is not modelled")
    cfg = module.config
    key_value = 2 * batch * hk * d * item
    path = module._recurrent_path()
    if path == "quadratic":  # exact polynomial without tensor features: every key
        return n * key_value
    s, w = cfg.sinks, cfg.window
    if cfg.sparse_cache:
        return _sparse_state_bytes(module, prompt, decoded, batch, item, w_item)
    # a single-token call (every decoding step, and a one-token prompt) keeps a ring: fixed buffers of S + W slots of
    # keys and [v 1], their flags and log-gates, and the state
    if (decoded or prompt == 1) and _decodes_on_ring(module):
        ring = batch * hk * (s + w) * (2 * d + 1) * w_item + batch * (s + w)
        ring += batch * hk * module.num_features * (d + 1) * w_item
        if cfg.decay != "none":
            ring += batch * hk * w * w_item
        if s and n - w < s:  # sink slots still to fill: a (B,) int64 count of them
            ring += 8 * batch
        return ring
    if w:
        keep = min(w, n)  # the window's raw keys and values
    elif cfg.resolved_local_kernel is not None:
        keep = n % cfg.block_size  # the keys of the current incomplete block
    else:
        keep = 0
    total = keep * key_value
    if path == "delta":  # the delta-rule state S, features x head_dim per kv head, after any key
        feats = d if module.delta_map is None else module.delta_map.num_features
        total += batch * hk * feats * d * w_item
    elif module.num_features and n > keep:  # a key was folded: phi(K)^T [V 1], (B, Hkv, F, D + 1)
        # in the dtype the path computes in: the working dtype, float64 for exact tensor features
        probe = torch.empty(0, device="meta", dtype=work)
        state_item = module.path_inputs(path, probe, probe, probe)[0].element_size()
        total += batch * hk * module.num_features * (d + 1) * state_item
    if w and s and n > w:  # the sink slots (all of them once a key left) + their flags
        total += s * key_value + batch * s
    if cfg.short_conv > 1:  # the convolution's last size - 1 inputs: the G queries and the key of each kv head
        total += batch * hk * (module.groups + 1) * (cfg.short_conv - 1) * d * w_item
    return total


def _sparse_state_bytes(module: PolyAttention, prompt: int, decoded: int, batch: int, item: int, w_item: int) -> int:
    """``_layer_state_bytes`` of a layer with ``sparse_cache`` m and blocks of C (``ops/sparse.py``). The ring: S + m +
    C + W slots of keys and [v 1] and their flags, the kernel inputs of the m + C cache and waiting slots (and their
    log-decays with decay), a (B,) count of waiting keys, the state, the window's log-gates. The generic state: the
    last W + C - 1 keys and values raw, the state (from the first call on), the cache's m keys and values (raw), flags,
    kernel inputs (where q/k maps or a convolution make them differ from the keys), log-decays (decay) and a (B,)
    count of kept keys of complete blocks, the sink slots once a block is complete. With ``sparse_score='attention'``
    both keep the last C queries (G per kv head), their flags and the cache's m scores (float32 at least)."""
    cfg = module.config
    hk, d, n, kdim = module.num_kv_heads, module.head_dim, prompt + decoded, module.kernel_dim
    s, w, m, chunk = cfg.sinks, cfg.window, cfg.sparse_cache, cfg.sparse_chunk
    decay = cfg.decay != "none"
    state = batch * hk * module.num_features * (d + 1) * w_item
    # sparse_score='attention': the last C queries (their dtype per state), their flags, the cache's scores
    queries = (cfg.sparse_score == "attention") * batch * hk * module.groups * chunk * d
    flags_scores = (queries > 0) * (batch * chunk + batch * hk * m * max(w_item, 4))
    if (decoded or prompt == 1) and _decodes_on_ring(module):
        slots = s + m + chunk + w
        ring = batch * hk * slots * (2 * d + 1) * w_item + batch * slots + state + 8 * batch
        ring += batch * hk * (m + chunk) * (kdim + decay) * w_item + decay * batch * hk * w * w_item
        if s and n - w < s:  # sink slots still to fill: a (B,) int64 count of them
            ring += 8 * batch
        return ring + queries * w_item + flags_scores  # the ring's queries in the working dtype
    key_value = 2 * batch * hk * d * item
    total = min(n, w + chunk - 1) * key_value + state + m * key_value + batch * hk * m + 8 * batch
    if module._maps_inputs or cfg.short_conv:
        total += batch * hk * m * kdim * w_item
    if decay:
        total += batch * hk * m * w_item
    if s and n - w >= chunk:  # a block is complete: the sink slots + their flags
        total += s * key_value + batch * s
    if cfg.short_conv > 1:
        total += batch * hk * (module.groups + 1) * (cfg.short_conv - 1) * d * w_item
    return total + queries * item + flags_scores  # the generic state's queries in the model's dtype


@dataclasses.dataclass(frozen=True)
class _KeptSliding:
    """A sliding-window layer kept exact (``ops/sliding.py``): its last ``window - 1`` keys and values while decoding,
    like transformers' ``DynamicSlidingWindowLayer``."""

    window: int
    num_kv_heads: int
    head_dim: int


def _polyattn_modules(model_or_config, dtype: torch.dtype) -> tuple[str | None, list]:
    """(kind, one entry per layer: its attention module, or ``_KeptSliding`` for a sliding layer kept exact): a
    model's own modules, or modules built from a config's ``polyattn`` settings and head sizes; (None, []) for a
    softmax model or config."""
    if isinstance(model_or_config, torch.nn.Module):
        found = []
        for m in model_or_config.modules():
            if isinstance(m._modules.get("polyattn"), AttentionBase):
                found.append(m._modules["polyattn"])
            elif m._modules.get("polyattn_sliding") is not None:
                _, head_dim, kv_heads = attention_dims(m)
                found.append(_KeptSliding(m._modules["polyattn_sliding"].window, kv_heads, head_dim))
        kinds = [f.config.kind for f in found if isinstance(f, AttentionBase)]
        return (kinds[0] if kinds else None), (found if kinds else [])
    config = model_or_config
    cfg = resolve_polyattn_config(config) if polyattn_kind(config) else None
    stored = getattr(config, CONFIG_KEY, None)
    if cfg is None and isinstance(stored, dict):  # a config read from disk without the kind as its implementation
        from ..config import PolyAttnConfig

        cfg = PolyAttnConfig.from_dict(stored)
    if cfg is None:
        return None, []
    if _sliding_layers(config) and cfg.sliding_layers == "exact":
        raise ValueError("decode_memory: a config with sliding-window layers kept exact: pass the converted model "
                         "(its layers say which are kept)")
    from ..ops import build_attention

    text = config.get_text_config(decoder=True)
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    with torch.device("meta"):  # sizes only: no memory, no random draws
        return cfg.kind, [build_attention(cfg, heads, head_dim, kv_heads, i).to(dtype)
                          for i in range(text.num_hidden_layers)]


def _sliding_layers(config) -> dict[int, int]:
    """layer -> window of the layers whose softmax cache (``DynamicCache(config=...)``) is a sliding window."""
    return {i: layer.sliding_window for i, layer in enumerate(DynamicCache(config=config).layers)
            if isinstance(layer, DynamicSlidingWindowLayer)}


def _model_dtype(model_or_config, dtype) -> torch.dtype:
    if dtype is not None:
        return getattr(torch, dtype) if isinstance(dtype, str) else dtype
    if isinstance(model_or_config, torch.nn.Module):
        return next((p.dtype for p in model_or_config.parameters() if p.is_floating_point()), torch.float32)
    stored = getattr(model_or_config.get_text_config(decoder=True), "dtype", None)
    if isinstance(stored, str) and stored != "auto":
        stored = getattr(torch, stored, None)
    return stored if isinstance(stored, torch.dtype) else torch.float32


def decode_memory(model_or_config, lengths=(4096, 16384, 32768), *, batch: int = 1, decoded: int = 0,
                  dtype: torch.dtype | str | None = None, capacity: int | None = None) -> DecodeMemory:
    """The bytes of a generation cache after prompts of ``lengths`` tokens, from the configs alone.

    ``model_or_config``: a polyattn model (or a softmax one), or its transformers config (``config.polyattn`` read,
    nothing loaded: the layers are built on the meta device for their sizes). ``dtype``: the weights' dtype
    (default: the model's, else the config's ``dtype``, else float32). ``batch``: unpadded rows. ``decoded``: tokens
    generated after the prompt (one by one, as ``generate()`` does; 0: right after the prompt's forward, one call).

    Softmax (``DynamicCache``): 2 x layers x kv_heads x head_dim x dtype bytes per token and row. A polyattn model
    (``PolyAttnCache``): per layer, its softmax kv heads' keys and values per token, in buffers with room for 1/8
    more tokens (at least 256: decoding writes in place), plus the other heads' constant state: the kernel state
    F x (head_dim + 1) per kv head in the working dtype (fp32 for half precision), the window's last ``window`` keys
    and values, ``sinks`` sink keys and values and their flags, the short convolution's last inputs; with
    ``local_exact`` the keys of the current incomplete block. While decoding, a windowed layer keeps these in its ring
    (``ops/decode.py``: the window and sink slots in the working dtype, their flags and log-gates). Padded prompts add
    a key padding flag (1 byte) per key kept and 8 bytes per row; not counted here. Raises ValueError for a kind
    whose state is not modelled and for a softmax config whose cache is not a plain ``DynamicCache`` of full layers
    (sliding-window layers). ``capacity``: the positions of the softmax heads' buffers when they are fixed, as
    ``capture_decode(model, max_length)`` makes them once decoding replays a graph (``max_length``, whatever the
    length); None: the growing buffers above.
    """
    if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1):
        raise ValueError(f"capacity must be an int >= 1 or None, got {capacity!r}")
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch must be an int >= 1, got {batch!r}")
    if isinstance(decoded, bool) or not isinstance(decoded, int) or decoded < 0:
        raise ValueError(f"decoded must be an int >= 0, got {decoded!r}")
    lengths = tuple(lengths)
    if not lengths or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in lengths):
        raise ValueError(f"lengths must be ints >= 1, got {lengths!r}")
    config = model_or_config.config if isinstance(model_or_config, torch.nn.Module) else model_or_config
    if not hasattr(config, "get_text_config"):
        raise TypeError(f"decode_memory needs a transformers model or config, got {type(model_or_config).__name__}")
    dt = _model_dtype(model_or_config, dtype)
    item = torch.empty((), dtype=dt).element_size()
    kind, modules = _polyattn_modules(model_or_config, dt)
    text = config.get_text_config(decoder=True)
    odd = {type(layer).__name__ for layer in DynamicCache(config=config).layers
           if type(layer) not in (DynamicLayer, DynamicSlidingWindowLayer)}
    if odd:
        raise ValueError(f"decode_memory: this model's DynamicCache has {sorted(odd)} layers, whose size is not "
                         "modelled")
    sliding = _sliding_layers(config)  # the softmax model's own sliding layers keep their last window - 1 keys
    if modules:  # the layers' own head sizes
        per_layer = [2 * batch * m.num_kv_heads * m.head_dim * item for m in modules]
    else:
        heads = text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        per_layer = [2 * batch * kv_heads * head_dim * item] * text.num_hidden_layers
    softmax_per_token = sum(b for i, b in enumerate(per_layer) if i not in sliding)
    softmax_total = tuple(sum(b * (min(n + decoded, sliding[i] - 1) if i in sliding else n + decoded)
                              for i, b in enumerate(per_layer)) for n in lengths)
    if not modules:
        return DecodeMemory(None, dt, batch, decoded, lengths, softmax_per_token, softmax_total, softmax_per_token,
                            softmax_total)
    work = work_dtype(dt)

    def layer_bytes(m, n):
        if isinstance(m, _KeptSliding):
            return 2 * batch * m.num_kv_heads * m.head_dim * item * min(n + decoded, m.window - 1)
        return _layer_state_bytes(m, n, decoded, batch, item, work, capacity)

    per_token = sum(0 if isinstance(m, _KeptSliding) else _kept_per_token(m, batch, item, work) for m in modules)
    total = tuple(sum(layer_bytes(m, n) for m in modules) for n in lengths)
    return DecodeMemory(kind, dt, batch, decoded, lengths, per_token, total, softmax_per_token, softmax_total)
