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

CHUNKED_PREFILL_NOTE = (
    "hf_polyattn: chunked prefill is switched off for this model (sparse_observe={observe}). Its sparse cache is "
    "chosen again by the last queries of every call of more than one token, over the keys of that call; transformers' "
    "generate() prefills a prompt in one call, and a prompt split into chunks would be chosen again at each chunk's "
    "end over that chunk's keys only (different tokens). Each prompt is prefilled in one step "
    "(max_num_batched_tokens={tokens} >= max_model_len={length})."
)


def whole_prompts(scheduler, max_model_len: int, observe: int, speculative) -> None:
    """A folder whose sparse cache is chosen again at the end of every multi-token call (``sparse_observe``) runs
    each prompt in one call, as transformers' ``generate()`` does: chunked prefill switched off (with a warning)
    where every prompt fits one step; a ValueError naming the setting where it does not, where a prefill would still
    be split (``long_prefill_token_threshold``), or with speculative decoding (multi-token calls after the
    prompt)."""
    if not observe:
        return
    why = (f"the folder's sparse cache is chosen again at the end of every call of more than one token "
           f"(sparse_observe={observe}), so a prompt must be prefilled in one call, as transformers' generate() does")
    if speculative is not None:
        raise ValueError(f"hf_polyattn: speculative decoding is refused for this model: {why}; speculative tokens "
                         "would be such a call")
    if scheduler.long_prefill_token_threshold:
        raise ValueError(f"hf_polyattn: long_prefill_token_threshold={scheduler.long_prefill_token_threshold} splits "
                         f"long prompts into chunks, refused for this model: {why}; leave it 0")
    if scheduler.max_num_batched_tokens < max_model_len:
        raise ValueError(f"hf_polyattn: max_num_batched_tokens={scheduler.max_num_batched_tokens} is below "
                         f"max_model_len={max_model_len}, so a long prompt would be prefilled in chunks, refused for "
                         f"this model: {why}. Set max_num_batched_tokens >= max_model_len (or a smaller max_model_len)")
    if scheduler.enable_chunked_prefill:
        logger.warning(CHUNKED_PREFILL_NOTE.format(observe=observe, tokens=scheduler.max_num_batched_tokens,
                                                   length=max_model_len))
        # with chunked prefill off vLLM's scheduler waits for a step with room for the whole prompt instead of
        # scheduling part of it (v1/core/sched/scheduler.py)
        scheduler.enable_chunked_prefill = False


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
        stored = getattr(text, "polyattn", None)  # a folder without settings is refused by name at load (servable.py)
        if isinstance(stored, dict) and stored.get("sparse_cache"):
            whole_prompts(vllm_config.scheduler_config, vllm_config.model_config.max_model_len,
                          int(stored.get("sparse_observe") or 0), vllm_config.speculative_config)
