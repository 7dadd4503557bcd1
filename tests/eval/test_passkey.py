"""Passkey templates (hf_polyattn/eval/passkey.py) and their retrieval score (eval/long_context.py)."""

from __future__ import annotations

import random
import re

import pytest
import torch

from hf_polyattn.eval.long_context import LongContextSettings, evaluate_model, long_context_markdown, passkey_retrieval
from hf_polyattn.eval.passkey import TEMPLATES, draw_passkey, passkey_prompt


@pytest.fixture(scope="module")
def tok(tiny_dirs):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_dirs["llama"])


def _text(tok, ids):
    return tok.decode(ids)


@pytest.mark.parametrize("template", list(TEMPLATES))
def test_prompt_holds_the_asked_key_where_it_says(tok, template):
    drawn = draw_passkey(random.Random(3), template)
    p = passkey_prompt(tok, length=600, depth=0.4, template=template, **drawn)
    t = TEMPLATES[template]
    assert len(p.ids) <= 600 and p.template == template
    assert tok.decode([p.ids[i] for i in p.needle_positions]).split() == [drawn["key"]] * t.needle.count("{key}")
    assert tok.decode([p.ids[i + 1] for i in p.query_positions]).strip() == drawn["key"]
    text = _text(tok, p.prompt)
    assert t.intro in text and t.filler in text and not text.endswith(drawn["key"])
    digits = [k for k in re.findall(r"\d+", text)]
    if t.labels:  # every label's needle, the asked one's key among same-shaped keys
        assert sorted(digits) == sorted([drawn["key"]] * 1 + list(drawn["others"]))
        assert f"the {drawn['label']} door?" in text
        assert all(t.digits[0] <= len(k) <= t.digits[1] for k in digits)
    else:
        assert set(digits) == {drawn["key"]}


def test_classic_keys_are_the_earlier_runs_keys_and_the_other_templates_vary_their_length():
    rng, old = random.Random(0), random.Random(0)
    assert [draw_passkey(rng)["key"] for _ in range(20)] == [str(old.randint(10000, 99999)) for _ in range(20)]
    lengths = {len(draw_passkey(random.Random(s), "vault")["key"]) for s in range(60)}
    assert lengths == {4, 5, 6, 7}


def test_multi_key_depths_spread_and_the_asked_needle_moves(tok):
    drawn = draw_passkey(random.Random(1), "multi")
    firsts = []
    for depth in (0.05, 0.95):
        p = passkey_prompt(tok, length=800, depth=depth, template="multi", **drawn)
        text = _text(tok, p.prompt)
        firsts.append(text.index(drawn["key"]) < min(text.index(k) for k in drawn["others"]))
    assert firsts == [True, False]


def test_prompt_refuses_what_does_not_fit_the_template(tok):
    with pytest.raises(ValueError, match="template must be one of"):
        passkey_prompt(tok, length=600, depth=0.5, key="123", template="nope")
    with pytest.raises(ValueError, match="label and others are for multi-key templates"):
        passkey_prompt(tok, length=600, depth=0.5, key="12345", label="red")
    with pytest.raises(ValueError, match="asks for one of the labels"):
        passkey_prompt(tok, length=600, depth=0.5, key="1234", template="multi", label="purple", others=("1", "2", "3"))
    with pytest.raises(ValueError, match="needs 3 other keys"):
        passkey_prompt(tok, length=600, depth=0.5, key="1234", template="multi", label="red", others=("1",))
    with pytest.raises(ValueError, match="passkey_templates"):
        LongContextSettings(passkey_templates=("classic", "nope"))
    with pytest.raises(ValueError, match="passkey_templates"):
        LongContextSettings(passkey_templates=())


class _Reader(torch.nn.Module):
    """A stand-in causal LM that answers the asked key of any template (``right``), or another number of the prompt
    (a distractor's key, or the key + 1)."""

    def __init__(self, tok, right: bool):
        super().__init__()
        self.tok, self.right = tok, right
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.config = type("C", (), {"max_position_embeddings": 4096})()

    def generate(self, ids, attention_mask=None, max_new_tokens=8, do_sample=False, pad_token_id=None):
        text = self.tok.decode(ids[0])
        asked = re.search(r"code for the (\w+) door\?", text)
        if asked:
            codes = dict(re.findall(r"code for the (\w+) door is (\d+)\.", text))
            key = codes[asked.group(1)]
            wrong = next(k for lab, k in codes.items() if lab != asked.group(1))
        else:
            key = re.search(r"(?:pass key|vault code) is (\d+)", text).group(1)
            wrong = str(int(key) + 1)
        answer = f" {key if self.right else wrong}."
        new = torch.tensor([self.tok(answer, add_special_tokens=False)["input_ids"]])
        return torch.cat([ids, new], dim=1)


@pytest.mark.parametrize("template", list(TEMPLATES))
def test_retrieval_scores_the_asked_key_only(tok, template):
    right = passkey_retrieval(_Reader(tok, True), tok, [400, 700], depths=3, seed=5, template=template)
    wrong = passkey_retrieval(_Reader(tok, False), tok, [400, 700], depths=3, seed=5, template=template)
    assert right["hits"] == [[1, 1, 1]] * 2 and wrong["hits"] == [[0, 0, 0]] * 2
    assert right["template"] == template and right["keys"] == wrong["keys"]


def test_every_template_is_a_row_entry_and_a_table_column(tok):
    settings = LongContextSettings(contexts=(16,), max_tokens=64, passkey_lengths=(400,), passkey_depths=2,
                                   passkey_templates=("classic", "vault", "multi"), baselines=())
    model = _Reader(tok, True)
    model.forward = lambda *a, **k: None
    row = {"label": "reader", "attention": "softmax"}
    for i, name in enumerate(settings.passkey_templates):
        key = "passkey" if i == 0 else f"passkey_{name}"
        row[key] = passkey_retrieval(model, tok, settings.passkey_lengths, settings.passkey_depths, template=name)
    row["perplexity"] = [{"context": 16, "perplexity": 2.0}]
    result = {"settings": {"contexts": [16], "passkey_lengths": [400], "passkey_depths": 2, "passkey_seed": 0,
                           "passkey_templates": list(settings.passkey_templates)}, "rows": [row], "tokens": 64}
    md = long_context_markdown(result)
    assert "classic @ 400" in md and "vault @ 400" in md and "multi @ 400" in md and md.count("2/2") == 3
    assert evaluate_model.__doc__  # evaluate_model writes these keys (tested with a real model in test_long_context)
