"""Retrieval-head scoring (hf_polyattn.eval.heads) on tiny random Llamas with a character tokenizer."""

from __future__ import annotations

import string

import pytest
import torch

from hf_polyattn.eval.heads import HeadScores, heads_for_share, score_heads, select_heads
from hf_polyattn.eval.passkey import PASSKEY_FILLER, PASSKEY_INTRO, PASSKEY_QUESTION, passkey_prompt

ALPHABET = string.ascii_letters + string.digits + " .,?!'"
DIGITS = [3 + ALPHABET.index(c) for c in string.digits]


class CharTokenizer:
    """One token per character (ids from 3), a BOS (id 1) in front by default, as Llama's tokenizers do."""

    bos_token_id = 1

    def __call__(self, text: str, add_special_tokens: bool = True):
        ids = [3 + ALPHABET.index(c) for c in text]
        return {"input_ids": ([self.bos_token_id] if add_special_tokens else []) + ids}


def _llama(seed=0, layers=2):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    # rope_theta 1e9: the last rotary pair of a head of 8 turns by 1e9^(-3/4) = 1.8e-7 rad per position, so a score
    # carried by that pair is the same at every distance (the forced head below)
    cfg = LlamaConfig(vocab_size=3 + len(ALPHABET), hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, rope_theta=1e9)
    return LlamaForCausalLM(cfg).eval()


def _force_needle_head(model, layer: int, kv_head: int) -> None:
    """Make kv head ``kv_head`` of ``layer`` (both its query heads) attend to digit tokens: embedding coordinate 0 is 1
    on digits only, coordinate 1 is 1 on every token; the head's keys read coordinate 0 and its queries coordinate
    1, both into the last (unrotated) dimension of the head, so every query scores digits ~50 above other tokens."""
    d = 8
    with torch.no_grad():
        emb = model.model.embed_tokens.weight
        emb[:, :2] = 0.0
        emb[DIGITS, 0] = 1.0
        emb[:, 1] = 1.0
        attn = model.model.layers[layer].self_attn
        dim = d // 2 - 1  # rotate_half pairs dims (i, i + d/2): i = d/2 - 1 has the lowest frequency
        k_row = kv_head * d + dim
        attn.k_proj.weight[k_row] = 0.0
        attn.k_proj.weight[k_row, 0] = 3.0
        for g in range(2):
            q_row = (kv_head * 2 + g) * d + dim
            attn.q_proj.weight[q_row] = 0.0
            attn.q_proj.weight[q_row, 1] = 3.0


def test_passkey_prompt_positions():
    tok = CharTokenizer()
    p = passkey_prompt(tok, length=400, depth=0.5, key="12345")
    assert p.ids[0] == 1 and len(p.ids) <= 400  # the BOS, then whole filler groups
    text = "".join(ALPHABET[i - 3] for i in p.ids[1:])
    assert text.startswith(PASSKEY_INTRO) and PASSKEY_FILLER in text
    assert text.endswith(" " + PASSKEY_QUESTION + " 12345")
    assert [text[i - 1] for i in p.needle_positions] == list(" 12345" * 2)  # " " + key, twice
    needle = text.index("The pass key is 12345. Remember it. 12345 is the pass key.")
    assert p.needle_positions[0] == 1 + needle + len("The pass key is")
    assert p.query_positions == list(range(len(p.ids) - 7, len(p.ids) - 1))  # each predicts the next key token
    assert abs(needle - text.index(PASSKEY_QUESTION) / 2) < len(PASSKEY_FILLER) + 60  # halfway through the filler
    shallow = passkey_prompt(tok, length=400, depth=0.0, key="12345")
    assert "".join(ALPHABET[i - 3] for i in shallow.ids[1:]).index("The pass key") == len(PASSKEY_INTRO) + 1
    with pytest.raises(ValueError, match="length must leave room for the filler"):
        passkey_prompt(tok, length=200, depth=0.5, key="12345")
    with pytest.raises(ValueError, match="depth"):
        passkey_prompt(tok, length=400, depth=1.5, key="12345")
    assert p.prompt == p.ids[: p.query_positions[0] + 1] and text.endswith(" 12345")  # answered after .prompt


def test_scores_run_and_are_deterministic_for_a_seed():
    model = _llama()
    kw = dict(num_prompts=2, length=360, sinks=2, window=16, text_ids=torch.randint(3, 60, (300,)))
    a = score_heads(model, CharTokenizer(), seed=3, **kw)
    b = score_heads(model, CharTokenizer(), seed=3, **kw)
    c = score_heads(model, CharTokenizer(), seed=4, **kw)
    assert isinstance(a, HeadScores) and a.retrieval.shape == (2, 2) and a.beyond_window.shape == (2, 2)
    assert torch.equal(a.retrieval, b.retrieval) and torch.equal(a.beyond_window, b.beyond_window)
    assert not torch.equal(a.retrieval, c.retrieval)  # other keys, other scores
    assert ((a.retrieval > 0) & (a.retrieval < 1)).all() and ((a.beyond_window > 0) & (a.beyond_window < 1)).all()
    assert a.text_windows == 1 and max(a.prompt_lengths) <= 360
    assert model.config._attn_implementation == "sdpa" and not model.training  # restored


def test_forced_needle_head_scores_highest():
    model = _llama()
    _force_needle_head(model, layer=1, kv_head=1)
    scores = score_heads(model, CharTokenizer(), num_prompts=3, length=400)
    best = scores.retrieval.flatten().argmax()
    assert divmod(int(best), 2) == (1, 1), scores.retrieval
    assert scores.retrieval[1, 1] > 0.5 and scores.retrieval.flatten().sort().values[-2] < 0.2
    assert select_heads(scores, 1) == ((1, 1),)
    assert scores.beyond_window is None  # no text given


def test_scores_equal_a_direct_computation_from_the_attention_weights():
    """Against output_attentions=True read without the scoring hooks: retrieval of one prompt and the mass beyond
    sinks + window on one text window, averaged over the query heads of each kv head."""
    model = _llama()
    tok = CharTokenizer()
    text = torch.randint(3, 60, (100,))
    scores = score_heads(model, tok, num_prompts=1, length=360, seed=5, text_ids=text, sinks=3, window=10)
    import random

    p = passkey_prompt(tok, length=360, depth=0.5, key=str(random.Random(5).randint(10000, 99999)))
    model.set_attn_implementation("eager")
    with torch.no_grad():
        prompt_w = model(torch.tensor([p.ids]), output_attentions=True, use_cache=False).attentions
        text_w = model(text[None], output_attentions=True, use_cache=False).attentions
    model.set_attn_implementation("sdpa")
    for layer in range(2):
        w = prompt_w[layer][0].double()  # (H, L, L)
        mass = torch.stack([w[:, q, p.needle_positions].sum(-1) for q in p.query_positions], -1).mean(-1)
        torch.testing.assert_close(scores.retrieval[layer], mass.reshape(2, 2).mean(-1).float())
        w = text_w[layer][0].double()
        rows = []
        for i in range(13, 100):  # queries with a key j >= 3 and i - j >= 10
            rows.append(w[:, i, 3:i - 9].sum(-1))
        far = torch.stack(rows, -1).mean(-1)
        torch.testing.assert_close(scores.beyond_window[layer], far.reshape(2, 2).mean(-1).float())


def test_select_heads():
    scores = torch.tensor([[0.1, 0.5, 0.2], [0.5, 0.0, 0.9]])
    assert select_heads(scores, 3) == ((1, 2), (0, 1), (1, 0))  # best first; the tie goes to the lower layer
    assert select_heads(scores, 0) == ()
    with pytest.raises(ValueError, match=r"k must be an int in \[0, 6\], got 7"):
        select_heads(scores, 7)
    with pytest.raises(ValueError, match="scores must be a 2-D float tensor"):
        select_heads(scores.flatten(), 1)
    with pytest.raises(ValueError, match="scores must be finite"):
        select_heads(torch.tensor([[float("nan")]]), 1)


def _scores(rows, layers=None):
    return HeadScores(retrieval=torch.tensor(rows), beyond_window=None, num_prompts=1, length=8, seed=0, sinks=4,
                      window=4, layers=layers)


def test_heads_for_share():
    # Gemma 3 270M's three global layers scored 0.50 / 0.20 / 0.05 (recipes/results/gemma3/)
    gemma = _scores([[0.5], [0.2], [0.05]])
    assert [heads_for_share(gemma, s) for s in (0.6, 0.8, 0.93, 0.95, 1.0)] == [1, 2, 2, 3, 3]
    # a share the best heads hold exactly needs no more of them; only the candidate layers count
    assert heads_for_share(_scores([[0.9], [0.8], [0.2]], layers=[1, 2]), 0.8) == 1
    assert heads_for_share(_scores([[0.9], [0.8], [0.2]]), 0.85) == 2  # 1.7 of 1.9 = 89%
    # negative scores count as none; no score above 0: no head
    assert heads_for_share(_scores([[0.3, -1.0], [0.1, 0.0]]), 0.75) == 1
    assert heads_for_share(_scores([[0.0, -0.2]]), 0.8) == 0
    for bad in (0, 1.5, -0.1, True, "0.8"):
        with pytest.raises(ValueError, match=r"share must be a number in \(0, 1\]"):
            heads_for_share(gemma, bad)


def test_bad_arguments_name_themselves():
    model = _llama(layers=1)
    with pytest.raises(ValueError, match="num_prompts must be an int >= 1, got 0"):
        score_heads(model, CharTokenizer(), num_prompts=0)
    with pytest.raises(ValueError, match=r"text_ids must hold more than sinks \+ window = 132 tokens"):
        score_heads(model, CharTokenizer(), length=400, text_ids=list(range(3, 40)))
