"""What the vLLM plugin serves, read from a folder's config; everything else refused by name at load.

Imports neither vLLM nor anything that needs it: the checks run (and are tested) in the package's own venv too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ...config import PolyAttnConfig
from ...ops import build_attention
from ...ops.base import softmax_heads_of
from ...ops.decode import ring_decodes
from ...ops.packed import PackedLayout, RingLayout, pack, pack_ring, ring_from_state

__all__ = ["StatePlan", "check_servable", "converted_layer", "layer_type", "polyattn_config", "request_bytes",
           "request_pages", "rope_parameters", "state_layout", "state_plan"]

# model_type of the folders each served architecture runs (vLLM's model code the plugin reuses)
MODEL_TYPES = {"PolyAttnLlamaForCausalLM": ("llama",), "PolyAttnQwen2ForCausalLM": ("qwen2",),
               "PolyAttnQwen3ForCausalLM": ("qwen3",), "PolyAttnGemma3ForCausalLM": ("gemma3_text",)}
# the families whose sliding-window layers (config.layer_types) stay vLLM's own sliding-window attention, as
# transformers keeps them exact (sliding_layers='exact'); the others' sliding layers are refused (vLLM's Qwen2 model
# itself refuses some sliding layers beside full ones)
SLIDING_FAMILIES = ("gemma3_text",)
# what config_hook.py writes over a config.layer_types of full-attention layers only (Qwen2 / Qwen3 record one): vLLM
# takes a model whose layer_types are all "full_attention" for a plain transformer whatever its class says
# (ModelConfig.is_hybrid), and would plan no state for the kernel heads
STATE_LAYER_TYPE = "hf_polyattn_attention"
# RoPE types whose rotation is inv_freq alone (vLLM's cos/sin carry no extra scale): what the sinks' queries are
# turned with (sink_position='window'); YaRN and LongRoPE scale cos/sin as well
ROPE_TYPES = ("default", "llama3")

_REFUSED = "hf_polyattn's vLLM plugin cannot serve this folder: {why}. It serves {what}."
_WHAT = ("the Llama family (model_type 'llama': SmolLM2, Llama), Qwen2, Qwen3 and Gemma 3 text (gemma3_text: its "
         "sliding-window layers kept exact, sliding_layers='exact', the global layers converted) with a windowed "
         "linear-time kind (window, sinks, gated decay, feature maps, q/k LayerNorm, feature projection, window mix, "
         "the bounded sparse cache: sparse_cache, sparse_score, sparse_value_keys, sparse_observe with each prompt in "
         "one step) "
         "and any layout of softmax kv heads; load other folders with transformers (import hf_polyattn)")


def _refuse(why: str) -> ValueError:
    return ValueError(_REFUSED.format(why=why, what=_WHAT))


def polyattn_config(config) -> PolyAttnConfig:
    """The PolyAttnConfig a folder's config.json records (``config.polyattn``); ValueError without one."""
    stored = getattr(config, "polyattn", None)
    if not isinstance(stored, dict):
        raise _refuse("its config.json has no hf_polyattn settings ('polyattn')")
    if stored.get("sinks") and "sink_position" not in stored:
        stored = {**stored, "sink_position": "own"}  # saved before sink_position existed (integration/settings.py)
    return PolyAttnConfig.from_dict(stored)


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def state_layout(config, head_dim: int | None = None,
                 key_dtype: torch.dtype | None = None) -> PackedLayout | RingLayout:
    """The state buffers every converted layer of ``config``'s model shares: as many kv heads as the layer with the
    most kernel heads has; the ``WindowRing`` a windowed layer decodes on (``ops.packed.RingLayout``: a step writes
    the slot in place) where the kind decodes on one, else the ``RecurrentState``'s (``ops.packed.PackedLayout``)."""
    cfg = polyattn_config(config)
    d = head_dim or _head_dim(config)
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    groups = config.num_attention_heads // kv_heads
    # over the converted layers only (Gemma 3's sliding layers stay vLLM's own attention)
    heads = max((kv_heads - len(softmax_heads_of(cfg, i)) for i in range(config.num_hidden_layers)
                 if converted_layer(config, i)), default=1)
    one = build_attention(cfg.replace(softmax_heads=None), groups, d, 1, 0)  # one kv head: its feature width
    dtype = key_dtype if key_dtype is not None else _dtype(config)
    if ring_decodes(one):
        # a sparse cache's slots, kernel inputs, waiting block and (sparse_score='attention') last queries and scores
        # are sized by the config: the ring stays fixed-size (ops.packed.RingLayout)
        sparse = {} if not cfg.sparse_cache else dict(
            cache=cfg.sparse_cache, chunk=cfg.sparse_chunk, kernel_dim=one.kernel_dim, groups=groups,
            attention=cfg.sparse_score == "attention", observe=cfg.sparse_observe)
        return RingLayout(heads=max(heads, 1), features=one.num_features, head_dim=d, window=cfg.window,
                          sinks=cfg.sinks, decay=cfg.decay != "none", key_dtype=dtype, **sparse)
    # a kind without a kernel state (sliding_window: exact softmax over the window and the sinks) keeps no kv sum: a
    # one-wide buffer it never writes
    return PackedLayout(heads=max(heads, 1), features=max(one.num_features, 1), head_dim=d,
                        keys=max(cfg.window, cfg.block_size), sinks=cfg.sinks, key_dtype=dtype)


@dataclass(frozen=True)
class StatePlan:
    """Which vLLM state layer holds each converted layer's kernel-head state: the layers with kernel heads
    (``layers``, in order) in runs of ``per_module``, each run one state layer whose buffers stack its layers' slots
    (a leading dimension of ``per_module``). ``place(i)`` is (the run's first layer, i's index in the run)."""

    layers: tuple[int, ...]
    per_module: int

    @property
    def modules(self) -> int:
        return -(-len(self.layers) // self.per_module)

    def place(self, layer: int) -> tuple[int, int]:
        n = self.layers.index(layer)
        return self.layers[n - n % self.per_module], n % self.per_module


# vLLM 0.32's block alignment on the CPU (its default block size there, 128 tokens: ``CpuPlatform``); the plan
# only ranks candidates with it, so another backend's alignment changes a rounding, not which plan wins
_ALIGN_TOKENS = 128


def request_pages(softmax_layers: int, state_layers: int, state_page: int, token_bytes: int,
                  head_token_bytes: int, tokens: int, align: int = _ALIGN_TOKENS) -> tuple[int, int, int]:
    """(pages, group size, page bytes): what one request of ``tokens`` takes from vLLM's KV pool, following vLLM
    0.32's rules for a hybrid model. The attention block is rounded up so that its page (at the config's kv heads,
    ``token_bytes`` a token) holds a state page (``_align_hybrid_block_size``), every page is that size, and the
    layers are grouped with one group size for both kinds, the larger count when it is under 1.5x the smaller,
    else the smaller, padding the last group of each kind (``_get_kv_cache_groups_uniform_page_size``). A request
    takes one page per state group and one per block of ``tokens`` per attention group; the pool is counted in
    pages of the group size times the page."""
    if softmax_layers == 0:
        return state_layers, 1, state_page
    page = align * math.ceil(state_page / (align * token_bytes)) * token_bytes
    block = page // head_token_bytes  # tokens in one page of a one-kv-head attention layer
    low, high = sorted((softmax_layers, state_layers))
    group = high if high < 1.5 * low else low
    pages = math.ceil(softmax_layers / group) * math.ceil(tokens / block) + math.ceil(state_layers / group)
    return pages, group, page


def request_bytes(*args, **kwargs) -> int:
    """Bytes of vLLM's KV pool one request takes (``request_pages``' arguments)."""
    pages, group, page = request_pages(*args, **kwargs)
    return pages * group * page


def state_plan(config, tokens: int, key_dtype: torch.dtype | None = None) -> StatePlan:
    """The ``StatePlan`` that makes a request of ``tokens`` (vLLM's ``max_model_len``) take the least KV memory.

    Each softmax kv head is one attention layer of one kv head and each state layer a page, and vLLM pads both to
    one page size and one group size (``request_bytes``). One state layer per converted layer pads badly: the demo's
    attention on SmolLM2-135M (22 softmax kv heads, 29 layers with kernel heads) gets groups of 29, 7 of them empty
    attention layers, and a state page padded by 53%: 31.3 sequences of 8,017 tokens in 4 GiB (vLLM's count in
    an earlier bench record). The plan is the cheapest of every run length by ``request_bytes``, which
    ``tests/serving`` checks against vLLM's own count."""
    cfg = polyattn_config(config)
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    converted = [i for i in range(config.num_hidden_layers) if converted_layer(config, i)]
    softmax = {i: len(softmax_heads_of(cfg, i)) for i in converted}
    layers = tuple(i for i in converted if softmax[i] < kv_heads)
    if len(converted) < config.num_hidden_layers:
        # vLLM's own attention layers beside the converted ones (Gemma 3's sliding layers, all kv heads each): a
        # third page size the cost model does not follow; one state layer per layer, as tests/serving serves them
        return StatePlan(layers, 1)
    layout = state_layout(config, key_dtype=key_dtype)
    dtype = key_dtype if key_dtype is not None else _dtype(config)
    head_token = 2 * _head_dim(config) * torch.empty((), dtype=dtype).element_size()
    best, attention = None, sum(softmax.values())
    for per in range(1, len(layers) + 1):
        cost = request_bytes(attention, -(-len(layers) // per), per * layout.nbytes(), kv_heads * head_token,
                             head_token, tokens)
        if best is None or cost < best[0]:
            best = (cost, per)
    return StatePlan(layers, best[1] if best else 1)


def _dtype(config) -> torch.dtype:
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


def layer_type(config, layer_idx: int) -> str:
    """``config.layer_types[layer_idx]`` ('full_attention' without one, and where config_hook.py renamed it)."""
    layer_types = getattr(config, "layer_types", None) or ()
    kind = layer_types[layer_idx] if layer_idx < len(layer_types) else "full_attention"
    return "full_attention" if kind == STATE_LAYER_TYPE else kind


def converted_layer(config, layer_idx: int) -> bool:
    """Whether decoder layer ``layer_idx`` of ``config``'s model runs the converted attention: every layer, except a
    sliding-window layer (``layer_types``) that the conversion kept exact (``sliding_layers='exact'``, as
    ``integration.settings.config_sliding`` reads it) in a family whose sliding layers the plugin keeps vLLM's."""
    return not (layer_type(config, layer_idx) == "sliding_attention"
                and getattr(config, "model_type", None) in SLIDING_FAMILIES
                and polyattn_config(config).sliding_layers == "exact")


def rope_parameters(config, layer_idx: int) -> dict:
    """The RoPE parameters of layer ``layer_idx``: Gemma 3 keeps one set per layer type."""
    rope = getattr(config, "rope_parameters", None) or {}
    kind = layer_type(config, layer_idx)
    return rope[kind] if isinstance(rope.get(kind), dict) else rope


def _check_family(config, cfg: PolyAttnConfig) -> None:
    """What a family's attention does that the plugin's layer does not, refused by name (transformers applies it,
    so serving without it would be silently different)."""
    model_type = config.model_type
    if getattr(config, "is_causal", True) is False or getattr(config, "use_bidirectional_attention", False):
        raise _refuse("bidirectional attention (is_causal=False / use_bidirectional_attention) is not implemented "
                      "in the plugin: it serves causal decoders")
    layer_types = getattr(config, "layer_types", None) or ()
    other = sorted(set(layer_types) - {"full_attention", "sliding_attention", STATE_LAYER_TYPE})
    if other:
        raise _refuse(f"layer types {other} (config.layer_types) are not implemented in the plugin")
    if model_type in SLIDING_FAMILIES:
        if cfg.sliding_layers != "exact" and "sliding_attention" in layer_types:
            raise _refuse(f"sliding_layers={cfg.sliding_layers!r} (the kind in the model's sliding-window layers) "
                          "is not implemented in the plugin; it keeps them exact (sliding_layers='exact')")
        if getattr(config, "attn_logit_softcapping", None) is not None:
            # vLLM's Gemma 3 passes no soft-cap to its attention; transformers caps every score
            raise _refuse(f"attention logit soft-capping (attn_logit_softcapping={config.attn_logit_softcapping}) is "
                          "not implemented in the plugin")
    elif getattr(config, "sliding_window", None) and layer_types:
        raise _refuse("sliding-window layers (layer_types) are not implemented in the plugin for model_type "
                      f"{model_type!r}")
    if model_type == "qwen2" and getattr(config, "qk_norm", False):
        # vLLM's Qwen2 norms q and k where config.qk_norm is set (BAGEL); transformers' Qwen2 has no such norm
        raise _refuse("qk_norm=True on a Qwen2 config (transformers' Qwen2 has no q/k norm)")


def check_servable(config, architecture: str) -> PolyAttnConfig:
    """The folder's PolyAttnConfig when the plugin serves ``config`` as ``architecture``; ValueError naming what is
    missing otherwise (never served as softmax, never silently different)."""
    model_type = getattr(config, "model_type", None)
    if model_type not in MODEL_TYPES.get(architecture, ()):
        raise _refuse(f"{architecture} runs model_type {MODEL_TYPES.get(architecture)}, the folder's is "
                      f"{model_type!r}")
    cfg = polyattn_config(config)
    if cfg.kind in ("polysketch", "polynomial"):
        raise _refuse(f"kind {cfg.kind!r} keeps no constant-size state the plugin implements")
    _check_family(config, cfg)
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    converted = [i for i in range(config.num_hidden_layers) if converted_layer(config, i)]
    if all(len(softmax_heads_of(cfg, i)) == kv_heads for i in converted):
        raise _refuse("every kv head of the converted layers is softmax: serve the base model")
    for i in converted:
        rope = rope_parameters(config, i)
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if cfg.sinks and cfg.sink_position == "window" and rope_type not in ROPE_TYPES:
            raise _refuse(f"sinks scored at window positions re-rotate queries with the model's RoPE, and RoPE type "
                          f"{rope_type!r} (layer {i}) is not one the plugin reads ({', '.join(ROPE_TYPES)})")
    _probe(cfg, config)
    return cfg


def _probe(cfg: PolyAttnConfig, config) -> None:
    """Run the kind's module for one kv head past its window and sinks, and pack its state: a kind or option whose
    state the layout has no room for is refused here, at load, by the field it needs."""
    d = _head_dim(config)
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    groups = config.num_attention_heads // kv_heads
    module = build_attention(cfg.replace(softmax_heads=None), groups, d, 1, 0)
    layout = state_layout(config, d, torch.float32)
    if cfg.sparse_cache and not isinstance(layout, RingLayout):
        raise _refuse(f"sparse_cache={cfg.sparse_cache} is served on the decoding ring only (ops.packed.RingLayout), "
                      f"and kind {cfg.kind!r} with these settings (short_conv, learned_sinks or no window) does not "
                      "decode on one")
    # past the window and the sinks, and with a sparse cache past its first block's selection
    n = max(cfg.window, cfg.block_size) + cfg.sinks + (cfg.sparse_chunk if cfg.sparse_cache else 0) + 3
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, groups, n, d, generator=gen)
    k = torch.randn(1, 1, n, d, generator=gen)
    with torch.no_grad():
        _, state = module(q, k, k, causal=True, state=module.init_state())
        _, state = module(q[:, :, :1], k[:, :, :1], k[:, :, :1], causal=True, state=state)
    try:
        if isinstance(layout, RingLayout):
            pack_ring(ring_from_state(module, state, layout), [b[0] for b in layout.empty(1)], layout)
        else:
            pack(state, [b[0] for b in layout.empty(1)], layout)
    except (TypeError, ValueError) as err:
        raise _refuse(f"kind {cfg.kind!r} with these settings keeps a state the plugin does not pack ({err})") from None
