"""Multi-turn retrieval (eval/long_context.generate_turns): the document read into the cache by its own forward call,
then questions asked on that cache. For softmax the split changes nothing (the greedy answers of both turns equal
the single-prompt answers on the same tokens); a converted model with a sparse cache runs both paths (and, without
sparse_observe, answers the same: its streaming selection does not depend on where calls end)."""

from __future__ import annotations

import copy

import pytest
import torch

import hf_polyattn
from hf_polyattn.eval.long_context import LongContextSettings, generate_turns, passkey_retrieval
from hf_polyattn.eval.passkey import passkey_prompt


@pytest.fixture(scope="module")
def tiny(tiny_dirs):
    """The tiny Llama's shape with 1,024 positions: passkey prompts of the fixtures' byte-level tokenizer take ~3
    tokens a word, and a second question goes beyond the first answer."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(tiny_dirs["llama"])
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=1024, pad_token_id=0, eos_token_id=1,
                                         bos_token_id=1)).eval()
    return model, tok


def _single(model, ids, n):
    t = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(t, attention_mask=torch.ones_like(t), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, t.shape[1]:].tolist()


def _turns_equal_single(model, seed, n=6):
    gen = torch.Generator().manual_seed(seed)
    doc, q1, q2 = (torch.randint(2, 300, (k,), generator=gen).tolist() for k in (120, 9, 7))
    a1, a2 = generate_turns(model, doc, [q1, q2], max_new_tokens=n, pad_token_id=0)
    assert len(a1) == len(a2) == n
    assert a1 == _single(model, doc + q1, n)
    assert a2 == _single(model, doc + q1 + a1 + q2, n)  # the second question after the first answer
    return a1, a2


def test_softmax_turns_equal_the_single_prompt(tiny):
    model, _ = tiny
    answers = [_turns_equal_single(model, seed) for seed in range(3)]
    assert len({tuple(a1) for a1, _ in answers}) > 1  # not one constant answer


SPARSE = dict(window=8, sinks=2, sparse_cache=8, sparse_chunk=4, sparse_score="attention")


@pytest.mark.parametrize("opts", [SPARSE, {**SPARSE, "sparse_observe": 4, "sparse_observe_pool": 1}],
                         ids=["streaming-rule", "observe"])
def test_converted_model_with_a_sparse_cache_runs_both_paths(tiny, opts):
    model, tok = tiny
    conv = hf_polyattn.convert(copy.deepcopy(model), hf_polyattn.PolyAttnConfig.for_kind(
        "linear", window_mix=True, window_mix_init=0.0, **opts))
    with torch.no_grad():  # the model keeps its own cache: hf_polyattn's recurrent layers, not a growing KV cache
        cache = hf_polyattn.returned_cache(conv(torch.randint(2, 300, (1, 40)), use_cache=True))
    assert all(type(layer).__name__ == "PolyAttnCacheLayer" for layer in cache.layers)
    if "sparse_observe" not in opts:  # the streaming rule chooses the same keys whatever the calls
        _turns_equal_single(conv, 0)
    single = passkey_retrieval(conv, tok, [300], depths=2, seed=3)
    multi = passkey_retrieval(conv, tok, [300], depths=2, seed=3, multi_turn=True)
    assert multi["keys"] == single["keys"] and multi["multi_turn"] is True
    assert len(multi["answers_second"][0]) == 2 and multi["keys_second"] == multi["keys"]
    if "sparse_observe" not in opts:
        assert multi["answers"] == single["answers"]


def test_passkey_multi_turn_scores_two_questions(tiny):
    model, tok = tiny
    single = passkey_retrieval(model, tok, [400], depths=2, seed=1, template="multi")
    multi = passkey_retrieval(model, tok, [400], depths=2, seed=1, template="multi", multi_turn=True)
    assert multi["answers"] == single["answers"] and multi["hits"] == single["hits"]
    assert set(multi) >= {"hits_second", "answers_second", "keys_second", "accuracy_second"}
    # the second question asks another label's key: one of the other needles' keys, not the first one
    assert all(k2 != k1 for k1, k2 in zip(multi["keys"][0], multi["keys_second"][0]))
    p = passkey_prompt(tok, length=300, depth=0.5, key="12345")
    assert p.document + p.question(tok) == p.prompt  # the split keeps the single prompt's tokens


def test_multi_turn_refuses_a_model_without_a_cache(tiny):
    class NoCache(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def forward(self, ids, attention_mask=None, use_cache=None):
            return {"logits": torch.zeros(1, ids.shape[1], 4)}

    with pytest.raises(ValueError, match="multi-turn retrieval needs one"):
        generate_turns(NoCache(), [1, 2, 3], [[4]], max_new_tokens=2, pad_token_id=0)
    with pytest.raises(ValueError, match="multi_turn must be True or False"):
        LongContextSettings(contexts=(64,), multi_turn="yes")


def test_read_copy_reads_a_sparse_cache_by_copy_scores_and_says_so(tiny):
    """read='copy' (hf_polyattn.read_document) where the model has a sparse cache; a softmax model keeps every key,
    reads by 'stream', and its result says so."""
    from hf_polyattn.eval.ruler import run_ruler

    model, tok = tiny
    assert passkey_retrieval(model, tok, [300], depths=1, seed=3, multi_turn=True, read="copy")["read"] == "stream"
    conv = hf_polyattn.convert(copy.deepcopy(model), hf_polyattn.PolyAttnConfig.for_kind(
        "linear", window_mix=True, window_mix_init=0.0, **SPARSE))
    multi = passkey_retrieval(conv, tok, [300], depths=2, seed=3, multi_turn=True, read="copy")
    assert multi["read"] == "copy" and len(multi["answers"][0]) == 2
    ruler = run_ruler(conv, tok, [512], ["niah_single_1"], samples=1, multi_turn=True, read="copy")
    assert ruler["read"] == "copy" and len(ruler["outputs"]) == 1
    with pytest.raises(ValueError, match=r"read must be one of \['stream', 'copy'\], got 'later'"):
        LongContextSettings(contexts=(64,), read="later")
    with pytest.raises(ValueError, match="read must be one of"):
        passkey_retrieval(conv, tok, [300], depths=1, multi_turn=True, read="copies")


def test_a_length_run_alone_asks_the_keys_of_the_longer_run(tiny):
    model, tok = tiny
    both = passkey_retrieval(model, tok, [250, 300], depths=2, seed=3)
    alone = passkey_retrieval(model, tok, [300], depths=2, seed=3, draw_lengths=[250, 300])
    assert alone["keys"] == [both["keys"][1]] and alone["answers"] == [both["answers"][1]]
    assert passkey_retrieval(model, tok, [300], depths=2, seed=3)["keys"] == [both["keys"][0]]
    with pytest.raises(ValueError, match="draw_lengths \\[250\\] must hold every passkey length \\[300\\]"):
        passkey_retrieval(model, tok, [300], depths=1, draw_lengths=[250])
