"""decode_memory (the model card's decode-memory table) against the bytes a real cache holds after a prefill."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

import hf_polyattn
from hf_polyattn import PolyAttnCache, PolyAttnConfig
from hf_polyattn.integration.memory import decode_memory

LAYERS, HEADS, KV_HEADS, HEAD_DIM = 2, 4, 2, 16

CASES = {
    "linear-window-sinks-gate-heads": dict(kind="linear", window=16, sinks=2, decay="gate", feature_proj=24,
                                           qk_norm=True, block_size=16, window_mix=True, window_mix_init=0.01,
                                           softmax_heads=((0, 0), (1, 1))),
    "linear-hedgehog": dict(kind="linear", feature_map="hedgehog", window=8, block_size=16),
    "polysketch-window": dict(kind="polysketch", sketch_size=8, window=16, block_size=16),
    "performer": dict(kind="performer", num_features=32),
    "taylor": dict(kind="taylor"),
    "streaming": dict(kind="sliding_window", window=16, sinks=4),
    "bigbird": dict(kind="bigbird", options={"block": 8}),
    "reformer-heads": dict(kind="reformer", softmax_heads=((1, 0),)),
}


def _model(dtype):
    cfg = LlamaConfig(vocab_size=100, hidden_size=64, intermediate_size=64, num_hidden_layers=LAYERS,
                      num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM)
    return LlamaForCausalLM(cfg).to(dtype).eval()


def _prefill(model, cache, length: int) -> int:
    ids = torch.randint(0, 100, (1, length))
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True)
        model(ids[:, :1], past_key_values=cache, use_cache=True)  # one decoded token: length + 1 in the cache
    return length + 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(CASES))
def test_matches_the_cache(name, dtype):
    model = hf_polyattn.convert(_model(dtype), PolyAttnConfig(**CASES[name]))
    expected = decode_memory(model.config, hf_polyattn.get_polyattn_config(model), dtype=dtype)
    assert expected is not None
    for length in (40, 71):  # beyond window + sinks: the constant part no longer grows
        cache = PolyAttnCache()
        n = _prefill(model, cache, length)
        assert cache.nbytes() == expected.total(n), (name, n)


def test_softmax_base_matches_dynamic_cache():
    model = _model(torch.bfloat16)
    expected = decode_memory(model.config, None, dtype=torch.bfloat16)
    cache = DynamicCache()
    n = _prefill(model, cache, 50)
    held = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    assert held == expected.total(n) == n * LAYERS * KV_HEADS * 2 * HEAD_DIM * 2


def test_local_exact_blocks_at_their_fullest():
    """local_exact keeps the keys of the current block: decode_memory gives the most (block_size - 1 of them)."""
    cfg = PolyAttnConfig(kind="linear", local_exact=True, block_size=16)
    model = hf_polyattn.convert(_model(torch.float32), cfg)
    expected = decode_memory(model.config, cfg, dtype=torch.float32)
    sizes = []
    for length in range(32, 48):
        cache = PolyAttnCache()
        _prefill(model, cache, length)
        sizes.append(cache.nbytes())
    assert max(sizes) == expected.constant and expected.per_token == 0


def test_constant_state_against_softmax_at_long_context():
    """Every head linear-time: the cache stops growing, softmax's grows by 2 x Hkv x D x layers numbers a token."""
    config = _model(torch.float32).config
    cfg = PolyAttnConfig(kind="linear", window=16, sinks=2)
    base, conv = decode_memory(config, None), decode_memory(config, cfg)
    assert conv.per_token == 0 and conv.constant > 0
    assert base.total(32768) == 32768 * LAYERS * KV_HEADS * 2 * HEAD_DIM * 4


def test_quadratic_polynomial_is_not_computed():
    config = _model(torch.float32).config
    assert decode_memory(config, PolyAttnConfig(kind="polynomial")) is None


@pytest.mark.parametrize("cfg", [dict(kind="linear", window=16, sinks=2), dict(kind="performer", num_features=32)],
                         ids=["linear-window-sinks", "performer"])
def test_gpt2_counts_its_heads(cfg):
    """GPT-2's config names no kv heads (every head has its own keys): the count reads num_attention_heads."""
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_embd=64, n_head=4, n_layer=2, vocab_size=100, n_positions=128)).eval()
    model = hf_polyattn.convert(model, PolyAttnConfig(**cfg))
    expected = decode_memory(model.config, hf_polyattn.get_polyattn_config(model))
    cache = PolyAttnCache()
    n = _prefill(model, cache, 40)
    assert cache.nbytes() == expected.total(n)
    assert decode_memory(model.config, None).per_token == 2 * 4 * 2 * 16 * 4  # layers x heads x (k, v) x d x fp32
