"""The vLLM plugin: serve converted folders with ``vllm serve DIR`` / ``LLM(model=DIR)``.

Installed with ``pip install 'hf_polyattn[vllm]'``; vLLM finds :func:`register` through the ``vllm.general_plugins``
entry point (``pyproject.toml``) in every process it starts, so nothing else is needed. A converted folder's
``architectures`` names ``PolyAttnLlamaForCausalLM`` (``serving.served_architecture``): :func:`register` maps each
such name to the plugin's model class (``models.py``), by string, so that vLLM imports the model code only when a
folder asks for it. Without the plugin vLLM refuses the name ("Model architectures [...] are not supported").

What the plugin serves (``models.check_servable`` refuses the rest at load, naming what is missing):
the Llama family as vLLM runs it (``LlamaForCausalLM``: SmolLM2, Llama), Qwen2, Qwen3 and Gemma 3 text (its
sliding-window layers vLLM's own, its global layers converted), with the linear kinds' windowed state
(window, sinks, gated decay, feature maps, q/k LayerNorm, feature projection, window mix) and any layout of softmax
kv heads (the ``long-context`` preset's hybrid, or none). Each softmax kv head runs through vLLM's own paged
``Attention``; the other heads keep a constant-size state per request in vLLM's state cache (``layer.py``).
"""

from __future__ import annotations

__all__ = ["ARCHITECTURES", "register"]

# served architecture name -> "module:class" of the plugin's model for it
ARCHITECTURES = {
    name: f"hf_polyattn.serving.vllm.models:{name}"
    for name in ("PolyAttnLlamaForCausalLM", "PolyAttnQwen2ForCausalLM", "PolyAttnQwen3ForCausalLM",
                 "PolyAttnGemma3ForCausalLM")
}


def register() -> None:
    """Register the plugin's models with vLLM's ``ModelRegistry`` (safe to call again: a name already registered
    is left as it is) and its config hook (``config_hook.py``: prefix caching switched off for these models, and on
    CUDA the kernel heads kept out of captured graphs)."""
    from vllm import ModelRegistry

    supported = set(ModelRegistry.get_supported_archs())
    for name, target in ARCHITECTURES.items():
        if name not in supported:
            ModelRegistry.register_model(name, target)
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP

    from .config_hook import PolyAttnServingConfig, add_splitting_op

    add_splitting_op()
    for name in ARCHITECTURES:
        MODELS_CONFIG_MAP.setdefault(name, PolyAttnServingConfig)
