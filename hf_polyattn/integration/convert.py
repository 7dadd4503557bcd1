"""convert(model, config): swap a loaded model's attention for a polyattn kind, in place.

Persistence: ``save_pretrained`` writes ``"attn_implementation": KIND`` and
``"polyattn": {...PolyAttnConfig...}`` into config.json and the ``polyattn`` submodules'
tensors into the safetensors file; ``AutoModel*.from_pretrained(out)`` after
``import hf_polyattn`` rebuilds the same attention and loads those tensors.
"""

from __future__ import annotations

from typing import Any

from transformers.modeling_utils import PreTrainedModel

from .. import registry
from ..config import PolyAttnConfig
from .cache import check_cache_layers
from .compatibility import check_attention_module, check_model_options, find_attention_modules, mark_checked
from .layout import model_window, plan_layers
from .model_methods import prepare_model_instance
from .settings import check_supported_config, persist_settings
from .state import attach_polyattn, attach_sliding, get_polyattn_config, sink_rope, sync_config

__all__ = ["convert", "get_polyattn_config"]


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
    interface, uses chunked attention, soft-caps the logits of a layer the kind converts,
    has no layer left to convert (every layer sliding), passes its attention function an
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
    check_model_options(list(configs.values()), cfg, owner)
    windows = plan_layers(found, cfg, owner)  # sliding-window layers kept exact: their window, else None
    for (_, mod, idx), window in zip(found, windows):
        check_attention_module(mod, cfg, owner, exact_window=window is not None)
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
