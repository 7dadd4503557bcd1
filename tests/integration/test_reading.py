"""Reading a document for later questions (integration/reading.py): the copy scores equal a naive softmax over each
chunk's copy appended to the document; ``read_document`` leaves each sparse layer's cache holding the document's
top keys by copy score (the streaming selection with a fixed score per key); the cache answers like any other; bad
input and models without a sparse cache are refused."""

from __future__ import annotations

import pytest
import torch
from integration_helpers import build, generating, perturb_polyattn, prompt_ids

import hf_polyattn
from hf_polyattn.eval.long_context import matched_memory_config
from hf_polyattn.integration.reading import copy_scores, read_document, sparse_layers

PROMPT = [5, 6, 7]  # a stand-in for the tokenised COPY_PROMPT


class _Tok:
    """The tokenizer read_document needs: COPY_PROMPT's ids."""

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": list(PROMPT)}


def _naive_copy_scores(model, doc: torch.Tensor, chunk: int) -> dict[int, torch.Tensor]:
    """Each chunk's copy as its own plain sequence (document, prompt, chunk) through the eager softmax model: the
    copying rows' weights on the document's keys, max over rows, chunks and each kv head's query heads."""
    n = doc.shape[1]
    cfg = model.config
    hkv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads  # GPT-2: no grouped heads
    g = cfg.num_attention_heads // hkv
    best: dict[int, torch.Tensor] = {}
    previous = cfg._attn_implementation
    model.set_attn_implementation("eager")
    try:
        for c in range(0, n, chunk):
            ids = torch.cat([doc[0], torch.tensor(PROMPT), doc[0, c : c + chunk]])[None]
            with torch.no_grad():
                att = model(ids, output_attentions=True, use_cache=False).attentions
            for li, w in enumerate(att):  # (1, H, L, L)
                s = w[0, :, n:, :n].amax(1).view(hkv, g, n).amax(1)
                best[li] = torch.maximum(best[li], s) if li in best else s
    finally:
        model.set_attn_implementation(previous)
    return best


@pytest.mark.parametrize("chunk", [7, 64])
def test_copy_scores_equal_a_naive_softmax_over_each_chunks_copy(chunk):
    model = build("llama")
    impl = model.config._attn_implementation
    doc = prompt_ids(1, 30, seed=3)
    got = copy_scores(model, doc, PROMPT, chunk=chunk)
    assert model.config._attn_implementation == impl  # restored
    want = _naive_copy_scores(model, doc, chunk)
    assert sorted(got) == sorted(want)
    for li in want:
        torch.testing.assert_close(got[li][0], want[li], rtol=1e-5, atol=1e-6)


def _gemma2(softcap: float | None):
    """A tiny Gemma 2: sliding layers of window 4 beside global ones, query_pre_attn_scalar != head_dim (the
    ``scaling`` argument), logits soft-capped at ``softcap`` (small: most scores are capped)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("gemma2", hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=16, vocab_size=100, max_position_embeddings=256,
                                  num_hidden_layers=4, sliding_window=4, query_pre_attn_scalar=24,
                                  layer_types=["sliding_attention", "full_attention"] * 2,
                                  attn_logit_softcapping=softcap, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():  # logits of a few units (the init's are ~0.01, where a cap of 3 changes nothing)
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(8.0)
            layer.self_attn.k_proj.weight.mul_(8.0)
    return model


@pytest.mark.parametrize("arch", ["gpt2", "gemma2_softcap", "gemma2"])
def test_copy_scores_follow_each_models_positions_window_and_softcap(arch):
    """GPT-2's learned absolute positions (a copy block's position ids continue the document's), Gemma 2's sliding
    layers (a copying row reaches only the document's last keys) and its soft-capped logits (the document rows
    take the exact path, SDPA has no soft-capping): each against the model's own eager attention."""
    model = build("gpt2") if arch == "gpt2" else _gemma2(3.0 if arch == "gemma2_softcap" else None)
    doc = prompt_ids(1, 30, seed=6)
    for chunk in (5, 16):
        got = copy_scores(model, doc, PROMPT, chunk=chunk)
        want = _naive_copy_scores(model, doc, chunk)
        assert sorted(got) == sorted(want)
        for li in want:
            torch.testing.assert_close(got[li][0], want[li], rtol=1e-5, atol=1e-6)
    if arch.startswith("gemma2"):  # the sliding layers' scores: no copying row reaches the document's start
        sliding = [li for li, t in enumerate(model.config.layer_types) if t == "sliding_attention"]
        assert all(bool((got[li][0, :, :-4] == 0).all()) for li in sliding)


@pytest.mark.parametrize("softcap,window", [(None, None), (None, 5), (2.0, None), (2.0, 5)])
def test_document_rows_equal_the_exact_rows(softcap, window, monkeypatch):
    """The document's rows (SDPA, or the exact path when soft-capped), in blocks smaller than the document (the
    windowed SDPA blocks read only the keys they reach), against one exact causal pass."""
    from hf_polyattn.integration import reading

    monkeypatch.setattr(reading, "BLOCK", 4)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, 13, 8, generator=g) for _ in range(3))
    pos = torch.arange(13)
    want = reading._exact_rows(q, k, v, pos, pos, pos[None, :] <= pos[:, None], 0.5, softcap, window)
    got = reading._document_rows(q, k, v, 0.5, softcap, window)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_copy_scores_on_a_converted_model_read_its_own_q_k_and_restore_it():
    model = build("llama", matched_memory_config(4, sinks=1, window=4, sparse_chunk=2))
    impl = model.config._attn_implementation
    doc = prompt_ids(1, 20, seed=4)
    got = copy_scores(model, doc, PROMPT, chunk=8)
    assert model.config._attn_implementation == impl
    # the converted layers' projections are the checkpoint's: the softmax checkpoint scores the same
    want = copy_scores(build("llama"), doc, PROMPT, chunk=8)
    for li in want:
        torch.testing.assert_close(got[li], want[li])
    assert all(bool((s > 0).all()) and bool((s <= 1).all()) for s in got.values())


def _values(model, ids):
    """Each layer's (Hkv, n, d) values of ``ids`` (v_proj: no rotary, so a kept slot is the token whose value it
    equals)."""
    cfg = model.config
    d = cfg.hidden_size // cfg.num_attention_heads
    out = []
    hooks = [layer.self_attn.v_proj.register_forward_hook(
        lambda m, i, o: out.append(o[0].detach().view(-1, cfg.num_key_value_heads, d).transpose(0, 1)))
        for layer in model.model.layers]
    try:
        with torch.no_grad():
            model(ids, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return out


@pytest.mark.parametrize("value_keys,sink_position,trained", [(0, "window", False), (2, "window", False),
                                                             (2, "own", False), (0, "window", True)])
def test_read_document_keeps_the_top_keys_by_copy_score(value_keys, sink_position, trained):
    """The matched-memory cache, and (``trained``) a linear kernel with a gated decay whose state the evicted keys
    fold into."""
    budget, window, sinks, chunk = 6, 8, 2, 4
    opts = {"sparse_value_keys": value_keys, "sparse_value_pool": 1} if value_keys else {}
    opts["sink_position"] = sink_position
    if trained:
        cfg = hf_polyattn.PolyAttnConfig(kind="linear", window=window, sinks=sinks, decay="gate", sparse_cache=budget,
                                         sparse_chunk=chunk, sparse_score="attention", sparse_observe=4, **opts)
    else:
        cfg = matched_memory_config(budget, sinks=sinks, window=window, sparse_chunk=chunk, sparse_observe=4, **opts)
    model = build("llama", cfg)
    if trained:
        perturb_polyattn(model)
    # distinct tokens: a first layer's values are its tokens', so a kept slot names one position
    doc = (torch.randperm(97, generator=torch.Generator().manual_seed(5))[:50] + 3)[None]
    scores = copy_scores(model, doc, PROMPT, chunk=16)
    values = _values(model, doc)
    cache = read_document(model, doc, _Tok(), chunk=16)
    assert cache.get_seq_length() == 50
    n = doc.shape[1]
    done = (n - window + 1) // chunk * chunk  # keys of the blocks wholly out of every query's window
    cand = torch.zeros(n, dtype=torch.bool)
    cand[sinks:done] = True  # the first `sinks` keys are the sinks, kept apart
    for li, layer in enumerate(cache.layers):
        state = layer.state
        for h in range(model.config.num_key_value_heads):
            kept_v = state.sparse_v[0, h][state.sparse_mask[0, h]]
            kept = sorted(int((values[li][h] - v).abs().sum(-1).argmin()) for v in kept_v)
            s = torch.where(cand, scores[li][0, h], -1.0)
            reserved = []
            if value_keys:
                norm = torch.where(cand, values[li][h].norm(dim=-1), -1.0)
                reserved = norm.topk(value_keys).indices.tolist()
                s[reserved] = -1.0
            want = sorted(reserved + s.topk(budget - len(reserved)).indices.tolist())
            assert kept == want, (li, h)
    # the plain read (streaming by attention, re-chosen by the last queries) keeps others somewhere
    plain = hf_polyattn.returned_cache(model(doc, use_cache=True))
    assert any(not torch.equal(a.state.sparse_v, b.state.sparse_v) for a, b in zip(plain.layers, cache.layers))
    assert all(getattr(m, "selection_scores", None) is None for _, m in sparse_layers(model))


def test_a_read_document_answers_like_any_cache_and_equals_streaming_when_the_budget_holds_it_all():
    """With a budget above the document's keys nothing is chosen: the read leaves the plain read's state, and
    generate() on it continues as on the plain one (sparse_observe off: the streaming rule only)."""
    model = generating(build("llama", matched_memory_config(64, sinks=2, window=8, sparse_chunk=4)))
    perturb_polyattn(model)
    doc = prompt_ids(1, 40, seed=6)
    question = prompt_ids(1, 5, seed=7)
    ids = torch.cat([doc, question], 1)
    outs = []
    for reader in (lambda: hf_polyattn.returned_cache(model(doc, use_cache=True)),
                   lambda: read_document(model, doc, _Tok(), chunk=8)):
        with torch.no_grad():
            cache = reader()
            outs.append(model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                                       **hf_polyattn.cache_kwargs(cache)))
    assert torch.equal(outs[0], outs[1])


def test_read_document_in_bf16_is_finite():
    model = build("llama", matched_memory_config(4, sinks=1, window=4, sparse_chunk=2)).to(torch.bfloat16)
    doc = prompt_ids(1, 30, seed=8)
    scores = copy_scores(model, doc, PROMPT, chunk=8)
    assert all(s.dtype == torch.float32 and bool(torch.isfinite(s).all()) for s in scores.values())
    cache = read_document(model, doc, _Tok(), chunk=8)
    with torch.no_grad():
        logits = model(prompt_ids(1, 3, seed=9), use_cache=True, **hf_polyattn.cache_kwargs(cache)).logits
    assert bool(torch.isfinite(logits).all())


def test_bad_input_is_refused():
    model = build("llama", matched_memory_config(4, sinks=1, window=4, sparse_chunk=2))
    with pytest.raises(ValueError, match=r"input_ids must be one document as a \(1, tokens\) tensor"):
        read_document(model, prompt_ids(2, 10), _Tok())
    with pytest.raises(ValueError, match="attention_mask must be None or all ones"):
        copy_scores(model, prompt_ids(1, 10), PROMPT, attention_mask=torch.tensor([[0] + [1] * 9]))
    with pytest.raises(ValueError, match="chunk must be None or an int >= 1"):
        copy_scores(model, prompt_ids(1, 10), PROMPT, chunk=0)
    with pytest.raises(ValueError, match="no layer of this model has sparse_cache"):
        read_document(build("llama"), prompt_ids(1, 10), _Tok())
    with pytest.raises(ValueError, match="reaches position 187, past the model's 128: use a chunk of at most 5"):
        copy_scores(model, prompt_ids(1, 120), PROMPT, chunk=64)  # the tiny Llama's 128 positions
    with pytest.raises(ValueError, match="leaves 0 of the model's 128 positions for its copy"):
        copy_scores(model, prompt_ids(1, 125), PROMPT)
    # the default chunk shrinks to the positions left: 128 - 100 - 3 = 25 tokens a block, as an explicit 25
    doc = prompt_ids(1, 100, seed=10)
    got, want = copy_scores(model, doc, PROMPT), copy_scores(model, doc, PROMPT, chunk=25)
    assert all(torch.equal(got[li], want[li]) for li in want)
    # scores for a call on a state that already holds keys: refused, not applied to the wrong keys
    cache = hf_polyattn.returned_cache(model(prompt_ids(1, 12), use_cache=True))
    layers = sparse_layers(model)
    for _, m in layers:
        m.selection_scores = torch.zeros(1, model.config.num_key_value_heads, 4)
    try:
        with pytest.raises(ValueError, match="selection_scores rank the keys of a call on a fresh state"):
            model(prompt_ids(1, 4), use_cache=True, **hf_polyattn.cache_kwargs(cache))
    finally:
        for _, m in layers:
            m.selection_scores = None
