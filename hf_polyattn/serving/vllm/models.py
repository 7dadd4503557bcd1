"""The plugin's model classes: vLLM's own model code for each family, with ``layer.PolyAttnAttention`` swapped in.

vLLM's ``LlamaForCausalLM`` takes the decoder layer class, and its decoder layer the attention class, as arguments:
the subclasses below pass ours and add what vLLM asks of a model that keeps per-request state beside its KV cache
(``IsHybrid``: the state's shapes and dtypes from the config alone; ``HasInnerState``).

Qwen2, Qwen3 and Gemma 3 build their attention (and Qwen2 / Gemma 3 their decoder layer, every ``ForCausalLM`` its
model) by name inside ``__init__``, with no argument to pass another: their subclasses below repeat those
constructors (vLLM 0.32's, marked "as vLLM's") with our attention and keep everything else of vLLM's (forward, weight
loading, norms, MLPs). Gemma 3's sliding-window layers stay vLLM's own ``Gemma3DecoderLayer`` (its sliding-window
``Attention``): transformers keeps them exact softmax too (``PolyAttnConfig.sliding_layers='exact'``).
"""

from __future__ import annotations

import torch
from torch import nn
from vllm.compilation.decorators import support_torch_compile
from vllm.distributed import get_pp_group
from vllm.model_executor.layers.layernorm import GemmaRMSNorm, RMSNorm
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.mamba.mamba_utils import get_temporal_copy_spec
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.models.gemma3 import Gemma3DecoderLayer, Gemma3ForCausalLM, Gemma3MLP, Gemma3Model
from vllm.model_executor.models.interfaces import HasInnerState, IsHybrid
from vllm.model_executor.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from vllm.model_executor.models.qwen2 import Qwen2DecoderLayer, Qwen2ForCausalLM, Qwen2MLP, Qwen2Model
from vllm.model_executor.models.qwen3 import Qwen3DecoderLayer, Qwen3ForCausalLM, Qwen3Model
from vllm.model_executor.models.utils import (
    PPMissingLayer,
    extract_layer_index,
    make_empty_intermediate_tensors_factory,
    make_layers,
    maybe_prefix,
)
from vllm.transformers_utils.config import set_default_rope_theta

from .layer import PolyAttnAttention
from .servable import check_servable, converted_layer, rope_parameters, state_layout, state_plan

__all__ = ["PolyAttnGemma3ForCausalLM", "PolyAttnLlamaForCausalLM", "PolyAttnQwen2ForCausalLM",
           "PolyAttnQwen3ForCausalLM"]


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


def _qwen_layer(layer: nn.Module, config, cache_config, quant_config, prefix: str, *, bias: bool, bias_o_proj: bool,
                qk_norm: type[nn.Module] | None) -> None:
    """The members of vLLM's Qwen2 / Qwen3 decoder layer (as vLLM's ``Qwen2DecoderLayer.__init__``, whose
    ``forward`` they keep), with our attention: Qwen2's q/k/v bias, Qwen3's per-head RMSNorm of q and k and its
    config's head_dim and bias (transformers' Qwen3 gives o_proj the bias too; vLLM's has none)."""
    nn.Module.__init__(layer)
    layer.hidden_size = config.hidden_size
    set_default_rope_theta(config, default_theta=1000000)
    layer.self_attn = PolyAttnAttention(
        config=config, hidden_size=config.hidden_size, num_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads, max_position_embeddings=config.max_position_embeddings,
        quant_config=quant_config, bias=bias, bias_o_proj=bias_o_proj, cache_config=cache_config,
        prefix=f"{prefix}.self_attn", head_dim=getattr(config, "head_dim", None), qk_norm=qk_norm,
        rms_norm_eps=config.rms_norm_eps)
    layer.mlp = Qwen2MLP(hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
                         hidden_act=config.hidden_act, quant_config=quant_config, prefix=f"{prefix}.mlp")
    layer.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
    layer.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class PolyAttnQwen2DecoderLayer(Qwen2DecoderLayer):
    def __init__(self, config, cache_config=None, quant_config=None, prefix: str = "") -> None:
        # transformers' Qwen2: q/k/v with bias, o_proj without, no q/k norm
        _qwen_layer(self, config, cache_config, quant_config, prefix, bias=True, bias_o_proj=False, qk_norm=None)


class PolyAttnQwen3DecoderLayer(Qwen3DecoderLayer):
    def __init__(self, config, cache_config=None, quant_config=None, prefix: str = "") -> None:
        bias = getattr(config, "attention_bias", False)
        _qwen_layer(self, config, cache_config, quant_config, prefix, bias=bias, bias_o_proj=bias, qk_norm=RMSNorm)


class PolyAttnQwen3Model(Qwen3Model):
    decoder_layer_type = PolyAttnQwen3DecoderLayer


def _causal_lm(model: nn.Module, vllm_config, prefix: str, inner: nn.Module, logit_soft_cap=None) -> None:
    """The members of vLLM's ``Qwen2ForCausalLM`` / ``Qwen3ForCausalLM`` / ``Gemma3ForCausalLM`` (as their
    ``__init__``, whose forward, logits and weight loading they keep) around ``inner``, the model with our layers."""
    config = vllm_config.model_config.hf_config.get_text_config()
    model.config, model.vllm_config, model.quant_config = config, vllm_config, vllm_config.quant_config
    model.model = inner
    if get_pp_group().is_last_rank:
        model.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, quant_config=vllm_config.quant_config,
                                       prefix=maybe_prefix(prefix, "lm_head"))
        if config.tie_word_embeddings:
            model.lm_head = model.lm_head.tie_weights(inner.embed_tokens)
    else:
        model.lm_head = PPMissingLayer()
    model.logits_processor = LogitsProcessor(config.vocab_size, soft_cap=logit_soft_cap)
    model.make_empty_intermediate_tensors = inner.make_empty_intermediate_tensors


class PolyAttnQwen2ForCausalLM(_StateShapes, Qwen2ForCausalLM, HasInnerState, IsHybrid):
    """A converted Qwen2 folder (``architectures: PolyAttnQwen2ForCausalLM``) in vLLM."""

    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        check_servable(vllm_config.model_config.hf_config, "PolyAttnQwen2ForCausalLM")
        nn.Module.__init__(self)
        inner = Qwen2Model(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"),
                           decoder_layer_type=PolyAttnQwen2DecoderLayer)
        _causal_lm(self, vllm_config, prefix, inner)


class PolyAttnQwen3ForCausalLM(_StateShapes, Qwen3ForCausalLM, HasInnerState, IsHybrid):
    """A converted Qwen3 folder (``architectures: PolyAttnQwen3ForCausalLM``) in vLLM."""

    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        check_servable(vllm_config.model_config.hf_config, "PolyAttnQwen3ForCausalLM")
        nn.Module.__init__(self)
        _causal_lm(self, vllm_config, prefix,
                   PolyAttnQwen3Model(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model")))


class PolyAttnGemma3DecoderLayer(Gemma3DecoderLayer):
    """A sliding-window layer: vLLM's own (its sliding-window ``Attention``, transformers' exact window). A global
    layer: vLLM's members (as ``Gemma3DecoderLayer.__init__``, whose forward it keeps) with our attention, given
    what Gemma 3's attention does before the scores: the per-head Gemma RMSNorm (1 + w) of q and k, the scale
    query_pre_attn_scalar ** -0.5, the global layers' own RoPE (``servable.check_servable`` refuses the logit
    soft-cap and bidirectional attention, which this layer does not apply)."""

    def __init__(self, config, cache_config=None, quant_config=None, prefix: str = "") -> None:
        layer_idx = extract_layer_index(prefix)
        if not converted_layer(config, layer_idx):
            super().__init__(config, cache_config, quant_config, prefix=prefix)
            return
        nn.Module.__init__(self)
        self.hidden_size = config.hidden_size
        self.self_attn = PolyAttnAttention(
            config=config, hidden_size=config.hidden_size, num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads, max_position_embeddings=config.max_position_embeddings,
            quant_config=quant_config, bias=config.attention_bias, bias_o_proj=config.attention_bias,
            cache_config=cache_config, prefix=f"{prefix}.self_attn", head_dim=config.head_dim,
            scaling=config.query_pre_attn_scalar ** -0.5, qk_norm=GemmaRMSNorm, rms_norm_eps=config.rms_norm_eps,
            rope_parameters=rope_parameters(config, layer_idx))
        self.mlp = Gemma3MLP(hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
                             hidden_activation=config.hidden_activation, quant_config=quant_config,
                             prefix=f"{prefix}.mlp")
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)


@support_torch_compile
class PolyAttnGemma3Model(Gemma3Model):
    """vLLM's ``Gemma3Model`` (as its ``__init__``, whose forward and weight loading it keeps) with our layers."""

    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        nn.Module.__init__(self)
        config = vllm_config.model_config.hf_config
        cache_config, quant_config = vllm_config.cache_config, vllm_config.quant_config
        self.config, self.quant_config = config, quant_config
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, quant_config=quant_config,
                                                   prefix=f"{prefix}.embed_tokens")
        self.start_layer, self.end_layer, self.layers = make_layers(
            config.num_hidden_layers,
            lambda prefix: PolyAttnGemma3DecoderLayer(config, cache_config, quant_config, prefix=prefix),
            prefix=f"{prefix}.layers")
        self.norm = GemmaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        # sqrt(hidden_size) in the model's dtype, as vLLM's (and transformers') embedding scale
        self.register_buffer("normalizer", torch.tensor(config.hidden_size ** 0.5), persistent=False)
        self.make_empty_intermediate_tensors = make_empty_intermediate_tensors_factory(
            ["hidden_states", "residual"], config.hidden_size)


class PolyAttnGemma3ForCausalLM(_StateShapes, Gemma3ForCausalLM, HasInnerState, IsHybrid):
    """A converted Gemma 3 text folder (``Gemma3ForCausalLM``, model_type gemma3_text) in vLLM: its global layers
    converted, its sliding-window layers vLLM's own."""

    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        config = vllm_config.model_config.hf_config
        check_servable(config, "PolyAttnGemma3ForCausalLM")
        nn.Module.__init__(self)
        _causal_lm(self, vllm_config, prefix,
                   PolyAttnGemma3Model(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model")),
                   logit_soft_cap=config.final_logit_softcapping)
