"""Passkey prompts: a key hidden in filler text, asked for at the end.

``classic`` is the prompt of Mohtashami & Jaggi 2023 ("Landmark Attention"; used by LongLoRA, StreamingLLM,
LoLCATs, Lizard): a fixed filler sentence repeated around one needle holding a 5-digit key, then the question. A
model tuned on text shaped like it could pass it by its wording alone, so two more templates change everything
but the task:

* ``vault``: another instruction, another filler (three sentences), another phrasing of the needle and the
  question, keys of 4 to 7 digits;
* ``multi``: several needles (door codes of four colours, 4 to 7 digits each, spread over the filler), one of them
  asked: the model must pick the asked one among keys of the same shape.

One builder (``passkey_prompt``) for the places that read them: passkey retrieval (``long_context.passkey_retrieval``:
the model answers after ``PasskeyPrompt.prompt``) and head scoring (``heads.score_heads``: the attention that the
answer's queries put on the needle's key tokens). Training text for a retrieval-aware transfer must not use these
templates (``training/retrieval_data.py`` has its own), so that evaluation measures retrieval, not wording.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

__all__ = ["PASSKEY_FILLER", "PASSKEY_INTRO", "PASSKEY_NEEDLE", "PASSKEY_QUESTION", "TEMPLATES", "PasskeyPrompt",
           "PasskeyTemplate", "draw_passkey", "passkey_prompt"]

PASSKEY_INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
                 "I will quiz you about the important information there.")
PASSKEY_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
PASSKEY_NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
PASSKEY_QUESTION = "What is the pass key? The pass key is"


@dataclass(frozen=True)
class PasskeyTemplate:
    """The wording of a passkey prompt. ``needle`` and ``question`` hold ``{key}`` / ``{label}`` slots (the question
    ends where the key's first token comes next); ``digits``: the (fewest, most) digits of a key; ``labels``: the
    labels of a multi-key prompt (one needle per label, one asked), empty for a single key."""

    name: str
    intro: str
    filler: str
    needle: str
    question: str
    digits: tuple[int, int] = (5, 5)
    labels: tuple[str, ...] = ()


TEMPLATES: dict[str, PasskeyTemplate] = {
    "classic": PasskeyTemplate("classic", PASSKEY_INTRO, PASSKEY_FILLER, PASSKEY_NEEDLE, PASSKEY_QUESTION),
    "vault": PasskeyTemplate(
        "vault",
        "Below is a long report. Somewhere in it a vault code is written down. Read carefully: at the end you will "
        "be asked for the code.",
        "Ships left the harbour before dawn and returned with the evening tide. The market opened when the bells "
        "rang twice. Old maps were kept in a cedar chest by the window.",
        "Note for the record: the vault code is {key}. Once more, the vault code is {key}.",
        "Question: which code opens the vault? Answer: the vault code is",
        digits=(4, 7)),
    "multi": PasskeyTemplate(
        "multi",
        "The notes below mention several door codes. Every door has its own code. Keep all of them in mind.",
        "Rain fell on the hills all afternoon. The baker counted the loaves on the top shelf. A cat slept in the "
        "warm corner of the kitchen.",
        "The code for the {label} door is {key}.",
        "What is the code for the {label} door? The code for the {label} door is",
        digits=(4, 7), labels=("red", "blue", "green", "yellow")),
}


@dataclass
class PasskeyPrompt:
    """One passkey prompt as token ids, with the positions the retrieval score reads."""

    ids: list[int]
    key: str
    depth: float
    needle_positions: list[int]  # the asked key's tokens inside its needle (every mention)
    query_positions: list[int]  # the queries whose next token is a token of the key in the answer
    template: str = "classic"
    label: str | None = None  # the asked label of a multi-key prompt
    others: tuple[str, ...] = ()  # the keys of the other needles (multi-key)
    question_start: int | None = None  # where the question starts: the document before it is read first in multi-turn

    @property
    def document(self) -> list[int]:
        """The ids before the question: what a multi-turn evaluation reads into the cache in its own call."""
        return self.ids[: self.question_start]

    def question(self, tokenizer, label: str | None = None) -> list[int]:
        """The question's ids (asking ``label`` of a multi-key template; the asked one by default), tokenised as in
        the prompt: after a space, ending where the key's first token comes next."""
        t = TEMPLATES[self.template]
        text = t.question if t.labels == () else t.question.replace("{label}", label or self.label)
        return _encode(tokenizer, " " + text)

    @property
    def prompt(self) -> list[int]:
        """The ids up to the question's end: what a model answers after (``ids`` ends with the answer)."""
        return self.ids[: self.query_positions[0] + 1]


def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _leading_special_tokens(tokenizer, text: str) -> list[int]:
    """The tokens the tokenizer puts before ``text`` by default (a BOS), so that the prompt starts as a model saw
    its training text start."""
    plain, full = _encode(tokenizer, text), list(tokenizer(text)["input_ids"])
    for start in range(len(full) - len(plain) + 1):
        if full[start:start + len(plain)] == plain:
            return full[:start]
    return []


def _template(template: str | PasskeyTemplate) -> PasskeyTemplate:
    if isinstance(template, PasskeyTemplate):
        return template
    if template not in TEMPLATES:
        raise ValueError(f"template must be one of {list(TEMPLATES)}, got {template!r}")
    return TEMPLATES[template]


def _needle(tokenizer, t: PasskeyTemplate, key_ids: list[int], label: str | None) -> tuple[list[int], list[int]]:
    """(the needle's ids, the offsets of the key's tokens in them): the text around each ``{key}`` tokenised on its
    own (after a space, unless it starts with punctuation: "The pass key is" / ". Remember it." / "is the pass
    key."), the key always as " " + key."""
    text = t.needle if label is None else t.needle.replace("{label}", label)
    parts = [p.strip() for p in text.split("{key}")]
    ids, at = [], []
    for i, part in enumerate(parts):
        if part:
            ids += _encode(tokenizer, part if part[0] in ".,;:!?" else " " + part)
        if i < len(parts) - 1:
            at += range(len(ids), len(ids) + len(key_ids))
            ids += key_ids
    return ids, at


def draw_passkey(rng: random.Random, template: str | PasskeyTemplate = "classic") -> dict:
    """A key (and, for a multi-key template, the asked label and the other needles' keys) drawn from ``rng``: the
    arguments of ``passkey_prompt`` besides the tokenizer, length and depth."""
    t = _template(template)

    def key() -> str:
        lo, hi = t.digits
        n = lo if lo == hi else rng.randint(lo, hi)  # one draw per key when the length is fixed: the earlier keys
        return str(rng.randint(10 ** (n - 1), 10**n - 1))

    if not t.labels:
        return {"key": key()}
    keys = []
    while len(keys) < len(t.labels):
        k = key()
        if k not in keys:
            keys.append(k)
    ask = rng.randrange(len(t.labels))
    return {"key": keys[ask], "label": t.labels[ask], "others": tuple(k for i, k in enumerate(keys) if i != ask)}


def passkey_prompt(tokenizer, *, length: int, depth: float, key: str, template: str | PasskeyTemplate = "classic",
                   label: str | None = None, others: tuple[str, ...] = ()) -> PasskeyPrompt:
    """The passkey prompt of about ``length`` tokens (whole filler sentences: at most ``length``) with the asked
    needle after ``depth`` (0..1) of the filler, ending with the answer ``key``.

    A multi-key ``template`` takes the asked ``label`` and the ``others`` keys (one per other label, in the
    template's label order): their needles sit at depths spread evenly from the asked one's (``depth + i / n`` mod 1
    for the i-th other of n needles), so the asked key is neither always first nor always last.
    Each part is tokenised on its own and the ids concatenated, so that the key's tokens sit at known positions."""
    t = _template(template)
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth!r}")
    if t.labels:
        if label not in t.labels:
            raise ValueError(f"template {t.name!r} asks for one of the labels {list(t.labels)}, got label={label!r}")
        if len(others) != len(t.labels) - 1:
            raise ValueError(f"template {t.name!r} needs {len(t.labels) - 1} other keys (others), got {len(others)}")
    elif label is not None or others:
        raise ValueError(f"template {t.name!r} holds one key: label and others are for multi-key templates")
    key_ids = _encode(tokenizer, " " + key)
    needle, offsets = _needle(tokenizer, t, key_ids, label)
    needles = [(depth, needle, offsets)]
    if t.labels:
        rest = [lab for lab in t.labels if lab != label]
        n = len(t.labels)
        for i, (lab, k) in enumerate(zip(rest, others), start=1):
            ids_i, _ = _needle(tokenizer, t, _encode(tokenizer, " " + k), lab)
            needles.append(((depth + i / n) % 1.0, ids_i, []))
    lead = _leading_special_tokens(tokenizer, t.intro)
    intro = _encode(tokenizer, t.intro)
    filler = _encode(tokenizer, " " + t.filler)
    question_text = t.question if label is None else t.question.replace("{label}", label)
    question = _encode(tokenizer, " " + question_text)
    fixed = len(lead) + len(intro) + sum(len(x[1]) for x in needles) + len(question) + len(key_ids)
    reps = (length - fixed) // max(len(filler), 1)
    if reps < 1:
        raise ValueError(f"length must leave room for the filler: the passkey prompt's fixed parts take {fixed} "
                         f"tokens and the filler sentences {len(filler)}, got length={length}")
    ids = lead + intro
    placed, needle_positions = 0, []
    for at, ids_n, offs in sorted(needles, key=lambda x: x[0]):
        before = round(at * reps)
        ids += filler * (before - placed)
        placed = before
        if offs:
            needle_positions = [len(ids) + o for o in offs]
        ids += ids_n
    ids += filler * (reps - placed) + question
    answer = len(ids)
    ids += key_ids
    return PasskeyPrompt(ids, key, depth, needle_positions, [answer - 1 + i for i in range(len(key_ids))], t.name,
                         label, tuple(others), answer - len(question))
