"""vLLM's per-architecture config hook for the plugin's models (``MODELS_CONFIG_MAP``, filled by ``register``)."""

from __future__ import annotations

import logging

from vllm.model_executor.models.config import VerifyAndUpdateConfig

from .servable import STATE_LAYER_TYPE

logger = logging.getLogger(__name__)

PREFIX_CACHING_NOTE = (
    "hf_polyattn: prefix caching is switched off for this model. Its linear heads keep one state per request, "
    "written at the end of each scheduled chunk; vLLM's block-aligned state caching ('align') needs the state at "
    "every block boundary of a prompt, which the plugin does not write yet. A request whose prefix was cached would "
    "start from another request's state."
)


class PolyAttnServingConfig(VerifyAndUpdateConfig):
    @classmethod
    def verify_and_update_config(cls, vllm_config) -> None:
        # run before vLLM asks ModelConfig.is_hybrid (VllmConfig.try_verify_and_update_config), which is False for
        # a config whose layer_types are all full attention (Qwen2 / Qwen3): then no state would be planned for the
        # kernel heads (mamba_block_size unset). Those layers are named for what they are in vLLM: attention beside
        # a state (servable.STATE_LAYER_TYPE). Elsewhere vLLM 0.32 reads layer_types only to look for sliding or
        # linear-attention layers (neither is this), and its Qwen2 model asks that all layers have one type
        text = vllm_config.model_config.hf_text_config
        layer_types = getattr(text, "layer_types", None)
        if layer_types and all(t in ("attention", "full_attention") for t in layer_types):
            text.layer_types = [STATE_LAYER_TYPE] * len(layer_types)
        cache = vllm_config.cache_config
        if cache.enable_prefix_caching:
            logger.warning(PREFIX_CACHING_NOTE)
            cache.enable_prefix_caching = False
