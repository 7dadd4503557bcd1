"""hf_polyattn.compile_decode: generate() with the windowed kernel heads' step compiled gives the eager tokens."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import hf_polyattn
from hf_polyattn.ops.attention import PolyAttention


def _model(softmax_heads=None):
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256))
    hf_polyattn.convert(model, hf_polyattn.PolyAttnConfig(kind="linear", feature_map="elu", window=8, sinks=2,
                                                          decay="gate", softmax_heads=softmax_heads))
    return model.eval()


@pytest.mark.parametrize("heads", [None, [(1, 0)]], ids=["linear-only", "hybrid"])
def test_generate_compiled_equals_eager(heads):
    model = _model(heads)
    ids = torch.randint(0, 64, (2, 30), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # left padding
    kw = dict(attention_mask=mask, max_new_tokens=20, do_sample=False, pad_token_id=0,
              output_scores=True, return_dict_in_generate=True)
    eager = model.generate(ids, **kw)
    assert hf_polyattn.compile_decode(model) == 2  # one kernel module a layer (the hybrid's inside it)
    assert all(m.compile_decode for m in model.modules() if isinstance(m, PolyAttention))
    compiled = model.generate(ids, **kw)
    assert torch.equal(compiled.sequences, eager.sequences)
    for a, b in zip(compiled.scores, eager.scores):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    hf_polyattn.reconfigure(model, sinks=3)  # new modules: the choice carries over
    assert all(m.compile_decode for m in model.modules() if isinstance(m, PolyAttention))
    hf_polyattn.compile_decode(model, False)
    assert not any(m.compile_decode for m in model.modules() if isinstance(m, PolyAttention))


def test_compile_decode_refuses_what_it_cannot_serve():
    with pytest.raises(ValueError, match="no polyattn kernel layer"):
        hf_polyattn.compile_decode(LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32,
                                                                intermediate_size=64, num_hidden_layers=1,
                                                                num_attention_heads=4)))
    with pytest.raises(TypeError, match="enabled must be True or False"):
        hf_polyattn.compile_decode(_model(), "yes")
