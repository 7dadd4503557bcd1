"""Data for the retrofit recipes: plain text for causal LMs, csv/tsv for classification.

Everything goes through ``datasets.load_dataset`` ("text" / "csv" builders for local files, a Hub
dataset id for users who are online). Errors are raised *before* any training starts: a missing
file, a dataset without the expected column, a Hub id that cannot be reached offline.

Splits are fixed and seeded so that every run of every attention kind sees the same data:

* text: the last ``eval_fraction`` of the lines is held out (a contiguous tail, never seen in
  training), both parts tokenised as one stream each;
* classification: ``datasets.Dataset.train_test_split(test_size=num_eval, seed=seed)``.

Batches are a pure function of (seed, step, micro-step, rank): a resumed run, or a second rank,
draws exactly the batches an uninterrupted run would have drawn (no sampler state to save).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "DataError",
    "ClassificationData",
    "TextData",
    "load_classification_data",
    "load_text_data",
    "lm_batch",
    "classification_batch",
]


class DataError(ValueError):
    """A data source that cannot be used (missing file, missing column, unreachable id)."""


def _looks_like_path(source: str) -> bool:
    """A file path rather than a Hub dataset id ('owner/name' or 'name')."""
    return (
        source.startswith((".", "/", "~"))
        or source.count("/") > 1
        or source.endswith((".txt", ".csv", ".tsv", ".json", ".jsonl", ".parquet"))
    )


def _load(source: str, *, kind: str, split: str = "train", **kwargs: Any):
    """``load_dataset`` for a local file (builder by extension) or a Hub dataset id."""
    import datasets

    if os.path.exists(source):
        if os.path.isdir(source):
            raise DataError(f"{source!r} is a directory; pass the data file itself")
        ext = os.path.splitext(source)[1].lower()
        if kind == "text":
            builder, extra = "text", {}
        elif ext == ".tsv":
            builder, extra = "csv", {"delimiter": "\t", "quoting": 3}  # quoting=3: QUOTE_NONE, SST-2 has raw quotes
        elif ext == ".csv":
            builder, extra = "csv", {}
        elif ext in (".json", ".jsonl"):
            builder, extra = "json", {}
        elif ext == ".parquet":
            builder, extra = "parquet", {}
        else:
            raise DataError(f"cannot tell the format of {source!r}: use .csv, .tsv, .json(l) or .parquet")
        return datasets.load_dataset(builder, data_files={"train": source}, split="train", **extra)
    if _looks_like_path(source):
        raise DataError(f"data file {source!r} does not exist (cwd: {os.getcwd()})")
    from .checkpoints import hub_reachable

    offline = os.environ.get("HF_DATASETS_OFFLINE", "0") not in ("0", "") or os.environ.get(
        "HF_HUB_OFFLINE", "0") not in ("0", "")
    try:
        if not offline and not hub_reachable():
            raise ConnectionError("the Hugging Face Hub cannot be reached (no network?)")
        return datasets.load_dataset(source, split=split, **kwargs)
    except Exception as e:  # ConnectionError, FileNotFoundError, DatasetNotFoundError, ...
        raise DataError(
            f"could not load dataset {source!r} (split {split!r}): {type(e).__name__}: {e}. "
            "Without network access pass a local file instead (e.g. a .tsv of sentence<TAB>label rows)."
        ) from e


# ---------------------------------------------------------------------------- causal LM text


@dataclass
class TextData:
    train_ids: torch.Tensor  # 1-D int64 token stream
    eval_ids: torch.Tensor  # 1-D int64 token stream (held-out tail)
    source: str
    eval_fraction: float
    text_column: str

    def describe(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "held_out": f"last {self.eval_fraction:.0%} of the lines",
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
) -> TextData:
    """Token streams of a text corpus: training part and a held-out tail of the lines."""
    if not 0.0 < eval_fraction < 1.0:
        raise DataError(f"eval_fraction must be in (0, 1), got {eval_fraction}")
    ds = _load(source, kind="text", split=split)
    if text_column not in ds.column_names:
        raise DataError(f"dataset {source!r} has no column {text_column!r}; columns: {ds.column_names}")
    lines = ds[text_column]
    if len(lines) < 10:
        raise DataError(f"dataset {source!r} has only {len(lines)} lines of text")
    cut = int(round(len(lines) * (1.0 - eval_fraction)))
    train_text = "\n".join(lines[:cut])
    eval_text = "\n".join(lines[cut:])

    def encode(text: str) -> torch.Tensor:
        return torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)

    train_ids, eval_ids = encode(train_text), encode(eval_text)
    if max_eval_tokens is not None:
        eval_ids = eval_ids[:max_eval_tokens]
    return TextData(train_ids, eval_ids, source, eval_fraction, text_column)


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
) -> ClassificationData:
    """A csv/tsv (or Hub dataset) with a text and an integer label column, plus a seeded validation split."""
    ds = _load(source, kind="csv", split=split)
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
