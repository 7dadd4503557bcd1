"""What the kernels cannot honour is refused, naming it, instead of being dropped.

* arguments a model passes to its attention function (T5's ``position_bias``, sinks,
  soft-capping, anything unknown): at ``convert()``, at construction / ``from_pretrained``
  and at every call;
* ``output_attentions=True`` on every model (GPT-2 used to return ``()`` silently);
* ``local_exact=True`` with cross-attention, whatever the sequence lengths.
"""

from __future__ import annotations

import pytest
import torch
from integration_helpers import ARCHS, VOCAB, build
from transformers import (
    BartConfig,
    BartForCausalLM,
    BartModel,
    BertConfig,
    BertLMHeadModel,
    Gemma2Config,
    Gemma2ForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    GptOssConfig,
    GptOssForCausalLM,
    T5Config,
    T5EncoderModel,
    T5ForConditionalGeneration,
)

import hf_polyattn
from hf_polyattn import PolyAttnConfig, cache_kwargs, returned_cache
from hf_polyattn.integration import compatibility

IDS = torch.randint(3, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
LOCAL = PolyAttnConfig(kind="linear", local_exact=True, block_size=4)
WINDOW = PolyAttnConfig(kind="linear", window=4)


def _t5_config(**kw):
    return T5Config(vocab_size=VOCAB, d_model=64, d_kv=16, num_heads=4, num_layers=2, d_ff=128, dropout_rate=0.0,
                    decoder_start_token_id=0, **kw)


def _bart_config(**kw):
    return BartConfig(vocab_size=VOCAB, d_model=64, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
                      decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, dropout=0.0,
                      attention_dropout=0.0, **kw)


def _has_polyattn(model) -> bool:
    return any(".polyattn." in name for name, _ in model.named_parameters()) or any(
        ".polyattn." in name for name, _ in model.named_buffers())


# ----------------------------------------------------------------- T5's relative position bias
def test_t5_position_bias_refused_at_convert_before_changing_anything():
    model = T5EncoderModel(_t5_config()).eval()
    with pytest.raises(ValueError, match=r"T5EncoderModel \(T5Attention\.forward\) passes position_bias=") as err:
        hf_polyattn.convert(model, "linear")
    assert "position bias" in str(err.value)
    assert not _has_polyattn(model) and model.config._attn_implementation != "linear"
    with pytest.raises(ValueError, match="T5ForConditionalGeneration .*passes position_bias="):
        hf_polyattn.convert(T5ForConditionalGeneration(_t5_config()), "polysketch")


def test_t5_position_bias_refused_by_from_pretrained(tmp_path):
    T5EncoderModel(_t5_config()).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"T5Stack \(in T5EncoderModel\) \(T5Attention\.forward\) passes "
                                         r"position_bias="):
        T5EncoderModel.from_pretrained(tmp_path, attn_implementation="performer")
    with pytest.raises(ValueError, match=r"T5Stack \(T5Attention\.forward\) passes position_bias="):
        T5ForConditionalGeneration(_t5_config(attn_implementation="linear"))


# ------------------------------------------------------------ sinks and soft-capping, statically
def _gpt_oss(**kw):
    return GptOssForCausalLM(GptOssConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                          num_local_experts=2, num_experts_per_tok=1, sliding_window=None,
                                          layer_types=["full_attention"] * 2, **kw))


def test_attention_sinks_refused():
    with pytest.raises(ValueError, match=r"GptOssForCausalLM \(GptOssAttention\.forward\) passes s_aux=self\.sinks.*"
                                         r"attention sinks"):
        hf_polyattn.convert(_gpt_oss(), "linear")
    with pytest.raises(ValueError, match=r"passes s_aux=self\.sinks"):
        _gpt_oss(attn_implementation="polysketch")


def _gemma2(**kw):
    return Gemma2ForCausalLM(Gemma2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                          head_dim=16, layer_types=["full_attention"] * 2, sliding_window=16, **kw))


def test_logit_softcapping_refused_and_a_none_argument_is_not():
    # full-attention layers only: each is converted, and caps its scores only in its exact parts (sliding layers kept
    # exact cap theirs: tests/integration/test_sliding_models.py)
    with pytest.raises(ValueError, match=r"passes softcap=self\.attn_logit_softcapping \(50\.0\).*layer 0 cannot "
                                         r"apply it: kind='linear' has no exact part.*not even with "
                                         r"softcap_mode='exact_parts'"):
        hf_polyattn.convert(_gemma2(attn_logit_softcapping=50.0), "linear")
    with pytest.raises(ValueError, match=r"layer 0 cannot apply it: kind='linear': the kernel part.*forms no attention "
                                         r"score.*Pass softcap_mode='exact_parts'"):
        hf_polyattn.convert(_gemma2(attn_logit_softcapping=50.0), PolyAttnConfig(kind="linear", window=4))
    capped = hf_polyattn.convert(_gemma2(attn_logit_softcapping=50.0),
                                 PolyAttnConfig(kind="linear", window=4, softcap_mode="exact_parts"))
    assert [layer.self_attn.polyattn.softcap for layer in capped.model.layers] == [50.0, 50.0]
    # The call-site check on its own: softcap=self.attn_logit_softcapping is evaluated on the module.
    attn = _gemma2(attn_logit_softcapping=50.0).model.layers[0].self_attn
    with pytest.raises(ValueError, match=r"Gemma2 \(Gemma2Attention\.forward\) passes "
                                         r"softcap=self\.attn_logit_softcapping.*soft-capping"):
        compatibility.check_attention_module(attn, PolyAttnConfig(kind="linear"), "Gemma2")
    off = _gemma2(attn_logit_softcapping=None)
    compatibility.check_attention_module(off.model.layers[0].self_attn, PolyAttnConfig(kind="linear"), "Gemma2")
    hf_polyattn.convert(off, "linear")  # softcap=None passes: nothing is dropped


# ----------------------------------------------------------------------- at every call
@pytest.mark.parametrize("name, value", [("position_bias", torch.zeros(1, 4, 8, 8)), ("softcap", 30.0),
                                         ("s_aux", torch.zeros(4)), ("head_mask", torch.ones(4)),
                                         ("some_new_bias", torch.zeros(1))])
def test_unknown_call_argument_refused_at_run_time(name, value):
    model = build("llama", "linear")  # Llama forwards **kwargs down to the attention function
    with pytest.raises(ValueError, match=rf"LlamaForCausalLM \(LlamaAttention\) passes {name}=.*not supported by "):
        model(IDS, use_cache=False, **{name: value})
    model(IDS, use_cache=False, **{name: None})  # an argument set to None changes nothing


def test_call_error_names_the_model_class():
    from transformers import LlamaForCausalLM

    config = ARCHS["llama"].make_config()
    config._attn_implementation = "linear"  # built with the kind: the construction hook records the owner
    model = LlamaForCausalLM(config).eval()
    with pytest.raises(ValueError, match=r"^LlamaModel \(LlamaAttention\) passes position_bias=<Tensor>"):
        model(IDS, use_cache=False, position_bias=torch.zeros(1))
    bare = build("llama", "linear").model.layers[0].self_attn
    del bare.__dict__["_polyattn_owner"]  # e.g. a module attached by hand: fall back to the config
    with pytest.raises(ValueError, match=r"^model_type='llama' \(LlamaAttention\) passes softcap=30\.0"):
        compatibility.check_call_kwargs(bare, {"softcap": 30.0})


def test_every_supported_model_passes_only_handled_arguments(monkeypatch):
    """The allow-list against what the supported models really pass (forward, cache, generate)."""
    seen: dict[str, set] = {}
    real = compatibility.check_call_kwargs

    def spy(module, kwargs, honoured=()):  # None-valued arguments (BERT's encoder_hidden_states=None) are harmless
        seen.setdefault(type(module).__name__, set()).update(k for k, v in kwargs.items() if v is not None)
        real(module, kwargs, honoured)

    monkeypatch.setattr("hf_polyattn.integration.registry.check_call_kwargs", spy)
    for name, arch in ARCHS.items():
        model = build(name, PolyAttnConfig(kind="polysketch", sketch="learned", sketch_size=8, qk_norm=True))
        mask = torch.ones_like(IDS)
        mask[0, :2] = 0
        model(IDS, attention_mask=mask)
        if arch.causal:
            model.generate(IDS, attention_mask=mask, max_new_tokens=2, do_sample=False, pad_token_id=0)
    assert len(seen) == len(ARCHS)
    assert set().union(*seen.values()) <= compatibility.HANDLED_KWARGS


# ----------------------------------------------------------------------- output_attentions
@pytest.mark.parametrize("arch_name", list(ARCHS))
def test_output_attentions_refused_on_every_model(arch_name):
    model = build(arch_name, "linear")
    with pytest.raises(ValueError, match=r"output_attentions=True is not supported by hf_polyattn attention.*eager"):
        model(IDS, output_attentions=True)
    model(IDS, output_attentions=False)


def test_output_attentions_refused_in_generate():
    model = build("gpt2", "linear")
    with pytest.raises(ValueError, match="output_attentions=True is not supported"):
        model.generate(IDS[:1], max_new_tokens=2, do_sample=False, output_attentions=True,
                       return_dict_in_generate=True)


def test_output_attentions_allowed_once_switched_to_eager():
    """A distillation teacher (the same model on eager attention) still returns its attention weights."""
    model = build("gpt2", "linear")
    model.set_attn_implementation("eager")
    attentions = model(IDS, output_attentions=True).attentions
    assert len(attentions) == 2 and attentions[0].shape == (2, 4, 8, 8)


# ------------------------------------------------------------- local_exact and cross-attention
def _gpt2_cross():
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, add_cross_attention=True,
                                      attn_pdrop=0.0))


def _bert_decoder(**kw):
    return BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      intermediate_size=128, is_decoder=True, add_cross_attention=True, **kw)


@pytest.mark.parametrize("make, owner, flag", [
    (lambda: BartModel(_bart_config()), "BartModel", "is_encoder_decoder"),
    (lambda: T5ForConditionalGeneration(_t5_config()), "T5ForConditionalGeneration", "is_encoder_decoder"),
    (lambda: BertLMHeadModel(_bert_decoder()), "BertLMHeadModel", "add_cross_attention"),
    (_gpt2_cross, "GPT2LMHeadModel", "add_cross_attention"),
], ids=["bart", "t5", "bert-decoder", "gpt2-cross"])
def test_local_exact_with_cross_attention_refused_at_convert(make, owner, flag):
    model = make()
    with pytest.raises(ValueError, match=rf"local_exact=True is not supported with cross-attention \({owner}: "
                                         rf"config\.{flag}=True\)"):
        hf_polyattn.convert(model, LOCAL)
    # the sliding window is the other position-aligned exact part: refused the same way
    with pytest.raises(ValueError, match=rf"window=4 is not supported with cross-attention \({owner}: "):
        hf_polyattn.convert(model, WINDOW)
    assert not _has_polyattn(model)


def test_local_exact_with_cross_attention_refused_at_construction(tmp_path):
    stored = {"polyattn": LOCAL.to_dict()}
    with pytest.raises(ValueError, match=r"local_exact=True is not supported with cross-attention \(BartModel: "
                                         r"config\.is_encoder_decoder=True\)"):
        BartModel(_bart_config(attn_implementation="linear", **stored))
    with pytest.raises(ValueError, match=r"cross-attention \(BertModel: config\.add_cross_attention=True\)"):
        BertLMHeadModel(_bert_decoder(attn_implementation="linear", **stored))
    # a saved local_exact decoder-only checkpoint cannot be reloaded as a cross-attention model either
    build("bert", LOCAL).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"local_exact=True is not supported with cross-attention"):
        BertLMHeadModel.from_pretrained(tmp_path, is_decoder=True, add_cross_attention=True)


def test_local_exact_cross_attention_call_refused_at_equal_lengths():
    """BartForCausalLM has cross-attention layers but no config flag: the call itself is refused,
    also when the encoder sequence is exactly as long as the decoder's (the old check compared lengths)."""
    model = hf_polyattn.convert(BartForCausalLM(_bart_config()).eval(), LOCAL)
    model(IDS)  # no encoder states: self-attention only, fine
    with pytest.raises(ValueError, match=r"local_exact=True is not supported with cross-attention \(BartAttention "
                                         r"was called with keys/values from another sequence\)"):
        model(IDS, encoder_hidden_states=torch.randn(2, IDS.shape[1], 64))
    with pytest.raises(ValueError, match="local_exact=True is not supported with cross-attention"):
        model(IDS, encoder_hidden_states=torch.randn(2, 5, 64), use_cache=False)
    windowed = hf_polyattn.convert(BartForCausalLM(_bart_config()).eval(), WINDOW)
    windowed(IDS)
    with pytest.raises(ValueError, match=r"window=4 is not supported with cross-attention \(BartAttention "):
        windowed(IDS, encoder_hidden_states=torch.randn(2, IDS.shape[1], 64))


def test_cross_attention_without_local_blocks_keeps_working():
    for make in (lambda: BartModel(_bart_config()), lambda: BertLMHeadModel(_bert_decoder()), _gpt2_cross):
        hf_polyattn.convert(make(), LOCAL.replace(local_exact=False))  # only the option is refused
    model = hf_polyattn.convert(BartForCausalLM(_bart_config()).eval(), PolyAttnConfig(kind="linear"))
    enc = torch.randn(2, 8, 64)
    out = model(IDS, encoder_hidden_states=enc, use_cache=False).logits
    # the cross-attention really reads the encoder states
    assert not torch.allclose(out, model(IDS, encoder_hidden_states=enc.flip(0), use_cache=False).logits)
    # and the cache folds only self-attention: cached decoding equals the full forward
    full = model(IDS, encoder_hidden_states=enc).logits
    step = model(IDS[:, :5], encoder_hidden_states=enc, use_cache=True)
    nxt = model(IDS[:, 5:], encoder_hidden_states=enc, **cache_kwargs(returned_cache(step))).logits
    torch.testing.assert_close(torch.cat([step.logits, nxt], dim=1), full, rtol=1e-4, atol=1e-4)
