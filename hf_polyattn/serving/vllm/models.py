"""The plugin's model classes: vLLM's own model code for each family, with ``layer.PolyAttnAttention`` swapped in.

vLLM's ``LlamaForCausalLM`` takes the decoder layer class, and its decoder layer the attention class, as arguments:
the subclasses below pass ours and add what vLLM asks of a model that keeps per-request state beside its KV cache
(``IsHybrid``: the state's shapes and dtypes from the config alone; ``HasInnerState``).
"""

from __future__ import annotations

from vllm.model_executor.layers.mamba.mamba_utils import get_temporal_copy_spec
from vllm.model_executor.models.interfaces import HasInnerState, IsHybrid
from vllm.model_executor.models.llama import LlamaDecoderLayer, LlamaForCausalLM

from .layer import PolyAttnAttention
from .servable import check_servable, state_layout, state_plan

__all__ = ["PolyAttnLlamaForCausalLM"]


class PolyAttnLlamaDecoderLayer(LlamaDecoderLayer):
    def __init__(self, vllm_config, prefix: str = "", config=None) -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix, config=config, attn_layer_type=PolyAttnAttention)


class _StateShapes:
    """``IsHybrid``'s class methods for every family: the layout of ``servable.state_layout``."""

    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config):
        # what KernelHeadsState.get_state_shape gives: each layout buffer stacked over a run of layers
        model = vllm_config.model_config
        per = state_plan(model.hf_config, model.max_model_len, model.dtype).per_module
        return tuple((per, *shape) for shape in state_layout(model.hf_config, key_dtype=model.dtype).shapes())

    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config):
        return state_layout(vllm_config.model_config.hf_config, key_dtype=vllm_config.model_config.dtype).dtypes()

    @classmethod
    def get_mamba_state_copy_func(cls):
        # each buffer is one request's whole state (no per-token part): copied whole, as vLLM's linear attention
        return (get_temporal_copy_spec,) * 6


class PolyAttnLlamaForCausalLM(_StateShapes, LlamaForCausalLM, HasInnerState, IsHybrid):
    """A converted Llama-family folder (``architectures: PolyAttnLlamaForCausalLM``) in vLLM."""

    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        check_servable(vllm_config.model_config.hf_config, "PolyAttnLlamaForCausalLM")
        super().__init__(vllm_config=vllm_config, prefix=prefix, layer_type=PolyAttnLlamaDecoderLayer)
