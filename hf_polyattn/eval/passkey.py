"""The passkey prompt (Mohtashami & Jaggi 2023, "Landmark Attention"; used by LongLoRA, StreamingLLM, LoLCATs,
Lizard): a fixed filler sentence repeated around one needle holding a 5-digit key, then the question.

One builder for the two places that read it: passkey retrieval (``long_context.passkey_retrieval``: the model
answers after ``PasskeyPrompt.prompt``) and head scoring (``heads.score_heads``: the attention that the answer's
queries put on the needle's key tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PASSKEY_FILLER", "PASSKEY_INTRO", "PASSKEY_NEEDLE", "PASSKEY_QUESTION", "PasskeyPrompt", "passkey_prompt"]

PASSKEY_INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
                 "I will quiz you about the important information there.")
PASSKEY_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
PASSKEY_NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
PASSKEY_QUESTION = "What is the pass key? The pass key is"


@dataclass
class PasskeyPrompt:
    """One passkey prompt as token ids, with the positions the retrieval score reads."""

    ids: list[int]
    key: str
    depth: float
    needle_positions: list[int]  # the key's tokens inside the needle (both mentions)
    query_positions: list[int]  # the queries whose next token is a token of the key in the answer

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


def passkey_prompt(tokenizer, *, length: int, depth: float, key: str) -> PasskeyPrompt:
    """The passkey prompt of about ``length`` tokens (whole filler sentences: at most ``length``) with the needle
    after ``depth`` (0..1) of the filler, ending with the answer ``key``.

    Each part is tokenised on its own and the ids concatenated, so that the key's tokens sit at known positions (the
    key is always tokenised as " " + key, in the needle and in the answer alike)."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth!r}")
    head, middle, tail = (part.strip() for part in PASSKEY_NEEDLE.split("{key}"))
    key_ids = _encode(tokenizer, " " + key)
    lead = _leading_special_tokens(tokenizer, PASSKEY_INTRO)
    intro = _encode(tokenizer, PASSKEY_INTRO)
    filler = _encode(tokenizer, " " + PASSKEY_FILLER)
    first = _encode(tokenizer, " " + head)
    between = _encode(tokenizer, middle)
    needle = first + key_ids + between + key_ids + _encode(tokenizer, " " + tail)
    question = _encode(tokenizer, " " + PASSKEY_QUESTION)
    fixed = len(lead) + len(intro) + len(needle) + len(question) + len(key_ids)
    reps = (length - fixed) // max(len(filler), 1)
    if reps < 1:
        raise ValueError(f"length must leave room for the filler: the passkey prompt's fixed parts take {fixed} "
                         f"tokens and the filler sentences {len(filler)}, got length={length}")
    before = round(depth * reps)
    ids = lead + intro + filler * before
    start = len(ids)
    ids += needle + filler * (reps - before) + question
    answer = len(ids)
    ids += key_ids
    second = start + len(first) + len(key_ids) + len(between)
    needle_positions = [*range(start + len(first), start + len(first) + len(key_ids)),
                        *range(second, second + len(key_ids))]
    return PasskeyPrompt(ids, key, depth, needle_positions, [answer - 1 + t for t in range(len(key_ids))])
