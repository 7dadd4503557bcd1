"""Reading a prompt in forward calls of ``prefill_chunk`` tokens (eval/turns.prefill) gives what one call gives: the
same last logits and greedy answers for softmax (a Llama; a Gemma 3 whose sliding layers keep a window of 8 keys, so
the chunks cross it), a converted model's recurrent state and StreamingLLM's window; a sparse cache, which chooses
its keys at the end of every call, is refused by name rather than scored on another selection."""

from __future__ import annotations

import copy

import pytest
import torch

import hf_polyattn
from hf_polyattn.eval.long_context import LongContextSettings, passkey_retrieval, streaming_config
from hf_polyattn.eval.ruler import run_ruler
from hf_polyattn.eval.turns import check_prefill_chunk, generate_prompt, generate_turns, prefill


@pytest.fixture(scope="module")
def tok(tiny_dirs):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_dirs["llama"])


@pytest.fixture(scope="module")
def llama(tok):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                        max_position_embeddings=2048, pad_token_id=0, eos_token_id=1,
                                        bos_token_id=1)).eval()


@pytest.fixture(scope="module")
def gemma(tok):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    config = Gemma3TextConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                              max_position_embeddings=2048, sliding_window=8, pad_token_id=0, eos_token_id=1,
                              bos_token_id=1,
                              layer_types=["sliding_attention", "sliding_attention", "full_attention"])
    return Gemma3ForCausalLM(config).eval()


def _converted(model, **opts):
    return hf_polyattn.convert(copy.deepcopy(model), hf_polyattn.PolyAttnConfig.for_kind("linear", **opts))


MODELS = {
    "llama": lambda m: m["llama"],
    "gemma-sliding-layers": lambda m: m["gemma"],
    "linear-window-sinks": lambda m: _converted(m["llama"], window=8, sinks=2),
    # the presets' hybrid: on the global layer one softmax kv head (a full cache) beside a kernel head
    "gemma-hybrid": lambda m: _converted(m["gemma"], window=8, sinks=2, softmax_heads=((2, 0),), decay="gate",
                                                  window_mix=True, qk_norm=True, feature_proj=16),
    "streaming": lambda m: hf_polyattn.convert(copy.deepcopy(m["llama"]), streaming_config(sinks=2, window=8)),
}


@pytest.fixture(scope="module")
def models(llama, gemma):
    return {"llama": llama, "gemma": gemma}


def _last_logits(model, ids, chunk):
    with torch.no_grad():
        if not chunk:
            return model(ids).logits[0, -1]
        cache = prefill(model, ids[:, :-1], chunk)
        pos = ids.shape[1]
        return model(ids[:, -1:], attention_mask=torch.ones(1, pos, dtype=torch.long), use_cache=True,
                     **hf_polyattn.cache_kwargs(cache)).logits[0, -1]


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("chunk", [5, 16, 64])
def test_chunked_read_equals_one_call(models, name, chunk):
    model = MODELS[name](models)
    ids = torch.randint(2, 300, (1, 83), generator=torch.Generator().manual_seed(chunk))
    one, chunked = _last_logits(model, ids, 0), _last_logits(model, ids, chunk)
    assert one.std() > 0.01  # a real prediction, not a constant
    torch.testing.assert_close(chunked, one, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", list(MODELS))
def test_chunked_generation_answers_as_one_call(models, name):
    model = MODELS[name](models)
    answers = set()
    for seed in range(3):
        prompt = torch.randint(2, 300, (90,), generator=torch.Generator().manual_seed(seed)).tolist()
        one = generate_prompt(model, prompt, max_new_tokens=6, pad_token_id=0)
        assert generate_prompt(model, prompt, max_new_tokens=6, pad_token_id=0, prefill_chunk=16) == one
        assert len(one) == 6
        answers.add(tuple(one))
        doc, q = prompt[:80], prompt[80:]
        turns = generate_turns(model, doc, [q], max_new_tokens=6, pad_token_id=0)
        assert generate_turns(model, doc, [q], max_new_tokens=6, pad_token_id=0, prefill_chunk=16) == turns
    assert len(answers) > 1  # not one constant answer


def test_ruler_and_passkey_record_the_chunk_and_score_the_same(gemma, tok):
    one = run_ruler(gemma, tok, [1024], ["niah_single_1", "vt"], samples=1)
    chunked = run_ruler(gemma, tok, [1024], ["niah_single_1", "vt"], samples=1, prefill_chunk=200)
    assert chunked["prefill_chunk"] == 200 and "prefill_chunk" not in one
    assert [o["output"] for o in chunked["outputs"]] == [o["output"] for o in one["outputs"]]
    single = passkey_retrieval(gemma, tok, [300], depths=2, seed=3)
    chunked = passkey_retrieval(gemma, tok, [300], depths=2, seed=3, prefill_chunk=64)
    assert chunked["answers"] == single["answers"] and chunked["prefill_chunk"] == 64


def test_a_sparse_cache_is_refused(llama, tok):
    sparse = _converted(llama, window=8, sinks=2, sparse_cache=8, sparse_chunk=4, sparse_score="attention",
                        window_mix=True, window_mix_init=0.0)
    with pytest.raises(ValueError, match=r"prefill_chunk=16: .*sparse cache .*prefill_chunk=0"):
        check_prefill_chunk(sparse, 16)
    with pytest.raises(ValueError, match="prefill_chunk=16"):
        run_ruler(sparse, tok, [1024], ["vt"], samples=1, prefill_chunk=16)
    with pytest.raises(ValueError, match="prefill_chunk=16"):
        passkey_retrieval(sparse, tok, [300], depths=1, prefill_chunk=16)
    assert check_prefill_chunk(sparse, 0) == 0  # one call: what the sparse cache is measured with


@pytest.mark.parametrize("bad", [-1, True, 2.0, "16"])
def test_bad_chunk_is_refused(llama, bad):
    with pytest.raises(ValueError, match="prefill_chunk must be an int >= 0"):
        check_prefill_chunk(llama, bad)
    with pytest.raises(ValueError, match="prefill_chunk must be an int >= 0"):
        LongContextSettings(prefill_chunk=bad)


def test_settings_refuse_the_chunk_with_the_sparse_baseline():
    with pytest.raises(ValueError, match=r"prefill_chunk=512 with the 'sparse' baseline"):
        LongContextSettings(prefill_chunk=512, baselines=("softmax", "sparse"))
    assert LongContextSettings(prefill_chunk=512, baselines=("softmax", "streaming")).prefill_chunk == 512
