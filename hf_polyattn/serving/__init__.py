"""Serving engines: what a saved folder tells them, and the engine plugins (``serving/vllm``).

A converted folder keeps ``model_type`` (transformers builds the stock class and ``import hf_polyattn`` or the
folder's ``auto_map`` swaps its attention), but its ``architectures`` names a class no engine has:
``LlamaForCausalLM`` becomes ``PolyAttnLlamaForCausalLM``. An engine reads ``architectures`` to pick its own model
code (vLLM, SGLang, TGI, llama.cpp's converter), so without our plugin it refuses the folder instead of serving the
base model's softmax attention on the converted weights; with the plugin (``hf_polyattn[vllm]``) vLLM finds the
name in its registry.

Never imports transformers or vLLM: the plugin's ``register()`` lives in ``serving/vllm`` and imports vLLM there.
"""

from __future__ import annotations

__all__ = ["SERVED_PREFIX", "base_architecture", "served_architecture"]

# the prefix of every architecture name a converted folder is saved with
SERVED_PREFIX = "PolyAttn"


def served_architecture(name: str) -> str:
    """The name a converted folder records for transformers class ``name`` (``LlamaForCausalLM`` ->
    ``PolyAttnLlamaForCausalLM``); a name that already has the prefix is returned as it is."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty class name, got {name!r}")
    return name if name.startswith(SERVED_PREFIX) else SERVED_PREFIX + name


def base_architecture(name: str) -> str:
    """The transformers class a recorded architecture name stands for (``PolyAttnLlamaForCausalLM`` ->
    ``LlamaForCausalLM``); other names are returned as they are."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty class name, got {name!r}")
    return name[len(SERVED_PREFIX):] if name.startswith(SERVED_PREFIX) else name
