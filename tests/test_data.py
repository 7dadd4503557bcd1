import pytest
import torch

from hf_polyattn.data import (
    DataError,
    classification_batch,
    lm_batch,
    load_classification_data,
    load_text_data,
)


class CharTok:
    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) % 256 for c in text]}


def test_missing_file_is_a_clear_error():
    with pytest.raises(DataError, match="does not exist"):
        load_text_data("./no/such/file.txt", CharTok())
    with pytest.raises(DataError, match="does not exist"):
        load_classification_data("../nowhere/sst2.tsv")


def test_missing_column_names_the_columns(tsv_file, text_file):
    with pytest.raises(DataError, match=r"no column 'review'.*columns: \['sentence', 'label'\]"):
        load_classification_data(tsv_file, text_column="review")
    with pytest.raises(DataError, match="no column 'target'"):
        load_classification_data(tsv_file, label_column="target")
    with pytest.raises(DataError, match="no column 'body'"):
        load_text_data(text_file, CharTok(), text_column="body")


def test_unreachable_hub_dataset_fails_fast(monkeypatch):
    monkeypatch.setattr("hf_polyattn.checkpoints.hub_reachable", lambda timeout=3.0: False)
    with pytest.raises(DataError, match="could not load dataset 'someone/some-dataset'.*local file"):
        load_text_data("someone/some-dataset", CharTok())


def test_text_holds_out_the_tail(text_file):
    d = load_text_data(text_file, CharTok(), eval_fraction=0.1)
    lines = open(text_file).read().splitlines()
    tail = "\n".join(lines[270:])
    assert d.eval_ids.tolist() == [ord(c) % 256 for c in tail]
    assert d.train_ids.numel() + d.eval_ids.numel() + 1 == len("\n".join(lines))  # +1: the joining newline


def test_lm_batches_are_a_function_of_the_step(text_file):
    d = load_text_data(text_file, CharTok())
    a = lm_batch(d.train_ids, batch_size=3, context=16, seed=1, step=5)
    b = lm_batch(d.train_ids, batch_size=3, context=16, seed=1, step=5)
    assert torch.equal(a["input_ids"], b["input_ids"])
    assert a["input_ids"].shape == (3, 16) and torch.equal(a["labels"], a["input_ids"])
    # two processes with 3 windows each see the 6 windows of one process: the global batch, in rank order
    ranks = [lm_batch(d.train_ids, batch_size=3, context=16, seed=1, step=5, rank=r, world=2)["input_ids"]
             for r in (0, 1)]
    one = lm_batch(d.train_ids, batch_size=6, context=16, seed=1, step=5)["input_ids"]
    assert torch.equal(torch.cat(ranks), one) and not torch.equal(ranks[0], ranks[1])
    with pytest.raises(ValueError, match="rank must be in"):
        lm_batch(d.train_ids, batch_size=3, context=16, seed=1, step=5, rank=1)


def test_classification_split_is_seeded_and_disjoint(tsv_file, tiny_dirs):
    from transformers import AutoTokenizer

    d1 = load_classification_data(tsv_file, num_eval=50, seed=3)
    d2 = load_classification_data(tsv_file, num_eval=50, seed=3)
    assert d1.eval["sentence"][:] == d2.eval["sentence"][:]
    assert len(d1.train) == 250 and d1.num_labels == 2
    tok = AutoTokenizer.from_pretrained(tiny_dirs["bert"])
    b = classification_batch(d1, tok, batch_size=4, max_length=32, seed=0, step=0)
    assert b["input_ids"].shape[0] == 4 and b["labels"].shape == (4,)
    halves = [classification_batch(d1, tok, batch_size=2, max_length=32, seed=0, step=0, rank=r, world=2)["labels"]
              for r in (0, 1)]
    assert torch.equal(torch.cat(halves), b["labels"])  # the global batch, split between the ranks
    with pytest.raises(DataError, match="leaves no training rows"):
        load_classification_data(tsv_file, num_eval=300)
