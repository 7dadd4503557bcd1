"""vLLM's per-architecture config hook for the plugin's models (``MODELS_CONFIG_MAP``, filled by ``register``)."""

from __future__ import annotations

import logging

from vllm.config.compilation import CompilationConfig, CUDAGraphMode
from vllm.model_executor.models.config import VerifyAndUpdateConfig

from .servable import STATE_LAYER_TYPE

logger = logging.getLogger(__name__)

# the custom op the kernel heads run through (layer.py): Python control flow per request (slots, lengths, chunks)
KERNEL_HEADS_OP = "vllm::hf_polyattn_kernel_heads"

PREFIX_CACHING_NOTE = (
    "hf_polyattn: prefix caching is switched off for this model. Its linear heads keep one state per request, "
    "written at the end of each scheduled chunk; vLLM's block-aligned state caching ('align') needs the state at "
    "every block boundary of a prompt, which the plugin does not write yet. A request whose prefix was cached would "
    "start from another request's state."
)
GRAPHS_NOTE = (
    "hf_polyattn: CUDA graphs run piecewise for this model (cudagraph_mode {old} -> PIECEWISE). Its kernel heads "
    "choose per request, in Python, how to run each scheduled request on its state; a captured graph would replay "
    "the captured batch's choices for every later batch, so that op runs between the graphs (a splitting op, as "
    "vLLM's own state layers do), never inside one."
)


def graph_safe(compilation: CompilationConfig, cuda_alike: bool) -> None:
    """Keep the kernel heads' op out of every captured graph: a splitting op (where vLLM cuts its piecewise graphs,
    as at attention) and no full CUDA graphs. Only where graphs are captured (``cuda_alike``); on the CPU nothing
    changes."""
    if not cuda_alike:
        return
    if compilation.splitting_ops is not None and KERNEL_HEADS_OP not in compilation.splitting_ops:
        compilation.splitting_ops = [*compilation.splitting_ops, KERNEL_HEADS_OP]
    mode = compilation.cudagraph_mode
    if mode is None or mode.has_full_cudagraphs():
        if mode is not None:
            logger.warning(GRAPHS_NOTE.format(old=mode.name))
        compilation.cudagraph_mode = CUDAGraphMode.PIECEWISE


def add_splitting_op() -> None:
    """Make the kernel heads' op one of the ops vLLM splits its piecewise graphs at by default (a config whose
    ``splitting_ops`` is left unset takes this list)."""
    if KERNEL_HEADS_OP not in CompilationConfig._attention_ops:
        CompilationConfig._attention_ops.append(KERNEL_HEADS_OP)


class PolyAttnServingConfig(VerifyAndUpdateConfig):
    @classmethod
    def verify_and_update_config(cls, vllm_config) -> None:
        from vllm.platforms import current_platform

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
        graph_safe(vllm_config.compilation_config, current_platform.is_cuda_alike())
