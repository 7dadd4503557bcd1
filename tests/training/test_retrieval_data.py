"""Retrieval-shaped training text (hf_polyattn/training/retrieval_data.py)."""

from __future__ import annotations

import random
import re

import pytest
import torch

from hf_polyattn.eval.passkey import TEMPLATES
from hf_polyattn.training.retrieval_data import SHAPES, RetrievalMixer, retrieval_document
from tests.conftest import TEXT


@pytest.fixture(scope="module")
def tok(tiny_dirs):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_dirs["llama"])


@pytest.fixture(scope="module")
def filler(tok):
    return tok(TEXT.read_text(), add_special_tokens=False)["input_ids"][:4000]


@pytest.mark.parametrize("shape", SHAPES)
def test_document_recalls_a_fact_written_earlier_at_the_exact_length(tok, filler, shape):
    for seed in range(5):
        doc = retrieval_document(tok, filler, 700, random.Random(seed), shape)
        assert len(doc) == 700
        text = tok.decode(doc)
        if shape == "record":
            facts = dict(re.findall(r"(\w+) wrote down the number (\d+)\.", text))
            asked, key = re.search(r"The number (\w+) wrote down was (\d+)\.$", text).groups()
        else:
            facts = dict(re.findall(r"(\w+) = (\d+);", text.split(" Recount:")[0]))
            recalled = re.findall(r"(\w+) = (\d+);", text.split(" Recount:")[1])
            assert len(recalled) >= 2
            asked, key = recalled[-1]
        assert facts[asked] == key and 3 <= len(key) <= 8
        # the facts sit in the first three quarters: the recall reads far back
        assert len(tok.decode(doc[: len(doc) * 3 // 4 + 40])) > text.index(key)


def test_wording_shares_nothing_with_the_evaluation_templates(tok, filler):
    text = " ".join(tok.decode(retrieval_document(tok, filler, 600, random.Random(s), shape))
                    for s in range(20) for shape in SHAPES)
    for t in TEMPLATES.values():
        for phrase in (t.needle.split("{")[0].strip(), t.question.split("{")[0].strip()):
            assert phrase and phrase not in text, phrase
    assert "pass key" not in text and "vault" not in text and "door" not in text


def test_mixer_replaces_the_drawn_rows_deterministically(tok, filler):
    rows = torch.tensor([filler[i * 500 : i * 500 + 480] for i in range(6)])
    batch = {"input_ids": rows, "labels": rows.clone(), "attention_mask": torch.ones_like(rows)}
    mix = RetrievalMixer(tok, 0.5, seed=3)
    a, b = mix(batch, step=7), mix(batch, step=7)
    assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["labels"], a["input_ids"])
    changed = [i for i in range(6) if not torch.equal(a["input_ids"][i], rows[i])]
    assert 0 < len(changed) < 6 and a["input_ids"].shape == rows.shape
    assert not torch.equal(mix(batch, step=8)["input_ids"], a["input_ids"])
    every = RetrievalMixer(tok, 1.0, seed=3, shapes=("table",))(batch, step=0)
    assert all("Recount:" in tok.decode(r) for r in every["input_ids"])


def test_mixer_and_document_refuse_bad_settings(tok, filler):
    for fraction in (0, 1.5, True, "0.5"):
        with pytest.raises(ValueError, match="fraction must be in"):
            RetrievalMixer(tok, fraction)
    with pytest.raises(ValueError, match="shapes must be"):
        RetrievalMixer(tok, 0.5, shapes=("needle",))
    with pytest.raises(ValueError, match="shape must be one of"):
        retrieval_document(tok, filler, 600, random.Random(0), "needle")
    with pytest.raises(ValueError, match="leaves no room"):
        retrieval_document(tok, filler, 30, random.Random(0), "table")
    with pytest.raises(ValueError, match="filler has"):
        retrieval_document(tok, filler[:100], 600, random.Random(0), "record")
