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


# ---------------------------------------------------------------------------- sources: demo, web, files, streams


FINEWEB_COLUMNS = ("text", "id", "dump", "url", "file_path", "language", "language_score", "token_count", "score",
                   "int_score")


def _fineweb_like_parquet(path, docs):
    """A parquet file with the columns of HuggingFaceFW/fineweb-edu's sample-10BT rows (text first)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    n = len(docs)
    table = pa.table({"text": docs, "id": [f"<urn:uuid:{i}>" for i in range(n)], "dump": ["CC-MAIN-2024-10"] * n,
                      "url": [f"https://example.org/{i}" for i in range(n)], "file_path": ["s3://x.parquet"] * n,
                      "language": ["en"] * n, "language_score": [0.97] * n,
                      "token_count": [len(d.split()) for d in docs], "score": [3.1] * n, "int_score": [3] * n})
    assert tuple(table.column_names) == FINEWEB_COLUMNS
    pq.write_table(table, path, row_group_size=7)  # several row groups: the stream crosses them
    return path


def test_demo_is_the_bundled_text_and_says_it_is_narrow():
    from hf_polyattn.data import demo_text_path

    path = demo_text_path()
    assert path.is_file() and path.parent.name == "bundled" and path.stat().st_size > 1_000_000
    d = load_text_data("demo", CharTok(), max_eval_tokens=100)
    ref = load_text_data(str(path), CharTok(), max_eval_tokens=100)
    assert torch.equal(d.train_ids, ref.train_ids) and torch.equal(d.eval_ids, ref.eval_ids)
    assert d.describe()["source"] == "demo" and "dataset" not in d.describe()
    assert len(d.notes) == 1 and "Tiny Shakespeare" in d.notes[0] and "--data web" in d.notes[0]
    assert ref.notes == []
    with pytest.raises(DataError, match="classification needs labelled sentences"):
        load_classification_data("demo")


def test_web_without_the_hub_is_the_bundled_text_and_says_so(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    d = load_text_data("web", CharTok(), max_eval_tokens=100)
    ref = load_text_data("demo", CharTok(), max_eval_tokens=100)
    assert torch.equal(d.train_ids, ref.train_ids)
    (note,) = d.notes
    assert "cannot be reached" in note and "HuggingFaceFW/fineweb-edu" in note and "Tiny Shakespeare" in note


def test_a_stream_holds_out_its_first_documents(tmp_path, text_file):
    """--streaming on a local parquet file shaped like the Hub's fineweb-edu: the first documents up to
    max_eval_tokens are held out, the ones after them train, capped at max_train_tokens; the same ids twice."""
    lines = open(text_file).read().splitlines()
    docs = ["\n".join(lines[i:i + 5]) for i in range(0, 300, 5)]  # 60 documents
    path = _fineweb_like_parquet(tmp_path / "sample.parquet", docs)
    d = load_text_data(str(path), CharTok(), streaming=True, max_eval_tokens=500, max_train_tokens=2000)
    enc = [[ord(c) % 256 for c in doc + "\n\n"] for doc in docs]
    held = 0
    while sum(len(e) for e in enc[:held]) < 500:
        held += 1
    assert d.eval_ids.tolist() == sum(enc[:held], [])[:500]
    assert d.train_ids.tolist() == sum(enc[held:], [])[:2000]
    assert d.describe()["held_out"].startswith(f"the stream's first {held} documents")
    again = load_text_data(str(path), CharTok(), streaming=True, max_eval_tokens=500, max_train_tokens=2000)
    assert torch.equal(again.train_ids, d.train_ids)
    # not streamed: the same file's rows, the tail held out
    rows = load_text_data(str(path), CharTok())
    assert rows.eval_ids.tolist()[:20] == [ord(c) % 256 for c in "\n".join(docs[54:])][:20]
    with pytest.raises(DataError, match="ended after 60 documents"):
        load_text_data(str(path), CharTok(), streaming=True, max_eval_tokens=10**6)
    with pytest.raises(DataError, match="no column 'content'"):
        load_text_data(str(path), CharTok(), streaming=True, text_column="content")


def test_a_hub_id_streams_with_its_config_and_split(tmp_path, text_file, monkeypatch):
    """--data web online: HuggingFaceFW/fineweb-edu, config sample-10BT, split train, streamed, column text; the
    Hub is replaced by the local parquet file (what load_dataset returns for the id is the same kind of stream)."""
    import datasets

    lines = open(text_file).read().splitlines()
    path = _fineweb_like_parquet(tmp_path / "sample.parquet", ["\n".join(lines[i:i + 5]) for i in range(0, 300, 5)])
    calls = []
    real = datasets.load_dataset

    def fake(source, name=None, split=None, streaming=False, **kw):
        if source == "parquet":
            return real(source, name=name, split=split, streaming=streaming, **kw)
        calls.append((source, name, split, streaming))
        return real("parquet", data_files={"train": str(path)}, split="train", streaming=streaming)

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setattr("hf_polyattn.checkpoints.hub_reachable", lambda timeout=3.0: True)
    monkeypatch.setattr(datasets, "load_dataset", fake)
    web = load_text_data("web", CharTok(), max_eval_tokens=500, max_train_tokens=2000)
    assert calls == [("HuggingFaceFW/fineweb-edu", "sample-10BT", "train", True)]
    local = load_text_data(str(path), CharTok(), streaming=True, max_eval_tokens=500, max_train_tokens=2000)
    assert torch.equal(web.eval_ids, local.eval_ids) and torch.equal(web.train_ids, local.train_ids)
    assert web.notes == [] and web.describe()["dataset"] == "HuggingFaceFW/fineweb-edu"
    load_text_data("someone/corpus", CharTok(), config="en", split="validation", text_column="text")
    assert calls[-1] == ("someone/corpus", "en", "validation", False)


def test_local_files_are_read_by_their_extension(tmp_path, text_file):
    import json

    lines = open(text_file).read().splitlines()[:50]
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("\n".join(json.dumps({"text": ln, "n": i}) for i, ln in enumerate(lines)) + "\n")
    txt = tmp_path / "docs.txt"
    txt.write_text("\n".join(lines) + "\n")
    a, b = load_text_data(str(jsonl), CharTok()), load_text_data(str(txt), CharTok())
    assert torch.equal(a.eval_ids, b.eval_ids) and torch.equal(a.train_ids, b.train_ids)
    assert load_text_data(str(txt), CharTok(), max_train_tokens=30).train_ids.numel() == 30
    bad = tmp_path / "docs.xml"
    bad.write_text("<a/>")
    with pytest.raises(DataError, match="cannot tell the format"):
        load_text_data(str(bad), CharTok())
