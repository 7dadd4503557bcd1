"""vLLM's per-architecture config hook for the plugin's models (``MODELS_CONFIG_MAP``, filled by ``register``)."""

from __future__ import annotations

import logging

from vllm.model_executor.models.config import VerifyAndUpdateConfig

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
        cache = vllm_config.cache_config
        if cache.enable_prefix_caching:
            logger.warning(PREFIX_CACHING_NOTE)
            cache.enable_prefix_caching = False
