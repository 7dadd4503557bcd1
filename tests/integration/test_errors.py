"""Bad input gives clear errors that name the fix; nothing silently falls back to softmax."""

from __future__ import annotations

import pytest
import torch
from integration_helpers import VOCAB, build
from model_matrix import ROWS
from transformers import (
    AutoModelForCausalLM,
    BertConfig,
    BertForMaskedLM,
    BloomConfig,
    BloomForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    StaticCache,
)

import hf_polyattn
from hf_polyattn import PolyAttnConfig, cache_kwargs, returned_cache

IDS = torch.randint(3, VOCAB, (1, 8), generator=torch.Generator().manual_seed(0))


def test_unknown_kind():
    with pytest.raises(ValueError, match=r"unknown attention kind 'softmax2'; allowed: \['polynomial'"):
        hf_polyattn.convert(build("llama"), "softmax2")
    with pytest.raises(ValueError, match="kind must be one of"):
        hf_polyattn.convert(build("llama"), {"kind": "softmax2"})
    with pytest.raises(ValueError, match="unknown PolyAttnConfig fields"):
        hf_polyattn.convert(build("llama"), {"kind": "linear", "sketch_sise": 3})


def test_not_a_transformers_model():
    with pytest.raises(TypeError, match="needs a transformers PreTrainedModel, got Sequential"):
        hf_polyattn.convert(torch.nn.Sequential(torch.nn.Linear(4, 4)), "linear")
    with pytest.raises(TypeError, match="config must be a PolyAttnConfig"):
        hf_polyattn.convert(build("llama"), 3)


def _bloom_config(**kw):
    # BLOOM computes its softmax (with ALiBi) itself on every supported transformers (Falcon did until 5.24)
    return BloomConfig(vocab_size=VOCAB, hidden_size=64, n_layer=2, n_head=4, **kw)


def test_model_class_bypassing_attention_interface_is_refused():
    with pytest.raises(ValueError, match="BloomForCausalLM does not route its attention through"):
        hf_polyattn.convert(BloomForCausalLM(_bloom_config()), "polysketch")
    # attn_implementation=KIND at construction: refused instead of building a softmax model
    with pytest.raises(ValueError, match="does not route its attention through.*silent softmax"):
        BloomForCausalLM(_bloom_config(attn_implementation="polysketch"))


def test_output_attentions_refused():
    model = build("llama", "linear")
    with pytest.raises(ValueError, match="output_attentions=True is not supported.*eager"):
        model(IDS, output_attentions=True)


def _mistral_config(**kw):
    return MistralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, **kw)


def test_sliding_window_models_convert_their_full_attention_layers_only():
    """Mistral's window on every layer leaves nothing to convert by default (refused, saying how to ask); Qwen2 with
    use_sliding_window converts its full-attention layers (tests/integration/test_sliding_models.py: the rest)."""
    with pytest.raises(ValueError, match=r"sliding-window layer \(window 4096\).*sliding_layers='kind'"):
        hf_polyattn.convert(MistralForCausalLM(_mistral_config(sliding_window=4096)), "linear")
    with pytest.raises(ValueError, match=r"sliding-window layer \(window 4096\).*sliding_layers='kind'"):
        MistralForCausalLM(_mistral_config(sliding_window=4096, attn_implementation="performer"))
    qwen = Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True, sliding_window=8,
                       max_window_layers=1)
    model = hf_polyattn.convert(Qwen2ForCausalLM(qwen), "linear")
    assert [e["role"] for e in hf_polyattn.layer_layout(model)] == ["kind", "sliding"]


def test_sliding_window_set_after_conversion_refused_at_forward():
    model = build("mistral", "linear")
    model.config.sliding_window = 4  # e.g. edited by hand after loading
    with pytest.raises(ValueError, match="sliding"):
        model(IDS, use_cache=False)


def test_packed_sequences_refused():
    model = build("llama", "polysketch")
    position_ids = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]])  # two sequences packed in one row, mask None
    with pytest.raises(ValueError, match="packed sequences.*pad the batch"):
        model(IDS, position_ids=position_ids, use_cache=False)
    with pytest.raises(ValueError, match="packed sequences"):
        model(IDS, cu_seq_lens_q=torch.tensor([0, 4, 8]), use_cache=False)


def test_attention_dropout_in_training_refused():
    config = BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=128, attention_probs_dropout_prob=0.1)
    model = hf_polyattn.convert(BertForMaskedLM(config), "linear")
    model.eval()(IDS)  # inference: dropout is off, fine
    with pytest.raises(ValueError, match=r"config\.attention_probs_dropout_prob=0\.0"):
        model.train()(IDS)
    gpt2 = hf_polyattn.convert(GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4)),
                               "performer")
    with pytest.raises(ValueError, match=r"config\.attn_pdrop=0\.0"):
        gpt2.train()(IDS)


def test_four_d_mask_refused():
    model = build("llama", "linear")
    with pytest.raises(ValueError, match="2-D key-padding mask"):
        model(IDS, attention_mask=torch.ones(1, 1, 8, 8, dtype=torch.bool), use_cache=False)


def test_set_attn_implementation_without_state_refused():
    model = build("llama")
    model.set_attn_implementation("polysketch")
    with pytest.raises(ValueError, match=r"no polyattn state.*hf_polyattn\.convert"):
        model(IDS)
    converted = build("llama", "polysketch")
    converted.set_attn_implementation("performer")
    with pytest.raises(ValueError, match="built for 'polysketch'"):
        converted(IDS)


def test_unsupported_cache_refused():
    model = build("llama", "linear")
    with pytest.raises(ValueError, match="cannot use a StaticCache.*PolyAttnCache"):
        model(IDS, **cache_kwargs(StaticCache(config=model.config, max_cache_len=16)))


def test_softmax_filled_cache_refused():
    soft = build("llama")
    cache = returned_cache(soft(IDS, use_cache=True))
    model = build("llama", "linear")
    with pytest.raises(ValueError, match="already holds 8 softmax keys"):
        model(IDS, **cache_kwargs(cache))


def test_cache_cannot_be_rolled_back():
    model = build("llama", "linear")
    cache = hf_polyattn.PolyAttnCache(model)
    model(IDS, **cache_kwargs(cache))
    cache.crop(0)
    with pytest.raises(ValueError, match="cannot drop tokens"):
        cache.crop(-1)


def test_cross_attention_supported_without_local_blocks():
    config = GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, add_cross_attention=True, attn_pdrop=0.0)
    model = hf_polyattn.convert(GPT2LMHeadModel(config).eval(), PolyAttnConfig(kind="linear"))
    enc = torch.randn(2, 5, 64)
    enc_mask = torch.ones(2, 5, dtype=torch.long)
    enc_mask[1, 3:] = 0
    ids = IDS.repeat(2, 1)
    out = model(ids, encoder_hidden_states=enc, encoder_attention_mask=enc_mask, use_cache=False).logits
    # padded encoder keys are ignored: row 1 equals the same row with only its 3 valid encoder states
    alone = model(ids[1:], encoder_hidden_states=enc[1:, :3], use_cache=False).logits
    torch.testing.assert_close(out[1], alone[0], rtol=1e-4, atol=1e-4)
    # local_exact with cross-attention: refused when converting (test_refused_arguments.py covers the rest)
    with pytest.raises(ValueError, match=r"local_exact=True is not supported with cross-attention.*add_cross"):
        hf_polyattn.convert(GPT2LMHeadModel(config).eval(), PolyAttnConfig(kind="linear", local_exact=True,
                                                                           block_size=4))


@pytest.mark.parametrize("model_type,why", [
    ("minimax", r"model_type 'minimax' \(MiniMax\w*\) keeps its generation cache in a class of its own "
                r"\(MiniMaxCache"),
    ("doge", r"\(model_type='doge'\) passes attention_mask=attn_mask to its attention function: a mask the module "
             r"computes itself"),
], ids=["minimax", "doge"])
def test_a_model_that_would_fail_when_run_is_refused_when_built_too(model_type, why):
    """The model-matrix rows' refusals (MiniMax's own cache class, Doge's per-head mask) also where the model is
    built with the kind (attn_implementation at construction, as from_pretrained does), not at its first forward."""
    row = next(r for r in ROWS if r.id == model_type)
    config = row.make_config()
    config.polyattn = PolyAttnConfig(kind="linear", window=16, sinks=2, decay="gate").to_dict()
    config._attn_implementation = "linear"
    with pytest.raises(ValueError, match=why):
        AutoModelForCausalLM.from_config(config)
