"""generate() with the recurrent-state cache: equal to recomputing the full forward at every step."""

from __future__ import annotations

import pytest
import torch
from integration_helpers import (
    CAUSAL_KINDS,
    KIND_CONFIGS,
    arch_kind_params,
    assert_left_padded_generation_equals_rows,
    build,
    check_greedy_steps,
    prompt_ids,
)
from transformers import DynamicCache

from hf_polyattn import PolyAttnCache, PolyAttnCacheLayer, PolyAttnConfig, cache_kwargs, returned_cache

GEN_ARCHS = ["llama", "gpt2"]
GEN_MATRIX = arch_kind_params(GEN_ARCHS)


def _model(arch, kind):
    model = build(arch, kind)
    model.generation_config.eos_token_id = None  # random tiny models would stop at random
    model.generation_config.pad_token_id = 0
    return model


_prompt = prompt_ids


@pytest.mark.parametrize("arch,kind", GEN_MATRIX)
def test_greedy_equals_full_forward_every_step(arch, kind):
    check_greedy_steps(_model(arch, kind), _prompt())


@pytest.mark.parametrize("kind", CAUSAL_KINDS)
def test_sampling_and_num_return_sequences_match_uncached(kind):
    model = _model("llama", kind)
    ids = _prompt(2)
    kw = dict(max_new_tokens=6, do_sample=True, top_k=20, num_return_sequences=2)
    torch.manual_seed(11)
    cached = model.generate(ids, **kw)
    torch.manual_seed(11)
    uncached = model.generate(ids, use_cache=False, **kw)
    assert cached.shape == (4, ids.shape[1] + 6)
    assert torch.equal(cached, uncached)


@pytest.mark.parametrize("arch,kind", [("llama", "polysketch"), ("gpt2", "performer"), ("llama", "polynomial")])
def test_beam_search_reorders_states(arch, kind):
    model = _model(arch, kind)
    ids = _prompt(2)
    kw = dict(max_new_tokens=6, do_sample=False, num_beams=3, num_return_sequences=2, early_stopping=False)
    cached = model.generate(ids, **kw)
    uncached = model.generate(ids, use_cache=False, **kw)
    assert cached.shape == (4, ids.shape[1] + 6)
    assert torch.equal(cached, uncached)


# bigbird places its blocks and global tokens at absolute positions: left padding shifts them (documented, warned
# once; a right-padded row is unchanged: tests/kinds/test_bigbird.py)
@pytest.mark.parametrize("arch,kind", [p for p in GEN_MATRIX if p.values[1] != "bigbird"])
def test_left_padded_batch_generation_equals_rows(arch, kind):
    assert_left_padded_generation_equals_rows(_model(arch, kind), pad=4)  # lengths differ by block_size 4


def _step_nbytes(model, ids, steps):
    cache = PolyAttnCache(model)
    model.generate(ids, max_new_tokens=steps, do_sample=False, **cache_kwargs(cache))
    return cache


def test_cache_memory_independent_of_generated_length():
    model = _model("llama", "performer")
    ids = _prompt()
    short, long = _step_nbytes(model, ids, 20), _step_nbytes(model, ids, 60)
    assert short.get_seq_length() == ids.shape[1] + 19 and long.get_seq_length() == ids.shape[1] + 59
    assert short.nbytes() == long.nbytes() > 0
    # A softmax DynamicCache grows with every token.
    soft = build("llama", None)
    soft.generation_config.eos_token_id = None
    d5, d10 = DynamicCache(), DynamicCache()
    soft.generate(ids, max_new_tokens=5, do_sample=False, **cache_kwargs(d5))
    soft.generate(ids, max_new_tokens=10, do_sample=False, **cache_kwargs(d10))
    size = [sum(layer.keys.numel() + layer.values.numel() for layer in c.layers) for c in (d5, d10)]
    assert size[1] > size[0]


def test_local_exact_cache_bounded_by_block():
    cfg = KIND_CONFIGS["polysketch"]
    model = _model("llama", "polysketch")
    ids = _prompt()
    sizes = []
    for steps in (5, 7, 14):  # prompt 10: 14, 16, 23 keys seen, every phase of a 4-block
        cache = _step_nbytes(model, ids, steps)
        for layer in cache.layers:
            assert isinstance(layer, PolyAttnCacheLayer)
            kept = 0 if layer.state.k is None else layer.state.k.shape[2]
            assert kept < cfg.block_size
        sizes.append(cache.nbytes())
    kv_only = sum(layer.state.kv.numel() * layer.state.kv.element_size() for layer in cache.layers)
    # kv state + at most block_size - 1 raw keys/values (and their mask) per layer
    per_key = 2 * 2 * 16 * 4 + 1  # k and v: (kv_heads 2, head_dim 16) float32, plus one mask byte
    assert max(sizes) <= kv_only + len(cache.layers) * (cfg.block_size - 1) * per_key


def test_forward_with_dynamic_cache_upgrades_layers():
    """A plain forward with use_cache=True (DynamicCache made by the model) keeps states, not keys."""
    model = _model("qwen2", "linear")
    ids = _prompt(1, 12)
    with torch.no_grad():
        ref = model(ids, use_cache=False).logits
        out = model(ids[:, :7], use_cache=True)
        assert type(returned_cache(out)) is DynamicCache
        assert all(isinstance(layer, PolyAttnCacheLayer) for layer in returned_cache(out).layers)
        assert returned_cache(out).get_seq_length() == 7
        nxt = model(ids[:, 7:], **cache_kwargs(returned_cache(out)), use_cache=True).logits  # chunked prefill
    torch.testing.assert_close(torch.cat([out.logits, nxt], 1), ref, rtol=1e-4, atol=1e-4)


def test_polynomial_quadratic_state_keeps_keys():
    """Documented exception: the quadratic polynomial path has no constant-size state."""
    model = _model("llama", PolyAttnConfig(kind="polynomial", degree=4, exact_path="quadratic"))
    ids = _prompt()
    a, b = _step_nbytes(model, ids, 5), _step_nbytes(model, ids, 15)
    assert b.nbytes() > a.nbytes()


def test_switching_back_to_sdpa_keeps_a_real_kv_cache():
    """After set_attn_implementation('sdpa') the hooks leave the cache alone (no silent truncation)."""
    soft = _model("llama", None)
    poly = _model("llama", "linear")  # same seed: same base weights
    poly.set_attn_implementation("sdpa")
    ids = _prompt()
    kw = dict(max_new_tokens=6, do_sample=False, return_dict_in_generate=True)
    a, b = soft.generate(ids, **kw), poly.generate(ids, **kw)
    assert torch.equal(a.sequences, b.sequences)
    assert type(returned_cache(b)) is DynamicCache and returned_cache(b).get_seq_length() == ids.shape[1] + 5


def test_copies_of_a_model_keep_the_cache_and_card_overrides(tmp_path):
    import copy
    import io

    model = _model("llama", "polysketch")
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    for clone in (copy.deepcopy(model), torch.load(buf, weights_only=False)):
        assert clone.save_pretrained.model is clone  # bound to the copy, not the original
        out = clone.generate(_prompt(), max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
        assert isinstance(returned_cache(out), PolyAttnCache)
        assert torch.equal(out.sequences, model.generate(_prompt(), max_new_tokens=3, do_sample=False))
    clone.save_pretrained(tmp_path)
    assert (tmp_path / "README.md").exists()
