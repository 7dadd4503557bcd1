"""Retrieval-shaped training text: synthetic recall tasks laid into the training corpus.

Attention transfer teaches each linear-time layer to reproduce its softmax teacher on the training windows. On plain
prose almost no query needs a key from far back, so nothing teaches the state to hold one: with every head
linear-time the SmolLM2 retrofit retrieved a passkey at 1 of 10 depths at 1k tokens. Mixing in windows where a query
must copy a number written long before gives the transfer (and the fine-tuning loss, whose labels include the
copied digits) examples of exactly that.

The wording here is deliberately unlike every evaluation template (``eval/passkey.py``: 'classic', 'vault',
'multi'): other framing sentences, names and items instead of pass keys, vault or door codes, keys of 3 to 8
digits, and the training corpus itself as the filler, so that a gain on the evaluation templates is retrieval and not
memorised wording. Two task shapes:

* ``record``: one to four records "<Name> wrote down the number <key>." spread over the filler, then one recalled at
  the end, "The number <Name> wrote down was <key>.";
* ``table``: a list of "<item> = <key>;" entries early in the window, filler, then two to four of them repeated.

``RetrievalMixer`` replaces a fraction of a batch's windows with such documents of the same length (the filler taken
from the window it replaces, so the corpus's own text surrounds the task), deterministically from a seed and the
step, on every process alike.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

__all__ = ["SHAPES", "RetrievalMixer", "retrieval_document"]

SHAPES = ("record", "table")

_NAMES = ("Adela", "Borin", "Cosmo", "Delphine", "Edric", "Fenna", "Gideon", "Hollis", "Ingrid", "Jasper", "Kestrel",
          "Lorcan", "Maren", "Nestor", "Odile", "Percival", "Quilla", "Rowan", "Sabine", "Tobiah", "Ulrika",
          "Vesper", "Wendel", "Yara")
_ITEMS = ("lantern", "anchor", "compass", "thimble", "saddle", "kettle", "ledger", "chisel", "bellows", "spindle",
          "trowel", "quill", "barrel", "hinge", "ribbon", "tankard", "satchel", "pulley", "ladle", "whistle")


def _key(rng: random.Random) -> str:
    n = rng.randint(3, 8)
    return str(rng.randint(10 ** (n - 1), 10**n - 1))


def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _record_parts(rng: random.Random) -> tuple[list[str], str]:
    names = rng.sample(_NAMES, rng.randint(1, 4))
    keys = {name: _key(rng) for name in names}
    asked = rng.choice(names)
    return ([f" {name} wrote down the number {keys[name]}." for name in names],
            f" The number {asked} wrote down was {keys[asked]}.")


def _table_parts(rng: random.Random) -> tuple[list[str], str]:
    items = rng.sample(_ITEMS, rng.randint(4, 8))
    keys = {item: _key(rng) for item in items}
    table = " Inventory: " + " ".join(f"{item} = {keys[item]};" for item in items)
    asked = rng.sample(items, rng.randint(2, min(4, len(items))))
    return [table], " Recount: " + " ".join(f"{item} = {keys[item]};" for item in asked)


def retrieval_document(tokenizer, filler: list[int], length: int, rng: random.Random, shape: str) -> list[int]:
    """``length`` token ids: the task of ``shape`` (``SHAPES``) laid into ``filler`` (the corpus's token ids, at least
    ``length`` of them): the facts at random places in the first 3/4 of the window, the recall at its end."""
    if shape not in SHAPES:
        raise ValueError(f"shape must be one of {list(SHAPES)}, got {shape!r}")
    facts, recall = (_record_parts if shape == "record" else _table_parts)(rng)
    fact_ids = [_encode(tokenizer, f) for f in facts]
    recall_ids = _encode(tokenizer, recall)
    room = length - sum(map(len, fact_ids)) - len(recall_ids)
    if room < 4 * len(fact_ids):
        raise ValueError(f"length={length} leaves no room for the filler around a {shape!r} task of "
                         f"{length - room} tokens")
    if len(filler) < room:
        raise ValueError(f"the filler has {len(filler)} tokens, fewer than the {room} the document needs")
    cuts = sorted(rng.sample(range(1, max(2, room * 3 // 4)), len(fact_ids)))
    out, last = [], 0
    for cut, ids in zip(cuts, fact_ids):
        out += filler[last:cut] + ids
        last = cut
    out += filler[last:room] + recall_ids
    assert len(out) == length
    return out


@dataclass
class RetrievalMixer:
    """Replaces ``fraction`` of each batch's rows by retrieval documents (``retrieval_document``) of the same length,
    the filler taken from the row replaced. ``shapes``: which task shapes, drawn uniformly; ``seed``: with the step
    and the process's rank, which rows and which tasks (every run with the same seed draws the same)."""

    tokenizer: object
    fraction: float
    seed: int | str = 0
    shapes: tuple[str, ...] = SHAPES

    def __post_init__(self) -> None:
        if isinstance(self.fraction, bool) or not isinstance(self.fraction, (int, float)) or \
                not 0.0 < float(self.fraction) <= 1.0:
            raise ValueError(f"fraction must be in (0, 1], got {self.fraction!r}")
        bad = [s for s in self.shapes if s not in SHAPES]
        if not self.shapes or bad:
            raise ValueError(f"shapes must be a non-empty subset of {list(SHAPES)}, got {list(self.shapes)!r}")

    def __call__(self, batch: dict[str, torch.Tensor], *, step: int, micro: int = 0, rank: int = 0
                 ) -> dict[str, torch.Tensor]:
        """``batch`` (input_ids / labels / attention_mask of full windows) with some rows replaced; labels equal the
        new inputs (the recalled digits are predicted like every other token)."""
        rng = random.Random(f"{self.seed}-{step}-{micro}-{rank}")
        ids = batch["input_ids"].clone()
        for row in range(ids.shape[0]):
            if rng.random() >= self.fraction:
                continue
            filler = ids[row].tolist()
            doc = retrieval_document(self.tokenizer, filler, len(filler), rng, rng.choice(self.shapes))
            ids[row] = torch.tensor(doc, dtype=ids.dtype)
        out = dict(batch)
        out["input_ids"], out["labels"] = ids, ids.clone()
        return out
