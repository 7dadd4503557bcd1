"""Data of the retrofit pipeline: text for causal LMs, labelled sentences for classification.

A data source (``--data``) is one of

* ``demo``: Tiny Shakespeare, shipped inside the package (``demo_text_path()``; about 1 MB, public domain);
* ``web``: a general web-text corpus, an educational sample streamed from the Hub (``WEB_CORPUS``: the first
  documents of HuggingFaceFW/fineweb-edu ``sample-10BT``); without the Hub, the bundled demo text, and the run says
  how narrow that is;
* a local file: ``.txt`` (one line a row), ``.jsonl`` / ``.json``, ``.parquet``, ``.csv`` / ``.tsv`` (tab-separated,
  no quoting: SST-2 has raw quotes);
* a Hub dataset id, with ``config`` (its configuration name), ``split`` and the text column.

Everything goes through ``datasets.load_dataset``; ``streaming=True`` reads a Hub dataset (or a local file) as a
stream and keeps only the first documents it needs. Errors are raised *before* any training starts: a missing
file, a dataset without the expected column, a Hub id that cannot be reached offline.

Splits are fixed and seeded so that every run of every attention kind sees the same data:

* text: the last ``eval_fraction`` of the rows (lines of a .txt) is held out, a contiguous tail never seen in
  training; a stream holds out its first documents (``max_eval_tokens`` tokens) and trains on the ones after them;
  both parts are tokenised as one stream each;
* classification: ``datasets.Dataset.train_test_split(test_size=num_eval, seed=seed)``.

Batches are a pure function of (seed, step, micro-step, rank): a resumed run, or a second rank,
draws exactly the batches an uninterrupted run would have drawn (no sampler state to save).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "DEMO",
    "WEB",
    "WEB_CORPUS",
    "DataError",
    "ClassificationData",
    "TextData",
    "demo_text_path",
    "load_classification_data",
    "load_text_data",
    "lm_batch",
    "classification_batch",
]

DEMO = "demo"
WEB = "web"
# --data web: a sample of an educational web corpus (FineWeb-Edu, Penedo et al. 2024), read as a stream
WEB_CORPUS = {"source": "HuggingFaceFW/fineweb-edu", "config": "sample-10BT", "split": "train", "text_column": "text"}
# tokens a stream is read for when the run does not say (max_train_tokens): the long-context preset trains on
# 60 x 2 x 1,024 + 20 x 1,024 + 20 x 2,048 = 184k tokens drawn at random from it
STREAM_TRAIN_TOKENS = 1_000_000
# 309,082 tokens of SmolLM2's tokenizer (the whole file tokenized at once), 1,016,242 bytes
NARROW = ("the bundled demo text is Tiny Shakespeare, one author's plays (309,082 SmolLM2 tokens): a retrofit "
          "tuned on it is only as general as that text; for a general model use --data web (a streamed web-text "
          "sample, needs the Hub) or a corpus of your own")


class DataError(ValueError):
    """A data source that cannot be used (missing file, missing column, unreachable id)."""


def demo_text_path() -> Path:
    """The bundled Tiny Shakespeare (``--data demo``): a file inside the installed package."""
    from importlib.resources import files

    path = Path(str(files("hf_polyattn") / "bundled" / "tinyshakespeare.txt"))
    if not path.is_file():  # a broken install: the package data did not come with it
        raise DataError(f"the bundled demo text is missing ({path}): reinstall hf_polyattn")
    return path


def _offline() -> bool:
    return any(os.environ.get(v, "0") not in ("0", "", "false", "False") for v in ("HF_HUB_OFFLINE",
                                                                                   "HF_DATASETS_OFFLINE"))


def _looks_like_path(source: str) -> bool:
    """A file path rather than a Hub dataset id ('owner/name' or 'name')."""
    return (
        source.startswith((".", "/", "~"))
        or source.count("/") > 1
        or source.endswith(FILE_BUILDERS)
    )


# local files: extension -> (datasets builder, its arguments)
FILE_BUILDERS = (".txt", ".csv", ".tsv", ".json", ".jsonl", ".parquet")


def _file_builder(source: str) -> tuple[str, dict[str, Any]]:
    ext = os.path.splitext(source)[1].lower()
    if ext == ".txt":
        return "text", {}
    if ext == ".tsv":
        return "csv", {"delimiter": "\t", "quoting": 3}  # quoting=3: QUOTE_NONE, SST-2 has raw quotes
    if ext == ".csv":
        return "csv", {}
    if ext in (".json", ".jsonl"):
        return "json", {}
    if ext == ".parquet":
        return "parquet", {}
    raise DataError(f"cannot tell the format of {source!r} from its extension: use .txt, .csv, .tsv, .json(l) or "
                    ".parquet")


def _load(source: str, *, split: str = "train", config: str | None = None, streaming: bool = False):
    """``load_dataset`` for a local file (builder by extension) or a Hub dataset id."""
    import datasets

    if os.path.exists(source):
        if os.path.isdir(source):
            raise DataError(f"{source!r} is a directory; pass the data file itself")
        builder, extra = _file_builder(source)
        return datasets.load_dataset(builder, data_files={"train": source}, split="train", streaming=streaming,
                                     **extra)
    if _looks_like_path(source):
        raise DataError(f"data file {source!r} does not exist (cwd: {os.getcwd()})")
    from . import checkpoints

    try:
        if not _offline() and not checkpoints.hub_reachable():
            raise ConnectionError("the Hugging Face Hub cannot be reached (no network?)")
        return datasets.load_dataset(source, name=config, split=split, streaming=streaming)
    except Exception as e:  # ConnectionError, FileNotFoundError, DatasetNotFoundError, ...
        raise DataError(
            f"could not load dataset {source!r} (config {config!r}, split {split!r}): {type(e).__name__}: {e}. "
            "Without network access pass a local file instead (.txt, .jsonl, .parquet, or a .tsv of "
            "sentence<TAB>label rows), or --data demo for the bundled text."
        ) from e


def _columns(ds) -> list[str]:
    names = ds.column_names
    if names is None:  # a stream whose features are unknown until read: its first row tells
        names = list(next(iter(ds)).keys())
    return list(names)


# ---------------------------------------------------------------------------- causal LM text


@dataclass
class TextData:
    train_ids: torch.Tensor  # 1-D int64 token stream
    eval_ids: torch.Tensor  # 1-D int64 token stream (held-out part)
    source: str  # what --data said ('demo', 'web', a path, a Hub id)
    eval_fraction: float
    text_column: str
    dataset: str | None = None  # the Hub dataset the text came from, when it came from the Hub
    held_out: str = ""  # which part is held out, in words
    notes: list[str] = field(default_factory=list)  # what a run should say about its data (narrow, offline)

    def describe(self) -> dict[str, Any]:
        return {
            "source": self.source,
            **({"dataset": self.dataset} if self.dataset else {}),
            "held_out": self.held_out or f"last {self.eval_fraction:.0%} of the lines",
            "train_tokens": int(self.train_ids.numel()),
            "eval_tokens": int(self.eval_ids.numel()),
        }


def load_text_data(
    source: str,
    tokenizer,
    *,
    eval_fraction: float = 0.1,
    text_column: str = "text",
    max_eval_tokens: int | None = None,
    split: str = "train",
    config: str | None = None,
    streaming: bool = False,
    max_train_tokens: int | None = None,
) -> TextData:
    """Token streams of a text corpus (``source``: see the module docstring): a training part and a held-out
    part (the tail of the rows; a stream's first documents)."""
    if not 0.0 < eval_fraction < 1.0:
        raise DataError(f"eval_fraction must be in (0, 1), got {eval_fraction}")
    notes: list[str] = []
    dataset = None
    given = source
    if source == WEB:
        from . import checkpoints

        if _offline() or not checkpoints.hub_reachable():
            notes.append(f"--data web: the Hugging Face Hub cannot be reached, so the run uses the bundled demo "
                         f"text instead of {WEB_CORPUS['source']} ({WEB_CORPUS['config']}); {NARROW}")
            source = DEMO
        else:
            source, config, split = WEB_CORPUS["source"], WEB_CORPUS["config"], WEB_CORPUS["split"]
            text_column, streaming = WEB_CORPUS["text_column"], True
    if source == DEMO:
        if given == DEMO:
            notes.append(f"--data demo: {NARROW}")
        source, text_column, streaming = str(demo_text_path()), "text", False
    elif not os.path.exists(source) and not _looks_like_path(source):
        dataset = source
    ds = _load(source, split=split, config=config, streaming=streaming)
    columns = _columns(ds)
    if text_column not in columns:
        raise DataError(f"dataset {given!r} has no column {text_column!r}; columns: {columns} (set --text_column)")

    def encode(text: str) -> torch.Tensor:
        return torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)

    if streaming:
        train_ids, eval_ids, held_out = _read_stream(ds, text_column, encode, given,
                                                     eval_tokens=max_eval_tokens or 8192,
                                                     train_tokens=max_train_tokens or STREAM_TRAIN_TOKENS)
        return TextData(train_ids, eval_ids, given, eval_fraction, text_column, dataset, held_out, notes)
    lines = ds[text_column]
    if len(lines) < 10:
        raise DataError(f"dataset {given!r} has only {len(lines)} rows of text")
    cut = int(round(len(lines) * (1.0 - eval_fraction)))
    train_ids, eval_ids = encode("\n".join(lines[:cut])), encode("\n".join(lines[cut:]))
    if max_train_tokens is not None:
        train_ids = train_ids[:max_train_tokens]
    if max_eval_tokens is not None:
        eval_ids = eval_ids[:max_eval_tokens]
    return TextData(train_ids, eval_ids, given, eval_fraction, text_column, dataset,
                    f"last {eval_fraction:.0%} of the {'lines' if source.endswith('.txt') else 'rows'}", notes)


def _read_stream(ds, text_column: str, encode, name: str, *, eval_tokens: int, train_tokens: int):
    """The first documents of a stream: held out until ``eval_tokens`` tokens, then training until
    ``train_tokens``; documents are separated by a blank line."""
    held: list[torch.Tensor] = []
    train: list[torch.Tensor] = []
    n_held = n_train = docs = 0
    for row in ds:
        text = row[text_column]
        if not text:
            continue
        ids = encode(text + "\n\n")
        docs += 1
        if n_held < eval_tokens:
            held.append(ids)
            n_held += ids.numel()
        else:
            train.append(ids)
            n_train += ids.numel()
            if n_train >= train_tokens:
                break
    if n_held < eval_tokens or not n_train:
        raise DataError(f"the stream {name!r} ended after {docs} documents ({n_held + n_train} tokens): fewer than "
                        f"the {eval_tokens} held-out tokens and a training part it needs")
    held_docs = len(held)
    eval_ids = torch.cat(held)[:eval_tokens]
    return torch.cat(train)[:train_tokens], eval_ids, (f"the stream's first {held_docs} documents (training reads "
                                                       f"the {docs - held_docs} after them)")


def _generator(seed: int, step: int, micro: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed((seed * 1_000_003 + step * 10_007 + micro * 101) % (2**63))
    return g


def _global_draw(high: int, batch_size: int, seed: int, step: int, micro: int, rank: int, world: int) -> list[int]:
    """Rank ``rank``'s slice of the global batch of ``batch_size * world`` draws for (seed, step, micro): N
    processes with B rows each see the rows one process with N * B rows sees (sharded runs are compared with
    single-process ones this way); one process draws exactly what it drew before ranks took slices."""
    if not 0 <= rank < world:
        raise ValueError(f"rank must be in [0, world={world}), got {rank}")
    draws = torch.randint(0, high, (batch_size * world,), generator=_generator(seed, step, micro))
    return draws[rank * batch_size : (rank + 1) * batch_size].tolist()


def lm_batch(ids: torch.Tensor, *, batch_size: int, context: int, seed: int, step: int, micro: int = 0,
             rank: int = 0, world: int = 1) -> dict[str, torch.Tensor]:
    """``batch_size`` random windows of ``context`` tokens (labels = inputs; the model shifts): rank ``rank``'s
    slice of the global batch of ``world`` processes."""
    n = ids.numel() - context
    if n <= 0:
        raise DataError(f"the text has {ids.numel()} tokens, fewer than the context {context}")
    starts = _global_draw(n, batch_size, seed, step, micro, rank, world)
    x = torch.stack([ids[s : s + context] for s in starts])
    return {"input_ids": x, "labels": x.clone(), "attention_mask": torch.ones_like(x)}


# ---------------------------------------------------------------------------- classification


@dataclass
class ClassificationData:
    train: Any  # datasets.Dataset with columns text, label
    eval: Any
    source: str
    text_column: str
    label_column: str
    num_labels: int
    seed: int

    def describe(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "validation": f"{len(self.eval)} rows, train_test_split(seed={self.seed})",
            "train_rows": len(self.train),
            "eval_rows": len(self.eval),
            "num_labels": self.num_labels,
        }


def load_classification_data(
    source: str,
    *,
    text_column: str = "sentence",
    label_column: str = "label",
    num_eval: int = 2000,
    seed: int = 0,
    split: str = "train",
    config: str | None = None,
) -> ClassificationData:
    """A csv/tsv/jsonl/parquet file (or Hub dataset) with a text and an integer label column, plus a seeded
    validation split."""
    if source in (DEMO, WEB):
        raise DataError(f"--data {source} is a text corpus for causal LMs; classification needs labelled sentences: "
                        "a local .tsv/.csv/.jsonl/.parquet file or a Hub dataset id (SST-2, for instance, is not "
                        "bundled: the Hub's stanfordnlp/sst2, or GLUE's SST-2 train.tsv)")
    if os.path.exists(source) and source.lower().endswith(".txt"):
        raise DataError(f"{source!r} is plain text: classification reads a .tsv/.csv/.jsonl/.parquet file with "
                        "a text and a label column")
    ds = _load(source, split=split, config=config)
    for col in (text_column, label_column):
        if col not in ds.column_names:
            raise DataError(
                f"dataset {source!r} has no column {col!r}; columns: {ds.column_names} "
                "(set --text_column / --label_column)"
            )
    ds = ds.select_columns([text_column, label_column])
    ds = ds.filter(lambda r: r[text_column] is not None and r[label_column] is not None)
    labels = ds[label_column]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in labels[:1000]):
        raise DataError(f"column {label_column!r} of {source!r} must hold integer class ids, got e.g. {labels[:3]}")
    num_labels = int(max(labels)) + 1
    if num_eval >= len(ds):
        raise DataError(f"num_eval={num_eval} leaves no training rows ({len(ds)} rows in {source!r})")
    parts = ds.train_test_split(test_size=num_eval, seed=seed, shuffle=True)
    return ClassificationData(parts["train"], parts["test"], source, text_column, label_column, num_labels, seed)


def classification_batch(data: ClassificationData, tokenizer, *, batch_size: int, max_length: int, seed: int,
                         step: int, micro: int = 0, rank: int = 0, world: int = 1, split: str = "train",
                         indices: list[int] | None = None) -> dict[str, torch.Tensor]:
    """A padded batch: rank ``rank``'s random training rows of the global batch for (seed, step, micro), or the
    given ``indices``."""
    ds = data.train if split == "train" else data.eval
    if indices is None:
        indices = _global_draw(len(ds), batch_size, seed, step, micro, rank, world)
    rows = ds[indices]
    enc = tokenizer(rows[data.text_column], padding=True, truncation=True, max_length=max_length,
                    return_tensors="pt")
    enc = {k: v for k, v in enc.items() if k in ("input_ids", "attention_mask", "token_type_ids")}
    enc["labels"] = torch.tensor(rows[data.label_column], dtype=torch.long)
    return enc
