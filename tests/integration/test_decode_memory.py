"""decode_memory's formula equals the bytes a real cache holds after a prompt and after decoding on from it (the
softmax heads' buffers with room, a window's ring): every causal kind, a hybrid with softmax heads + window + sinks +
gate (the demo's recipe), a short convolution, bf16, batches, lengths on both sides of the window and of a block;
from a model and from its saved config alone."""

import copy

import pytest
import torch
from integration_helpers import CAUSAL_KINDS, KIND_CONFIGS, build, prompt_ids
from transformers import AutoConfig, DynamicCache

import hf_polyattn
from hf_polyattn import PolyAttnCache, PolyAttnConfig, decode_memory
from hf_polyattn.integration.cache import cache_nbytes

# the demo's recipe at tiny sizes: kv head 1 of layer 0 softmax, the rest elu + 1 beside a 6-token softmax window,
# 2 sinks, a gated decay, a projection of q/k to 32 dims (head_dim 16)
HYBRID = PolyAttnConfig(kind="linear", feature_map="elu", window=6, sinks=2, decay="gate", window_mix=True,
                        window_mix_init=0.01, feature_proj=32, softmax_heads=((0, 1),))
CONFIGS = {**{k: KIND_CONFIGS[k] for k in CAUSAL_KINDS},
           "hybrid": HYBRID,
           "hybrid-all-softmax-layer": HYBRID.replace(softmax_heads=((0, 0), (0, 1), (1, 0))),
           "polysketch-window-sinks": PolyAttnConfig(kind="polysketch", sketch_size=4, window=5, sinks=3),
           "polynomial-quadratic": PolyAttnConfig(kind="polynomial", degree=2, exact_path="quadratic"),
           "linear-conv-hybrid": PolyAttnConfig(kind="linear", feature_map="elu", window=4, sinks=1, short_conv=3,
                                                softmax_heads=((1, 0),)),
           "delta-elu-hybrid": PolyAttnConfig.for_kind("delta", window=4, sinks=2, decay="gate",
                                                       delta_feature_map="elu", softmax_heads=((0, 0),)),
           # LoLA's sparse cache (ops/sparse.py): 3 keys, blocks of 3, beside a 4-token window
           "linear-sparse-proj-gate": PolyAttnConfig(kind="linear", window=4, sinks=2, decay="gate", feature_proj=32,
                                                     sparse_cache=3, sparse_chunk=3),
           "polysketch-sparse-hybrid": PolyAttnConfig(kind="polysketch", sketch_size=4, window=4, sparse_cache=2,
                                                      sparse_chunk=4, softmax_heads=((0, 0),)),
           "linear-sparse-conv": PolyAttnConfig(kind="linear", window=4, sinks=1, short_conv=3, sparse_cache=2,
                                                sparse_chunk=3),
           # ranked by attention: the last sparse_chunk queries and the cache's scores besides
           "linear-sparse-attention": PolyAttnConfig(kind="linear", window=4, sinks=2, decay="gate", sparse_cache=3,
                                                     sparse_chunk=3, sparse_score="attention")}
LENGTHS = (1, 4, 5, 6, 7, 9, 13)  # around the windows (4-6) and blocks (4)


def measured(model, cache, batch: int, length: int, steps: int = 0) -> int:
    """Bytes of ``cache`` after a prompt of ``length`` tokens, then ``steps`` decoded ones."""
    ids = prompt_ids(batch, length)
    with torch.inference_mode():
        model(ids, **hf_polyattn.cache_kwargs(cache), use_cache=True, logits_to_keep=1)
        for _ in range(steps):
            model(ids[:, -1:], **hf_polyattn.cache_kwargs(cache), use_cache=True)
    return cache_nbytes(cache)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_formula_equals_the_polyattn_cache(name):
    model = build("llama", CONFIGS[name])
    for batch in (1, 2):
        mem = decode_memory(model, LENGTHS, batch=batch)
        assert mem.kind == CONFIGS[name].kind and mem.batch == batch and mem.decoded == 0
        got = tuple(measured(model, PolyAttnCache(model), batch, n) for n in LENGTHS)
        assert mem.total == got, name
    # decoding on from a prompt (a window's ring from the first step on, the softmax buffers' room), and past it
    for prompt, steps in ((5, 1), (5, 4), (2, 9), (3, 300)):
        after = measured(model, PolyAttnCache(model), 1, prompt, steps=steps)
        assert decode_memory(model, (prompt,), decoded=steps).total == (after,), (name, prompt, steps)


@pytest.mark.parametrize("name", ["hybrid", "linear-conv-hybrid", "delta-elu-hybrid"])
def test_formula_bf16_and_softmax_side(name):
    model = build("llama", CONFIGS[name]).to(torch.bfloat16)
    mem = decode_memory(model, LENGTHS, batch=2)
    assert mem.dtype == torch.bfloat16
    assert mem.total == tuple(measured(model, PolyAttnCache(model), 2, n) for n in LENGTHS)
    assert decode_memory(model, (7,), batch=2, decoded=3).total == (measured(model, PolyAttnCache(model), 2, 7, 3),)
    base = build("llama").to(torch.bfloat16)
    dyn = tuple(measured(base, DynamicCache(config=base.config), 2, n) for n in LENGTHS)
    assert mem.softmax_total == dyn
    # the softmax model's own figures are its DynamicCache's
    soft = decode_memory(base, LENGTHS, batch=2)
    assert soft.kind is None and soft.total == dyn and soft.per_token == soft.softmax_per_token


def test_per_token_is_the_softmax_heads_share():
    model = build("llama", HYBRID)  # 2 layers x 2 kv heads of 16 dims, fp32; one kv head softmax
    mem = decode_memory(model, (4000, 8000))
    assert mem.per_token == 2 * 1 * 16 * 4  # its keys and values
    assert mem.softmax_per_token == 2 * 2 * 2 * 16 * 4
    # the rest is constant past the window; the buffers have room for an eighth more tokens
    assert mem.total[1] - mem.total[0] == (8000 - 4000) * 9 // 8 * mem.per_token
    linear_only = decode_memory(build("llama", HYBRID.replace(softmax_heads=None)), (100, 200))
    assert linear_only.per_token == 0 and linear_only.total[0] == linear_only.total[1]
    rows = mem.rows()
    assert [r["length"] for r in rows] == [4000, 8000] and rows[0]["ratio"] == mem.softmax_total[0] / mem.total[0]


def test_from_the_saved_config_alone(tmp_path):
    model = build("llama", HYBRID)
    model.save_pretrained(tmp_path)
    config = AutoConfig.from_pretrained(tmp_path)
    from_config = decode_memory(config, LENGTHS, dtype=torch.float32)
    assert from_config == decode_memory(model, LENGTHS)
    assert decode_memory(config, (7,), dtype="bfloat16").dtype == torch.bfloat16


def test_other_architectures():
    for arch in ("gpt2", "qwen2", "gpt_neox"):
        model = build(arch, HYBRID.replace(softmax_heads=None, feature_proj=0))
        assert decode_memory(model, (9,)).total == (measured(model, PolyAttnCache(model), 1, 9),), arch
        base = build(arch)
        assert decode_memory(base, (9,)).total == (measured(base, DynamicCache(config=base.config), 1, 9),), arch
        assert decode_memory(base, (9,), decoded=2).total == (measured(base, DynamicCache(config=base.config), 1, 9,
                                                                       2),), arch


def test_bad_arguments():
    model = build("llama", HYBRID)
    for bad in ((), (0,), (4, -1), (2.5,)):
        with pytest.raises(ValueError, match="lengths"):
            decode_memory(model, bad)
    with pytest.raises(ValueError, match="batch"):
        decode_memory(model, (4,), batch=0)
    with pytest.raises(ValueError, match="decoded"):
        decode_memory(model, (4,), decoded=-1)
    with pytest.raises(TypeError, match="transformers model or config"):
        decode_memory(object(), (4,))


def test_sliding_window_layers_count_their_window():
    """Gemma 3: its sliding layers keep their last window - 1 keys (kept exact by hf_polyattn, or in the softmax
    base's DynamicSlidingWindowLayer), the converted global layer its constant state: formula = measured bytes."""
    from transformers import AutoModelForCausalLM

    import hf_polyattn

    config = AutoConfig.for_model("gemma3_text", hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=300,
                                  sliding_window=16, max_position_embeddings=1024)
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(config).eval()
    model = hf_polyattn.convert(AutoModelForCausalLM.from_config(copy.deepcopy(config)).eval(),
                                PolyAttnConfig(kind="linear", window=8, sinks=2, sink_position="own", decay="gate"))
    for length, steps in ((10, 0), (40, 0), (40, 5), (10, 9)):
        assert decode_memory(model, (length,), decoded=steps).total == (
            measured(model, PolyAttnCache(model), 1, length, steps),), (length, steps)
        soft = decode_memory(base, (length,), decoded=steps)
        assert soft.total == (measured(base, DynamicCache(config=base.config), 1, length, steps),), (length, steps)
    mem = decode_memory(model, (4000, 8000))
    assert mem.per_token == 0 and mem.total[0] == mem.total[1]  # every layer constant: windows and the state
    assert mem.softmax_total[1] - mem.softmax_total[0] == 4000 * mem.softmax_per_token  # the global layer grows
    with pytest.raises(ValueError, match="pass the converted model"):
        decode_memory(model.config, (10,))
