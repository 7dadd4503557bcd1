"""convert(model, config): swap a loaded model's attention for a polyattn kind, in place.

Persistence: ``save_pretrained`` writes ``"attn_implementation": KIND`` and
``"polyattn": {...PolyAttnConfig...}`` into config.json and the ``polyattn`` submodules'
tensors into the safetensors file; ``AutoModel*.from_pretrained(out)`` after
``import hf_polyattn`` rebuilds the same attention and loads those tensors.
"""

from __future__ import annotations

from itertools import chain
from typing import Any

import torch
from torch import nn
from transformers.modeling_utils import PreTrainedModel

from .. import registry
from ..config import PolyAttnConfig
from .cache import check_cache_layers, check_own_cache
from .compatibility import check_attention_module, check_model_options, find_attention_modules, mark_checked
from .layout import model_window, plan_layers
from .model_methods import prepare_model_instance
from .settings import check_supported_config, persist_settings
from .state import (
    HFPolyAttention,
    attach_polyattn,
    attach_sliding,
    get_polyattn_config,
    give_rope,
    sink_rope,
    sync_config,
)

__all__ = ["convert", "get_polyattn_config", "reconfigure"]


def _as_config(config: PolyAttnConfig | dict | str | None, overrides: dict[str, Any]) -> PolyAttnConfig:
    if config is None:
        config = PolyAttnConfig(**overrides) if overrides else PolyAttnConfig()
    elif isinstance(config, str):
        if not registry.is_kind(config):
            raise ValueError(f"unknown attention kind {config!r}; allowed: {list(registry.kind_names())}")
        config = PolyAttnConfig.for_kind(config, **overrides)
    elif isinstance(config, dict):
        config = PolyAttnConfig.from_dict({**config, **overrides})
    elif isinstance(config, PolyAttnConfig):
        # Always a validated copy: fields assigned after construction (cfg.qk_norm = "no", cfg.alpha = nan)
        # bypassed __post_init__, and later edits of the caller's object must not reach the model.
        config = config.replace(**overrides)
    else:
        raise TypeError(f"config must be a PolyAttnConfig, a dict of its fields or a kind name "
                        f"{list(registry.kind_names())}, got {type(config).__name__}")
    return config


def convert(model: PreTrainedModel, config: PolyAttnConfig | dict | str | None = None, **overrides: Any):
    """Give every attention layer of ``model`` polyattn attention (in place; returns ``model``).

    Args:
        model: a transformers ``PreTrainedModel`` whose attention modules call
            ``ALL_ATTENTION_FUNCTIONS`` (Llama, Mistral, Qwen2, GPT-2, GPT-NeoX, BERT,
            RoBERTa, DistilBERT, ...).
        config: a :class:`PolyAttnConfig`, a dict of its fields, or a kind name; every
            option of the kernels is available. ``None`` = ``PolyAttnConfig()``.
        **overrides: PolyAttnConfig fields replacing those of ``config``.

    Each attention module gets a fresh ``polyattn`` submodule initialised from
    ``config.seed`` and its layer index, on the device and dtype of the module's weights;
    a model's sliding-window layers stay its exact softmax over their window unless
    ``config.sliding_layers='kind'`` (``layout.py``; ``layer_layout(model)`` lists the roles).
    Converting again replaces them. Raises ``TypeError``/``ValueError`` (before changing
    anything) for a model that is not a transformers model, bypasses the attention
    interface, uses chunked attention, soft-caps the logits of a layer the kind converts where
    the layer cannot apply the cap (a kernel part without ``softcap_mode='exact_parts'``, or no exact part at all),
    has no layer left to convert (every layer sliding), keeps attention and a state-space mixer
    in one cache layer (Falcon-H1), keeps its cache in a class of its own (MiniMax), hands its attention function a
    mask it computes itself (Doge's per-head mask), passes its attention function an
    argument the kernels cannot honour (T5's ``position_bias``, attention sinks, ...), or has
    cross-attention with ``local_exact=True``.
    """
    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"convert() needs a transformers PreTrainedModel, got {type(model).__name__}")
    cfg = _as_config(config, overrides)
    if not type(model)._can_set_attn_implementation():
        raise ValueError(
            f"{type(model).__name__} does not route its attention through transformers' AttentionInterface "
            "(it computes softmax attention itself): hf_polyattn cannot replace it. Supported: models whose "
            "attention calls ALL_ATTENTION_FUNCTIONS (Llama, Mistral, Qwen2, GPT-2, GPT-NeoX, BERT, RoBERTa, "
            "DistilBERT, ...)."
        )
    found = find_attention_modules(model)
    if not found:
        raise ValueError(
            f"{type(model).__name__} has no attention module that calls ALL_ATTENTION_FUNCTIONS.get_interface: "
            "nothing for hf_polyattn to replace"
        )
    owner = type(model).__name__
    configs = {id(c): c for c in [model.config, *(mod.config for _, mod, _ in found)]}
    for c in configs.values():
        check_supported_config(c)
    check_cache_layers(model.config)  # a layer PolyAttnCache cannot hold: refused here, not in generate()
    check_own_cache(model)  # a cache class of the model's own (MiniMax): refused here, not at the first forward
    check_model_options(list(configs.values()), cfg, owner)
    windows = plan_layers(found, cfg, owner)  # sliding-window layers kept exact: their window, else None
    for (_, mod, idx), window in zip(found, windows):
        check_attention_module(mod, cfg, owner, exact_window=window is not None, layer_idx=idx)
        if window is None:
            sink_rope(mod, cfg, idx)  # a RoPE the sinks' positions cannot be read from: refused before anything changes
    for (_, mod, idx), window in zip(found, windows):
        if window is not None:
            attach_sliding(mod, window, idx)
            mark_checked(mod, owner)
            continue
        ref = next((p for p in mod.parameters() if p.is_floating_point()), None)
        device = ref.device if ref is not None else None
        dtype = ref.dtype if ref is not None else None
        old = mod._modules.pop("polyattn", None)  # replace, do not nest
        del old
        attach_polyattn(mod, cfg, idx, device=device or "cpu", dtype=dtype,
                        replaced_window=model_window(mod, idx, owner))
        mark_checked(mod, owner)
    # set_attn_implementation validates the name against the registry and recurses into sub-configs.
    model.set_attn_implementation(cfg.kind)
    for c in configs.values():
        persist_settings(c, cfg)
    for sub in model.modules():
        if isinstance(sub, PreTrainedModel):
            prepare_model_instance(sub)
    sync_config(model)
    return model


def reconfigure(model: PreTrainedModel, **changes: Any):
    """Change settings of a converted (or trained) model's attention that add, drop or reshape no tensor, keeping
    every trained tensor: e.g. ``reconfigure(model, sparse_cache=64)`` gives a transferred model LoLA's sparse cache
    training-free. In place; returns ``model``; ``save_pretrained`` then records the new settings.

    Raises ``ValueError`` (before changing anything) for a model without polyattn attention, a change of ``kind``,
    invalid settings, or a change that would add, drop or reshape a tensor of some layer (those need ``convert``,
    which starts the attention tensors afresh, and training).
    """
    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"reconfigure() needs a transformers PreTrainedModel, got {type(model).__name__}")
    old = get_polyattn_config(model)
    if old is None:
        raise ValueError(f"{type(model).__name__} has no polyattn attention to reconfigure: convert it first "
                         "(hf_polyattn.convert)")
    if "kind" in changes and changes["kind"] != old.kind:
        raise ValueError(f"reconfigure keeps the kind ({old.kind!r}); another kind needs convert(), which starts its "
                         f"tensors afresh, got kind={changes['kind']!r}")
    if "options" in changes:
        changes = {**changes, "options": {**old.options, **changes["options"]}}
    cfg = old.replace(**changes)  # validated
    if cfg.sliding_layers != old.sliding_layers:
        raise ValueError(f"reconfigure keeps the layers the kind runs in (sliding_layers={old.sliding_layers!r}); "
                         "converting a model's sliding-window layers or keeping them exact needs convert()")
    found = [(name, mod, idx) for name, mod, idx in find_attention_modules(model)
             if isinstance(getattr(mod, "polyattn", None), HFPolyAttention)]
    owner = type(model).__name__
    configs = {id(c): c for c in [model.config, *(mod.config for _, mod, _ in found)]}
    check_model_options(list(configs.values()), cfg, owner)
    for _, mod, idx in found:
        check_attention_module(mod, cfg, owner, layer_idx=idx)  # a soft-cap the new settings cannot apply too
    built = []
    for name, mod, idx in found:  # every layer built and checked before any is replaced
        current = mod.polyattn
        ref = next(chain(current.parameters(), current.buffers()), None)
        rope = sink_rope(mod, cfg)  # a RoPE the new settings cannot read is refused here
        with torch.device(ref.device if ref is not None else "cpu"):
            fresh = HFPolyAttention(cfg, current.num_heads, current.head_dim, current.num_kv_heads, idx)
        if ref is not None:
            fresh = fresh.to(ref.dtype)
        want, have = fresh.state_dict(), current.state_dict()
        moved = sorted(set(want) ^ set(have)) + sorted(k for k in set(want) & set(have)
                                                       if want[k].shape != have[k].shape)
        if moved:
            changed = sorted(k for k in changes if getattr(cfg, k, None) != getattr(old, k, None))
            raise ValueError(f"reconfigure: {changed} change the tensors of {name}.polyattn ({moved[:4]}): "
                             "that needs convert() and training, not a change of settings")
        fresh.load_state_dict(have)
        give_rope(fresh, mod, rope)
        fresh.softcap = current.softcap
        if any(getattr(m, "compile_decode", False) for m in current.modules()):  # compile_decode's choice stays
            compile_decode(fresh)
        built.append((mod, fresh))
    for mod, fresh in built:
        mod.polyattn = fresh
    for c in configs.values():
        persist_settings(c, cfg)
    sync_config(model)
    return model


def compile_decode(model: nn.Module, enabled: bool = True) -> int:
    """Decode ``model``'s windowed kernel heads with ``torch.compile`` (``enabled``) or eagerly (the default): every
    kernel layer's one-token step on its ring buffers (``ops.decode.ring_step``) runs compiled, which fuses its
    small operations; the first decoding steps compile (9 s in one run, 90 s in a later one after the step changed,
    for the demo's model on a 2-core CPU) and a later shape or branch compiles again. Same arithmetic: tested token
    by token against the eager step. Measured on the demo's model, 2-core CPU: 5-7 % slower than the eager step at
    4k / 16k tokens since the eager step got leaner (recipes/results/decode_floor/demo_compile; 2-5 % faster against
    the earlier eager step), so it stays off unless a machine measures it faster. In place; returns how many layers
    changed. ``ValueError`` for a model without polyattn kernel layers."""
    if not isinstance(enabled, bool):
        raise TypeError(f"compile_decode: enabled must be True or False, got {enabled!r}")
    from ..ops.attention import PolyAttention

    layers = [m for m in model.modules() if isinstance(m, PolyAttention)]
    if not layers:
        raise ValueError(f"compile_decode: {type(model).__name__} has no polyattn kernel layer to compile (convert it "
                         "first, hf_polyattn.convert; a model whose layers are all exact has no ring step)")
    for m in layers:
        m.compile_decode = enabled
    return len(layers)
