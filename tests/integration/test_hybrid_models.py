"""Models converted with softmax_heads (a few kv heads exact softmax, the rest a kind): Llama, GPT-2, BERT."""

from __future__ import annotations

import json

import pytest
import torch
from huggingface_hub import ModelCard
from integration_helpers import (
    ARCHS,
    KIND_CONFIGS,
    assert_left_padded_generation_equals_rows,
    auto_class,
    build,
    perturb_polyattn,
    prompt_ids,
)
from transformers import DynamicCache

import hf_polyattn
from hf_polyattn import PolyAttnCache, PolyAttnCacheLayer, cache_kwargs, returned_cache
from hf_polyattn.ops import HybridAttention, HybridState

# (layer, kv head) pairs per architecture (2 layers each): layer 1 of Llama keeps both its kv heads (no kernel
# module there), the others mix; GPT-2 and BERT have 4 kv heads (no grouping), Llama 2 of 2 query heads each
PAIRS = {"llama": ((0, 1), (1, 0), (1, 1)), "gpt2": ((0, 0), (0, 3), (1, 2)), "bert": ((0, 1), (1, 0), (1, 2))}
KINDS = {"polysketch": KIND_CONFIGS["polysketch"], "linear-window": hf_polyattn.PolyAttnConfig(kind="linear", window=4)}


def _ids(batch=2, length=12, seed=0):
    return prompt_ids(batch, length, seed)


def _logits(model, arch_name, ids, mask=None):
    extra = {"use_cache": False} if ARCHS[arch_name].causal else {}
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, **extra).logits


def _hybrid(arch_name, kind="polysketch", pairs=None):
    cfg = KINDS[kind].replace(softmax_heads=PAIRS[arch_name] if pairs is None else pairs)
    model = build(arch_name, cfg)
    perturb_polyattn(model)  # off the seed values: a reload that re-drew them would differ
    return model


def _polyattn_modules(model):
    return [m for m in model.modules() if isinstance(m, hf_polyattn.HFPolyAttention)]


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("arch_name", list(PAIRS))
def test_hybrid_model_runs_saves_and_reloads(arch_name, kind, tmp_path):
    model = _hybrid(arch_name, kind)
    ids = _ids()
    mask = torch.ones_like(ids)
    mask[1, -3:] = 0
    logits = _logits(model, arch_name, ids, mask)
    assert torch.isfinite(logits).all()
    layers = _polyattn_modules(model)
    assert all(isinstance(m, HybridAttention) for m in layers)
    assert [m.softmax_kv_heads for m in layers] == [tuple(h for j, h in PAIRS[arch_name] if j == i) for i in (0, 1)]
    # neither softmax nor the kind alone: the softmax heads and the kind's heads both count
    soft, plain = build(arch_name), build(arch_name, KINDS[kind])
    for other in (soft, plain):
        assert not torch.allclose(_logits(other, arch_name, ids, mask), logits, atol=1e-4)

    model.save_pretrained(tmp_path)
    stored = json.loads((tmp_path / "config.json").read_text())
    assert stored["attn_implementation"] == KINDS[kind].kind
    assert stored["polyattn"]["softmax_heads"] == [list(p) for p in PAIRS[arch_name]]
    reloaded = auto_class(ARCHS[arch_name]).from_pretrained(tmp_path).eval()
    assert reloaded.config._attn_implementation == KINDS[kind].kind  # never silently softmax
    assert hf_polyattn.get_polyattn_config(reloaded) == hf_polyattn.get_polyattn_config(model)
    assert hf_polyattn.get_polyattn_config(reloaded).softmax_heads == PAIRS[arch_name]
    assert {n: p.shape for n, p in reloaded.state_dict().items()} == {n: p.shape for n, p in model.state_dict().items()}
    torch.testing.assert_close(_logits(reloaded, arch_name, ids, mask), logits, rtol=0, atol=0)


@pytest.mark.parametrize("arch_name", list(PAIRS))
def test_every_head_softmax_is_the_softmax_model(arch_name):
    """softmax_heads naming every kv head: no kernel module anywhere, and the model's own softmax logits (padding
    included: left padding for the decoders, right for BERT)."""
    arch = ARCHS[arch_name]
    kv = 2 if arch_name == "llama" else 4
    model = _hybrid(arch_name, pairs=[(layer, h) for layer in (0, 1) for h in range(kv)])
    assert not any(".polyattn." in n for n, _ in model.named_parameters())
    assert all(m.kernel is None for m in _polyattn_modules(model))
    ids = _ids()
    mask = torch.ones_like(ids)
    if arch.causal:
        mask[1, :4] = 0
    else:
        mask[1, -4:] = 0
    soft = build(arch_name)
    real = mask.bool()
    torch.testing.assert_close(_logits(model, arch_name, ids, mask)[real], _logits(soft, arch_name, ids, mask)[real],
                               rtol=1e-5, atol=1e-5)


def _gen_model(arch_name, kind="polysketch"):
    model = _hybrid(arch_name, kind)
    model.generation_config.eos_token_id = None  # random tiny models would stop at random
    model.generation_config.pad_token_id = 0
    return model


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("arch_name", ["llama", "gpt2"])
def test_greedy_generation_equals_full_forward_every_step(arch_name, kind):
    model = _gen_model(arch_name, kind)
    ids = _ids(1, 10)
    out = model.generate(ids, max_new_tokens=8, do_sample=False, output_logits=True, return_dict_in_generate=True)
    cache = returned_cache(out)
    assert isinstance(cache, PolyAttnCache)
    assert all(isinstance(layer.state, HybridState) for layer in cache.layers)
    seq = out.sequences
    for step, logits in enumerate(out.logits):
        upto = ids.shape[1] + step
        full = _logits(model, arch_name, seq[:, :upto])[:, -1]
        torch.testing.assert_close(logits, full, rtol=1e-4, atol=1e-4, msg=f"step {step}")
        assert torch.equal(full.argmax(-1), seq[:, upto])


def test_chunked_prefill_with_dynamic_cache_equals_full_forward():
    model = _hybrid("llama")
    ids = _ids(2, 15)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    ref = _logits(model, "llama", ids, mask)
    with torch.no_grad():
        first = model(ids[:, :6], attention_mask=mask[:, :6], use_cache=True)
        cache = returned_cache(first)
        assert type(cache) is DynamicCache and all(isinstance(x, PolyAttnCacheLayer) for x in cache.layers)
        second = model(ids[:, 6:11], attention_mask=mask[:, :11], **cache_kwargs(cache), use_cache=True).logits
        steps = [model(ids[:, t:t + 1], attention_mask=mask[:, :t + 1], **cache_kwargs(cache), use_cache=True).logits
                 for t in range(11, 15)]
    torch.testing.assert_close(torch.cat([first.logits, second, *steps], 1)[mask.bool()], ref[mask.bool()],
                               rtol=1e-4, atol=1e-4)
    assert cache.get_seq_length() == 15


@pytest.mark.parametrize("kind", list(KINDS))
def test_left_padded_batch_generation_equals_rows(kind):
    # local_exact blocks (polysketch, block_size 4) are exact under left padding by a multiple of the block
    assert_left_padded_generation_equals_rows(_gen_model("llama", kind), pad=4)


@pytest.mark.parametrize("arch_name", ["llama", "gpt2"])
def test_beam_search_and_sampled_sequences_match_uncached(arch_name):
    model = _gen_model(arch_name)
    ids = _ids(2, 8)
    kw = dict(max_new_tokens=6, do_sample=False, num_beams=3, num_return_sequences=2, early_stopping=False)
    assert torch.equal(model.generate(ids, **kw), model.generate(ids, use_cache=False, **kw))
    kw = dict(max_new_tokens=6, do_sample=True, top_k=20, num_return_sequences=2)
    torch.manual_seed(11)
    cached = model.generate(ids, **kw)
    torch.manual_seed(11)
    assert torch.equal(cached, model.generate(ids, use_cache=False, **kw))


def test_cache_bytes_count_both_parts_and_grow_with_the_softmax_heads_only():
    """Per generated token the softmax kv heads keep one more key and value (3 pairs x 2 x head_dim 16 float32
    numbers), in buffers with room for the next tokens (counted in the cache's bytes: memory held); the kernel heads'
    states stay the same size."""
    model = _gen_model("llama", "linear-window")
    ids = _ids(1, 10)
    sizes = []
    for steps in (5, 9):
        cache = PolyAttnCache(model)
        model.generate(ids, max_new_tokens=steps, do_sample=False, **cache_kwargs(cache))
        states = [layer.state for layer in cache.layers]
        softmax = sum(s.k.numel() * 4 + s.v.numel() * 4 for s in states)
        kernel = sum(s.kernel.nbytes() for s in states if s.kernel is not None)
        assert cache.nbytes() == softmax + kernel > 0  # no mask: nothing padded
        kept = sum(s.keys.numel() * 4 + s.values.numel() * 4 for s in states)
        assert all(s.keys.shape[2] <= s.k.shape[2] <= s.keys.shape[2] + 256 for s in states)
        sizes.append((kept, kernel))
    assert sizes[1][1] == sizes[0][1]  # the kernel part is constant (the last window keys and the folded state)
    assert sizes[1][0] - sizes[0][0] == 4 * len(PAIRS["llama"]) * 2 * 16 * 4


def test_cache_layer_batch_select_offload_and_reorder():
    model = _hybrid("llama")
    ids = _ids(3, 9)
    with torch.no_grad():
        cache = returned_cache(model(ids, use_cache=True))
    layer = cache.layers[0]
    before = layer.state
    layer.batch_select_indices(torch.tensor([True, False, True]))
    assert torch.equal(layer.state.keys, before.keys[[0, 2]])
    assert torch.equal(layer.state.kernel.kv, before.kernel.kv[[0, 2]])
    layer.reorder_cache(torch.tensor([1, 0]))
    assert torch.equal(layer.state.values, before.values[[2, 0]])
    layer.offload()
    layer.prefetch()
    assert isinstance(layer.state, HybridState) and layer.state.k.device == ids.device
    assert cache.layers[1].state.kernel is None  # layer 1: every kv head softmax


def test_pairs_are_checked_against_the_model(tmp_path):
    with pytest.raises(ValueError, match=r"softmax_heads names \(2, 0\): LlamaForCausalLM has 2 layers "
                                         r"\(num_hidden_layers\), allowed layers 0\.\.1"):
        build("llama", KINDS["polysketch"].replace(softmax_heads=[(0, 0), (2, 0)]))
    with pytest.raises(ValueError, match=r"softmax_heads names \(1, 2\): LlamaForCausalLM has 2 kv heads per layer "
                                         r"\(num_key_value_heads\), allowed heads 0\.\.1"):
        build("llama", KINDS["polysketch"].replace(softmax_heads=[(1, 2)]))
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel has 4 kv heads per layer"):
        build("gpt2", KINDS["polysketch"].replace(softmax_heads=[(0, 4)]))
    model = _hybrid("llama")
    model.save_pretrained(tmp_path)
    stored = json.loads((tmp_path / "config.json").read_text())
    stored["polyattn"]["softmax_heads"] = [[0, 0], [5, 1]]
    (tmp_path / "config.json").write_text(json.dumps(stored))
    with pytest.raises(ValueError, match=r"softmax_heads names \(5, 1\)"):
        auto_class(ARCHS["llama"]).from_pretrained(tmp_path)


def test_model_card_names_the_softmax_heads_and_decode_memory(tmp_path):
    model = _hybrid("llama")
    model.save_pretrained(tmp_path)
    card = ModelCard.load(tmp_path / "README.md")
    text = " ".join(card.text.split())
    assert "### Softmax heads" in card.text
    # the layout, one row per layer: its softmax kv heads and how many run the kind
    assert "| 0 | 1 | 1 of 2 |" in card.text and "| 1 | 0, 1 | 0 of 2 |" in card.text
    # softmax: 2 x 2 kv heads x 16 x 2 layers = 128 numbers per token; the hybrid: 2 x 3 x 16 = 96
    assert "3 of the 4 KV heads (2 layers x 2)" in text
    assert "per token (all layers): 2 x 3 x 16 = 96 numbers against softmax's 2 x 2 x 16 x 2 = 128 (0.750x)" in text
    assert "except in the softmax heads listed below" in text
    assert card.data.to_dict()["polyattn"]["softmax_heads"] == [[0, 1], [1, 0], [1, 1]]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_precision_hybrid_reloads_and_generates(dtype, tmp_path):
    """A hybrid reloaded in bf16 / fp16: the kernel heads' tensors in that dtype, logits finite and close to the
    float32 model's, cached generation equal to the uncached one."""
    model = _gen_model("llama")
    model.save_pretrained(tmp_path)
    half = auto_class(ARCHS["llama"]).from_pretrained(tmp_path, dtype=dtype).eval()
    half.generation_config.eos_token_id = None
    assert {p.dtype for n, p in half.named_parameters() if ".polyattn." in n} == {dtype}
    ids = _ids(2, 12)
    logits = _logits(half, "llama", ids)
    assert logits.dtype == dtype and torch.isfinite(logits).all()
    torch.testing.assert_close(logits.float(), _logits(model, "llama", ids), rtol=0.05, atol=0.05)
    out = half.generate(ids, max_new_tokens=4, do_sample=False, return_dict_in_generate=True, output_logits=True)
    assert all(isinstance(layer.state, HybridState) and layer.state.k.dtype == dtype for layer in
               returned_cache(out).layers)  # the softmax heads' keys as the model gave them
    assert torch.equal(out.sequences, half.generate(ids, max_new_tokens=4, do_sample=False, use_cache=False))
