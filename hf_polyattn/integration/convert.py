"""convert(model, config): swap a loaded model's attention for a polyattn kind, in place.

Persistence: ``save_pretrained`` writes ``"attn_implementation": KIND`` and
``"polyattn": {...PolyAttnConfig...}`` into config.json and the ``polyattn`` submodules'
tensors into the safetensors file; ``AutoModel*.from_pretrained(out)`` after
``import hf_polyattn`` rebuilds the same attention and loads those tensors.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from transformers.modeling_utils import PreTrainedModel

from ..config import KINDS, PolyAttnConfig
from . import modules

__all__ = ["convert", "get_polyattn_config"]


def _as_config(config: PolyAttnConfig | dict | str | None, overrides: dict[str, Any]) -> PolyAttnConfig:
    if config is None:
        config = PolyAttnConfig(**overrides) if overrides else PolyAttnConfig()
    elif isinstance(config, str):
        if config not in KINDS:
            raise ValueError(f"unknown attention kind {config!r}; allowed: {list(KINDS)}")
        config = PolyAttnConfig(kind=config, **overrides)
    elif isinstance(config, dict):
        config = PolyAttnConfig.from_dict({**config, **overrides})
    elif isinstance(config, PolyAttnConfig):
        config = config.replace(**overrides) if overrides else config
    else:
        raise TypeError(f"config must be a PolyAttnConfig, a dict of its fields or a kind name {list(KINDS)}, "
                        f"got {type(config).__name__}")
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
    ``config.seed`` and its layer index, on the device and dtype of the module's weights.
    Converting again replaces them. Raises ``TypeError``/``ValueError`` for a model that is
    not a transformers model, bypasses the attention interface, or uses sliding windows.
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
    found = modules.find_attention_modules(model)
    if not found:
        raise ValueError(
            f"{type(model).__name__} has no attention module that calls ALL_ATTENTION_FUNCTIONS.get_interface: "
            "nothing for hf_polyattn to replace"
        )
    configs = {id(mod.config): mod.config for _, mod, _ in found}
    for c in configs.values():
        modules.check_supported_config(c)
    for _, mod, idx in found:
        ref = next((p for p in mod.parameters() if p.is_floating_point()), None)
        device = ref.device if ref is not None else None
        dtype = ref.dtype if ref is not None else None
        old = mod._modules.pop("polyattn", None)  # replace, do not nest
        del old
        modules.attach_polyattn(mod, cfg, idx, device=device or "cpu", dtype=dtype)
    # set_attn_implementation validates the name against the registry and recurses into sub-configs.
    model.set_attn_implementation(cfg.kind)
    for c in [model.config, *configs.values()]:
        modules.persist_settings(c, cfg)
    for sub in model.modules():
        if isinstance(sub, PreTrainedModel):
            modules.prepare_model_instance(sub)
    modules.sync_config(model)
    return model


def get_polyattn_config(model_or_config) -> PolyAttnConfig | None:
    """The PolyAttnConfig in use by a model (or stored in a transformers config), else None."""
    if isinstance(model_or_config, nn.Module):
        for m in model_or_config.modules():
            if isinstance(m, modules.HFPolyAttention):
                return m.config
        model_or_config = getattr(model_or_config, "config", None)
    if model_or_config is None:
        return None
    return modules.resolve_polyattn_config(model_or_config)
