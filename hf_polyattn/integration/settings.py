"""What a transformers config says about polyattn: the stored settings, and config-level refusals.

``save_pretrained`` drops ``config._attn_implementation``, so the kind and its
:class:`PolyAttnConfig` are written as plain config attributes (``attn_implementation``,
``polyattn``) that config.json keeps and ``from_pretrained`` reads back. Nothing here
touches modules: it is imported by every other integration module and imports none of them.
"""

from __future__ import annotations

import logging
import os
import re

from transformers.configuration_utils import PreTrainedConfig

from .. import registry
from ..config import PolyAttnConfig

logger = logging.getLogger(__name__)

__all__ = [
    "BASE_MODEL_KEY",
    "CONFIG_KEY",
    "REQUIRES_KEY",
    "check_supported_config",
    "config_sliding",
    "hub_model_id",
    "persist_settings",
    "polyattn_kind",
    "resolve_polyattn_config",
]

# Config attributes written to config.json (read back by from_pretrained / our hook).
CONFIG_KEY = "polyattn"
BASE_MODEL_KEY = "polyattn_base_model"
# Without the plugin, transformers' error only names the kind ("Specified
# attn_implementation="polysketch" is not supported"): config.json says what to import.
REQUIRES_KEY = "polyattn_requires"
REQUIRES_NOTE = "pip install hf_polyattn; `import hf_polyattn` before from_pretrained registers this attention"

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def hub_model_id(name: str | None) -> str | None:
    """The Hub repo id ``name`` stands for: ``name`` if it looks like one (``org/model``) rather than a local path;
    the id of a checkpoint ``hf_polyattn.checkpoints`` resolves offline, given by alias or local copy (the
    de-quantised SmolLM2 -> ``HuggingFaceTB/SmolLM2-135M-Instruct``); None otherwise."""
    from ..checkpoints import known_hub_id

    known = known_hub_id(name)
    if known is not None:
        return known
    if not name or not isinstance(name, str) or os.path.isdir(name) or not _HUB_ID.match(name):
        return None
    return name


def persist_settings(config: PreTrainedConfig, cfg: PolyAttnConfig) -> None:
    """Write the attention settings as config attributes that save_pretrained serialises."""
    config.attn_implementation = cfg.kind  # read back by from_pretrained (PreTrainedConfig.__init__)
    setattr(config, CONFIG_KEY, cfg.to_dict())
    setattr(config, REQUIRES_KEY, REQUIRES_NOTE)


def polyattn_kind(config) -> str | None:
    """The polyattn kind a transformers config runs with, or None (softmax, another implementation)."""
    if not isinstance(config, PreTrainedConfig):
        return None
    kind = getattr(config, "_attn_implementation", None)
    return kind if registry.is_kind(kind) else None


def resolve_polyattn_config(config: PreTrainedConfig) -> PolyAttnConfig | None:
    """The PolyAttnConfig a transformers config asks for, or None for other attention.

    ``config.polyattn`` (from config.json or ``convert``) when its kind matches
    ``config._attn_implementation``; otherwise the kind's defaults (a stock checkpoint
    loaded with ``attn_implementation=KIND``). Settings saved with sinks before ``sink_position`` existed read as
    ``sink_position='own'``, what they were saved with.
    """
    kind = polyattn_kind(config)
    if kind is None:
        return None
    stored = getattr(config, CONFIG_KEY, None)
    if isinstance(stored, dict) and stored.get("sinks") and "sink_position" not in stored:
        # saved before sink_position existed, when sinks were always scored at their own positions: a reload keeps
        # the attention it was saved (and maybe trained) with
        logger.info("config.json's polyattn settings predate sink_position: its %s sinks keep their own positions "
                    "(sink_position='own')", stored["sinks"])
        stored = {**stored, "sink_position": "own"}
    if isinstance(stored, (PolyAttnConfig, dict)):
        try:  # a PolyAttnConfig is validated again: fields assigned after construction skipped __post_init__
            cfg = stored.replace() if isinstance(stored, PolyAttnConfig) else PolyAttnConfig.from_dict(stored)
        except (TypeError, ValueError) as err:
            where = f"config.{CONFIG_KEY}" if isinstance(stored, PolyAttnConfig) else f"config.json key {CONFIG_KEY!r}"
            raise ValueError(f"{where} is not a valid PolyAttnConfig: {err}") from err
    elif stored is None:
        cfg = PolyAttnConfig.for_kind(kind)
    else:
        raise ValueError(f"config.{CONFIG_KEY} must be a dict of PolyAttnConfig fields, got {type(stored).__name__}")
    if cfg.kind != kind:
        logger.warning(
            "attn_implementation=%r overrides the stored polyattn settings of kind %r: using the defaults of %r",
            kind, cfg.kind, kind,
        )
        cfg = PolyAttnConfig.for_kind(kind)
    return cfg


def config_sliding(config: PreTrainedConfig, layer_idx: int) -> bool:
    """Whether a model config makes layer ``layer_idx`` a sliding-window layer: ``config.layer_types[layer_idx] ==
    'sliding_attention'`` (Gemma 2 / 3, Qwen2, OLMo 3, EXAONE 4, Ministral, ModernBERT), or, for a config without
    layer types, a set ``config.sliding_window`` (Mistral, Phi-3, Starcoder2: the window on every layer) unless
    ``use_sliding_window`` is False. What the model's masks follow; ``layout.py`` checks that the attention call
    agrees."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return 0 <= layer_idx < len(layer_types) and layer_types[layer_idx] == "sliding_attention"
    windowed = getattr(config, "sliding_window", None) is not None
    return windowed and getattr(config, "use_sliding_window", True) is not False


def check_supported_config(config: PreTrainedConfig) -> None:
    """Refuse model configs whose attention the kernels cannot reproduce: chunked attention (Llama 4's
    ``attention_chunk_size``, ``chunked_attention`` layers), a pattern a 2-D padding mask cannot express, and an
    ALiBi bias (``config.alibi``: Falcon adds it to the mask it hands the attention function).

    Sliding-window layers are no longer refused here: ``layout.py`` decides per layer (kept exact, or converted on
    request), and logit soft-capping is checked where it is passed, per attention module (``compatibility.py``):
    a sliding layer kept exact applies it, a converted layer applies it in its exact parts
    (``PolyAttnConfig.softcap_mode``) or refuses it.
    """
    layer_types = getattr(config, "layer_types", None)
    if "chunked_attention" in (layer_types or []):
        raise ValueError(
            "hf_polyattn does not implement ['chunked_attention'] layers (config.layer_types): its kernels attend to "
            "the whole causal past and chunked attention resets at every chunk boundary"
        )
    if getattr(config, "alibi", None) is True:
        # Falcon (transformers >= 5.25, which routes it through AttentionInterface) adds the ALiBi bias to the 4-D
        # mask it hands the attention function: refused here rather than at the first forward
        raise ValueError(
            f"config.alibi=True (model_type={getattr(config, 'model_type', None)!r}): the model adds an ALiBi position "
            "bias to the attention scores, added to the attention mask it hands the attention function; hf_polyattn "
            "attention uses the mask for padding only and cannot apply a position bias (BLOOM, MPT and ALiBi Falcon "
            "are not supported)")
    if getattr(config, "attention_chunk_size", None) is not None:
        raise ValueError("config.attention_chunk_size is set: chunked attention is not supported by hf_polyattn; "
                         "set it to None")
