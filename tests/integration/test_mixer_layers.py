"""Models whose layers are not all attention: LFM2's short convolutions, Qwen3-Next's gated DeltaNet layers.

generate()'s PolyAttnCache holds a PolyAttnCacheLayer for each attention layer and, for each other layer, the cache
layer transformers' own DynamicCache(config=...) gives it (their conv / recurrent states, of constant size), which
their modules read and write. A layer that keeps both in one cache layer (Falcon-H1's attention beside Mamba-2) is
refused at convert and at from_pretrained, not in generate(). (The model-type matrix runs the full checks on these
types; this file checks the cache itself.)"""

from __future__ import annotations

import pytest
import torch
from model_matrix import ROWS
from transformers.cache_utils import DynamicCache, LinearAttentionLayer

import hf_polyattn
from hf_polyattn import PolyAttnCache, PolyAttnCacheLayer, PolyAttnConfig, returned_cache
from hf_polyattn.integration.cache import cache_nbytes

RECIPE = PolyAttnConfig(kind="linear", window=16, sinks=2, decay="gate")
ROW = {r.id: r for r in ROWS}


def _model(row_id: str):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(ROW[row_id].make_config()).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def _generate(model, new: int):
    ids = torch.randint(3, 100, (2, 20), generator=torch.Generator().manual_seed(1))
    out = model.generate(ids, max_new_tokens=new, do_sample=False, return_dict_in_generate=True)
    return returned_cache(out)


@pytest.mark.parametrize("row_id", ["lfm2", "qwen3_next"])
def test_the_cache_keeps_the_mixers_own_layers_and_stays_constant(row_id):
    model = hf_polyattn.convert(_model(row_id), RECIPE)
    attention = [i for i, t in enumerate(model.config.layer_types) if t == "full_attention"]
    kinds = [LinearAttentionLayer if i not in attention else PolyAttnCacheLayer
             for i in range(model.config.num_hidden_layers)]
    assert [type(layer) for layer in PolyAttnCache(model).layers] == kinds
    sizes = []
    for new in (5, 40):
        cache = _generate(model, new)
        assert isinstance(cache, PolyAttnCache) and [type(layer) for layer in cache.layers] == kinds
        mixer = [t for i, layer in enumerate(cache.layers) if i not in attention
                 for t in (*layer.conv_states.values(), *layer.recurrent_states.values()) if t is not None]
        mixer_bytes = sum(t.numel() * t.element_size() for t in mixer)
        assert mixer_bytes > 0  # the convolution's last inputs are counted
        assert cache.nbytes() == cache_nbytes(cache) == mixer_bytes + sum(cache.layers[i].nbytes() for i in attention)
        sizes.append(cache.nbytes())
    assert sizes[0] == sizes[1]  # 35 more tokens, not a byte more


def test_a_softmax_dynamic_cache_counts_the_conv_state():
    model = _model("lfm2")
    cache = _generate(model, 5)
    assert type(cache) is DynamicCache
    conv, attn = cache.layers
    keys = attn.keys.numel() * attn.keys.element_size()
    assert cache_nbytes(cache) == 2 * keys + conv.conv_states[0].numel() * conv.conv_states[0].element_size()
    assert conv.conv_states[0].shape == (2, 64, model.config.conv_L_cache)


def test_attention_and_mamba_in_one_cache_layer_is_refused_before_generate():
    from transformers import AutoModelForCausalLM

    row = ROW["falcon_h1"]
    model = _model("falcon_h1")
    with pytest.raises(ValueError, match=row.refusal):
        hf_polyattn.convert(model, RECIPE)
    with pytest.raises(ValueError, match=row.refusal):  # building it with the kind: refused as well
        AutoModelForCausalLM.from_config(row.make_config(), attn_implementation="linear")


@pytest.mark.parametrize("row_id", ["lfm2", "qwen3_next"])
def test_bf16_left_padded_generation_is_finite(row_id):
    model = hf_polyattn.convert(_model(row_id).to(torch.bfloat16), RECIPE)
    ids = torch.randint(3, 100, (2, 20), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    out = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, output_logits=True,
                         return_dict_in_generate=True)
    logits = torch.stack(out.logits, 1)
    assert bool(torch.isfinite(logits).all())  # (generate() hands logits back in float32)
    conv = [s for layer in returned_cache(out).layers if isinstance(layer, LinearAttentionLayer)
            for s in layer.conv_states.values()]
    assert conv and all(s.dtype == torch.bfloat16 for s in conv)  # the mixer's state as the model keeps it
