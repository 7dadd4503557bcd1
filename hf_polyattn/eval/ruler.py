"""A RULER-style synthetic long-context suite (Hsieh et al. 2024, "RULER: What's the Real Context Size of Your
Long-Context Language Models?", arXiv:2404.06654), generated from a seed: nothing is downloaded.

Why: one passkey template measures one skill (copy a number that stands out of a repeated filler). RULER's tasks
vary what stands out (a number among repeated noise, among real text, a uuid), how many needles compete (several
keys, one asked; several values of one key; several keys asked at once) and whether the answer needs more than one
look (a chain of variable assignments; the most frequent words of a list). A bounded cache (StreamingLLM, a sparse
cache) can pass the passkey and still fail these, so they are scored side by side.

Tasks (names as in RULER's configuration):

* ``niah_single_1``: a 7-digit number for a key word, in a repeated-noise haystack ("The grass is green. ...");
* ``niah_single_2``: the same needle in essay-like text (lines of the bundled Tiny Shakespeare, from a seeded place);
* ``niah_single_3``: a uuid for the key, in essay-like text;
* ``niah_multikey_1``: four needles of distinct keys in essay-like text, one asked;
* ``niah_multivalue``: four needles of one key (four values), all asked;
* ``niah_multiquery``: four needles of distinct keys, all four asked in one question;
* ``vt``: variable tracking: a chain ``VAR A = 12345``, ``VAR B = A`` ... (five variables) spread over the noise;
  every variable of the chain is asked;
* ``cwe``: common words extraction: a numbered list of words, ten of which appear more often than the rest; the
  ten are asked.

Every sample is built as text and tokenised as a whole; its length is the largest haystack (whole units: noise
sentences, text lines, list items) whose prompt is at most the target length (binary search over the units), so a
prompt is within a few units of its target (``check_length``: at least 90 % of it). RULER's score is kept: string-
match recall (``string_match_all``: the fraction of the gold strings found, case-insensitive, in the generated
text), averaged over the samples. A sample is a pure function of (task, length, seed, index) and the tokenizer.
"""

from __future__ import annotations

import random
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

__all__ = ["RULER_TASKS", "RulerSample", "check_length", "ruler_sample", "run_ruler", "ruler_markdown",
           "string_match_all"]

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NIAH_INTRO = ("Some special magic {kind} are hidden within the following text. Make sure to memorize it. I will quiz "
              "you about the {kind} afterwards.")
NIAH_NEEDLE = "One of the special magic {kind} for {key} is: {value}."
NIAH_QUESTION = ("What are all the special magic {kind} for {key} mentioned in the provided text? The special magic "
                 "{kind} for {key} mentioned in the provided text are")
VT_INTRO = "Memorize and track the chain(s) of variable assignment hidden in the following text."
VT_QUESTION = ("Question: Find all variables that are assigned the value {value} in the text above. Answer: According "
               "to the chain(s) of variable assignment in the text above, {n} variables are assigned the value "
               "{value}, they are:")
CWE_INTRO = ("Below is a numbered list of words. In these words, some appear more often than others. Memorize the "
             "ones that appear most often.")
CWE_QUESTION = ("Question: What are the 10 most common words in the above list? Answer: The top 10 words that appear "
                "most often in the list are:")

# key words of the needles: an adjective and a noun, as RULER's "<adjective>-<noun>" keys
_ADJECTIVES = ("ancient", "bitter", "brave", "calm", "clever", "cold", "curious", "dark", "eager", "faint", "fierce",
               "gentle", "golden", "hollow", "humble", "hungry", "icy", "jolly", "lively", "lonely", "loud", "lucky",
               "mellow", "misty", "noble", "odd", "pale", "proud", "quiet", "rapid", "rough", "rusty", "shy", "silent",
               "silver", "sleepy", "smooth", "sour", "swift", "tender", "tiny", "vivid", "wild", "wise", "young")
_NOUNS = ("anchor", "badger", "banjo", "beacon", "candle", "canyon", "cellar", "comet", "compass", "cottage", "crystal",
          "dolphin", "falcon", "feather", "forest", "garden", "glacier", "harbor", "helmet", "island", "kettle",
          "ladder", "lantern", "meadow", "mirror", "monkey", "orchard", "otter", "pebble", "pillow", "planet",
          "quarry", "rabbit", "ribbon", "saddle", "spider", "teapot", "thunder", "tunnel", "violin", "walnut",
          "wagon", "whistle", "window", "zebra")
# CWE's vocabulary: common English nouns, one token or two in most tokenizers
_WORDS = ("apple", "bread", "chair", "dream", "eagle", "field", "grape", "horse", "image", "juice", "knife", "lemon",
          "money", "night", "ocean", "paper", "queen", "river", "stone", "table", "uncle", "voice", "water", "youth",
          "angle", "beach", "cloud", "dance", "earth", "flame", "glass", "heart", "index", "jewel", "koala", "light",
          "metal", "nurse", "olive", "piano", "quilt", "radio", "sheep", "tiger", "union", "vapor", "wheel", "yacht",
          "actor", "brick", "coach", "drama", "entry", "frost", "guest", "hotel", "ivory", "judge", "kayak", "laser",
          "mango", "novel", "opera", "pearl", "quota", "robot", "salad", "toast", "urban", "villa", "whale", "zesty",
          "amber", "bloom", "cabin", "daisy", "ember", "fiber", "globe", "honey", "igloo", "jelly", "karma", "lodge",
          "maple", "nylon", "orbit", "plaza", "raven", "scarf", "tulip", "umbra", "valve", "wagon", "xenon", "yeast")


@dataclass(frozen=True)
class RulerTask:
    """One task: ``haystack`` ('noise', 'essay' or 'words'), what its needles hold (``value``: 'number' or 'uuid'),
    how many needles (``keys`` distinct keys x ``values`` values per key) and how many keys are asked; the answer's
    token budget (``max_new_tokens``)."""

    name: str
    haystack: str
    value: str = "number"
    keys: int = 1
    values: int = 1
    asked: int = 1
    max_new_tokens: int = 24
    description: str = ""


RULER_TASKS: dict[str, RulerTask] = {t.name: t for t in (
    RulerTask("niah_single_1", "noise", description="S-NIAH 1: a number in repeated noise"),
    RulerTask("niah_single_2", "essay", description="S-NIAH 2: a number in essay-like text"),
    RulerTask("niah_single_3", "essay", value="uuid", max_new_tokens=40,
              description="S-NIAH 3: a uuid in essay-like text"),
    RulerTask("niah_multikey_1", "essay", keys=4, description="MK-NIAH: four keys, one asked"),
    RulerTask("niah_multivalue", "essay", values=4, max_new_tokens=64,
              description="MV-NIAH: four values of one key, all asked"),
    RulerTask("niah_multiquery", "essay", keys=4, asked=4, max_new_tokens=64,
              description="MQ-NIAH: four keys, all asked"),
    RulerTask("vt", "noise", max_new_tokens=32, description="variable tracking: a chain of five variables"),
    RulerTask("cwe", "words", max_new_tokens=64, description="common words extraction: the ten most frequent words"),
)}

VT_CHAIN = 5  # variables in vt's chain (RULER's default: 1 chain, 4 hops)
CWE_COMMON, CWE_RARE_FREQ = 10, 3  # cwe: ten common words; every other word appears 3 times (RULER's freq_ucw)
LENGTH_TOLERANCE = 0.9  # a prompt is at most its target and at least this share of it


@dataclass
class RulerSample:
    """One prompt (``text`` and its ``ids``, the tokenizer's leading special tokens included) and its gold
    strings (``answers``: every one must appear in the output for a score of 1)."""

    task: str
    length: int
    index: int
    text: str
    ids: list[int]
    answers: list[str]
    question_start: int = field(default=0)  # tokens before the question: the document multi-turn reads first


def string_match_all(prediction: str, answers: Sequence[str]) -> float:
    """RULER's string-match recall: the share of ``answers`` found (case-insensitive substrings) in ``prediction``."""
    if not answers:
        raise ValueError("answers must hold at least one gold string")
    low = prediction.lower()
    return sum(a.lower() in low for a in answers) / len(answers)


def _check_task(task: str) -> RulerTask:
    if task not in RULER_TASKS:
        raise ValueError(f"task must be one of {list(RULER_TASKS)}, got {task!r}")
    return RULER_TASKS[task]


@lru_cache(maxsize=1)
def _essay_lines() -> tuple[str, ...]:
    """The bundled Tiny Shakespeare's spoken lines (speaker names and blank lines dropped): prose-like units."""
    from ..data import demo_text_path

    text = demo_text_path().read_text(encoding="utf-8")
    return tuple(line.strip() for line in text.splitlines() if line.strip() and not line.rstrip().endswith(":"))


def _key(rng: random.Random, taken: set[str]) -> str:
    while True:
        k = f"{rng.choice(_ADJECTIVES)}-{rng.choice(_NOUNS)}"
        if k not in taken:
            taken.add(k)
            return k


def _value(rng: random.Random, kind: str, taken: set[str]) -> str:
    while True:
        if kind == "uuid":
            v = str(uuid.UUID(int=rng.getrandbits(128), version=4))
        else:
            v = str(rng.randint(10**6, 10**7 - 1))
        if v not in taken:
            taken.add(v)
            return v


def _units(task: RulerTask, rng: random.Random, count: int) -> list[str]:
    """``count`` haystack units: noise sentences, or consecutive text lines from a seeded place (wrapping)."""
    if task.haystack == "noise":
        return [NOISE] * count
    lines = _essay_lines()
    start = rng.randrange(len(lines))
    return [lines[(start + i) % len(lines)] for i in range(count)]


def _place(units: list[str], needles: list[str], rng: random.Random) -> list[str]:
    """The units with the needles inserted at seeded depths between them (in the needles' order)."""
    at = sorted(rng.randint(0, len(units)) for _ in needles)
    out, prev = [], 0
    for pos, needle in zip(at, needles):
        out += units[prev:pos] + [needle]
        prev = pos
    return out + units[prev:]


def _niah(task: RulerTask, rng: random.Random) -> Callable[[int], tuple[str, str, list[str]]]:
    kind = "uuids" if task.value == "uuid" else "numbers"
    keys_taken, values_taken = set(), set()
    keys = [_key(rng, keys_taken) for _ in range(task.keys)]
    needles, gold = [], {}
    for k in keys:
        vals = [_value(rng, task.value, values_taken) for _ in range(task.values)]
        gold[k] = vals
        needles += [NIAH_NEEDLE.format(kind=kind, key=k, value=v) for v in vals]
    rng.shuffle(needles)
    asked = rng.sample(keys, task.asked)
    answers = [v for k in asked for v in gold[k]]
    intro = NIAH_INTRO.format(kind=kind)
    question = NIAH_QUESTION.format(kind=kind, key=", ".join(asked))
    draw = rng.getrandbits(64)

    def build(n: int) -> tuple[str, str, list[str]]:
        r = random.Random(draw)  # the same haystack start and depths for every n of the length search
        body = _place(_units(task, r, n), needles, r)
        return intro + "\n" + " ".join(body) + "\n", question, answers

    return build


def _vt(rng: random.Random) -> Callable[[int], tuple[str, str, list[str]]]:
    names: list[str] = []
    while len(names) < VT_CHAIN:
        name = "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5))
        if name not in names:
            names.append(name)
    value = str(rng.randint(10**4, 10**5 - 1))
    needles = [f"VAR {names[0]} = {value}."] + [f"VAR {b} = {a}." for a, b in zip(names, names[1:])]
    question = VT_QUESTION.format(value=value, n=VT_CHAIN)
    draw = rng.getrandbits(64)

    def build(n: int) -> tuple[str, str, list[str]]:
        r = random.Random(draw)
        body = _place([NOISE] * n, needles, r)  # _place keeps the needles' order: the chain reads forward
        return VT_INTRO + "\n" + " ".join(body) + "\n", question, list(names)

    return build


def _cwe(rng: random.Random) -> Callable[[int], tuple[str, str, list[str]]]:
    words = list(dict.fromkeys(_WORDS))
    rng.shuffle(words)
    common, rare = words[:CWE_COMMON], words[CWE_COMMON:]
    draw = rng.getrandbits(64)

    def build(n: int) -> tuple[str, str, list[str]]:
        # n = list items; the common words take a third of them (at least CWE_RARE_FREQ + 1 times each, so that they
        # stay the most frequent), the rest is rare words CWE_RARE_FREQ times each, cycling through the vocabulary
        r = random.Random(draw)
        freq = max(CWE_RARE_FREQ + 1, n // (3 * CWE_COMMON))
        items = [w for w in common for _ in range(freq)]
        rest = max(0, n - len(items)) // CWE_RARE_FREQ
        items += [rare[i % len(rare)] for i in range(rest) for _ in range(CWE_RARE_FREQ)]
        r.shuffle(items)
        listing = " ".join(f"{i + 1}. {w}" for i, w in enumerate(items))
        return CWE_INTRO + "\n" + listing + "\n", CWE_QUESTION, list(common)

    return build


def _encode(tokenizer, doc: str, question: str) -> tuple[list[int], int]:
    """The document with the tokenizer's leading special tokens, then the question tokenised on its own: the same ids
    whether the two are read in one call or two (no token straddles the split)."""
    head = list(tokenizer(doc)["input_ids"])
    return head + list(tokenizer(question, add_special_tokens=False)["input_ids"]), len(head)


def ruler_sample(tokenizer, task: str, length: int, *, seed: int = 0, index: int = 0) -> RulerSample:
    """Sample ``index`` of ``task`` at ``length`` tokens (the whole prompt, the tokenizer's special tokens included).

    The needles, keys, asked keys and haystack place come from ``seed``, ``task``, ``length`` and ``index`` alone;
    the haystack is the largest number of units whose prompt fits ``length`` (binary search)."""
    t = _check_task(task)
    if isinstance(length, bool) or not isinstance(length, int) or length < 64:
        raise ValueError(f"length must be an int >= 64 (tokens), got {length!r}")
    rng = random.Random(f"ruler/{seed}/{task}/{length}/{index}")
    build = _cwe(rng) if t.haystack == "words" else _vt(rng) if task == "vt" else _niah(t, rng)

    def tokens(n: int) -> tuple[list[int], str, int, list[str]]:
        doc, question, answers = build(n)
        ids, start = _encode(tokenizer, doc, question)
        return ids, doc + question, start, answers

    lo, hi = 0, 1
    while len(tokens(hi)[0]) <= length:  # grow until too long, then bisect: the largest n that fits
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if len(tokens(mid)[0]) <= length:
            lo = mid
        else:
            hi = mid
    ids, text, start, answers = tokens(lo)
    if len(ids) > length:
        raise ValueError(f"length {length} is too short for task {task!r}: its prompt without haystack takes "
                         f"{len(ids)} tokens")
    return RulerSample(task, length, index, text, ids, answers, start)


def check_length(sample: RulerSample, tolerance: float = LENGTH_TOLERANCE) -> bool:
    """True when the prompt is at most its target and at least ``tolerance`` of it."""
    return tolerance * sample.length <= len(sample.ids) <= sample.length


def _check_list(name: str, values, allowed=None, minimum: int | None = None) -> tuple:
    out = tuple(values)
    if allowed is not None:
        bad = [v for v in out if v not in allowed]
        if not out or bad or len(set(out)) != len(out):
            raise ValueError(f"{name} must be distinct names from {list(allowed)}, got {list(out)!r}")
    else:
        if not out or any(isinstance(v, bool) or not isinstance(v, int) or v < minimum for v in out):
            raise ValueError(f"{name} must be a non-empty list of ints >= {minimum}, got {list(out)!r}")
    return out


def run_ruler(model, tokenizer, lengths: Sequence[int], tasks: Sequence[str] = tuple(RULER_TASKS), *,
              samples: int = 4, seed: int = 0, multi_turn: bool = False, progress: bool = False,
              read: str = "stream", prefill_chunk: int = 0) -> dict[str, Any]:
    """Every task at every length, ``samples`` prompts each, answered by greedy decoding through the model's own
    ``generate()`` (its own cache); a sample's score is ``string_match_all`` of its answer. ``multi_turn``: the
    haystack is read first in its own forward call and the question asked on that cache
    (``long_context.generate_turns``), as a chat server or a prefix cache serves it; ``read`` how
    (``turns.READS``; 'copy': ``hf_polyattn.read_document`` where the model has a sparse cache; the read used is
    recorded as ``read``). ``prefill_chunk`` > 0: each prompt (or document) is read in forward calls of that many
    tokens (``turns.prefill``; refused for a sparse cache), recorded as ``prefill_chunk``.

    Returns {"lengths", "tasks", "samples", "seed", "multi_turn", "scores": {task: {length: mean}}, "average":
    {length: mean over tasks}, "outputs": [per sample: task, length, index, tokens, answers, output, score]}."""
    from .turns import _max_positions, check_prefill_chunk, check_read, document_reader, generate_prompt, generate_turns

    lengths = _check_list("lengths", lengths, minimum=64)
    tasks = _check_list("tasks", tasks, allowed=RULER_TASKS)
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
        raise ValueError(f"samples must be an int >= 1, got {samples!r}")
    reader, read = document_reader(model, tokenizer, read) if multi_turn else (None, check_read(read))
    prefill_chunk = check_prefill_chunk(model, prefill_chunk)
    limit = _max_positions(model)
    answer = max(RULER_TASKS[t].max_new_tokens for t in tasks)
    if limit and max(lengths) + answer > limit:
        raise ValueError(f"ruler length {max(lengths)} (+{answer} answer tokens) is longer than the model's {limit} "
                         "positions")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    cells = [(t, n, i) for t in tasks for n in lengths for i in range(samples)]
    it = cells
    if progress:
        from tqdm.auto import tqdm

        it = tqdm(cells, desc="ruler" + (" (multi-turn)" if multi_turn else ""), unit="prompt")
    outputs, t0 = [], time.time()
    was_training = model.training
    model.eval()
    try:
        for task, length, index in it:
            s = ruler_sample(tokenizer, task, length, seed=seed, index=index)
            new = RULER_TASKS[task].max_new_tokens
            if multi_turn:
                gen = generate_turns(model, s.ids[: s.question_start], [s.ids[s.question_start:]],
                                     max_new_tokens=new, pad_token_id=pad, reader=reader,
                                     prefill_chunk=prefill_chunk)[0]
            else:
                gen = generate_prompt(model, s.ids, max_new_tokens=new, pad_token_id=pad, prefill_chunk=prefill_chunk)
            text = tokenizer.decode(gen, skip_special_tokens=True)
            outputs.append({"task": task, "length": length, "index": index, "tokens": len(s.ids),
                            "answers": s.answers, "output": text, "score": string_match_all(text, s.answers)})
    finally:
        model.train(was_training)
    scores = {t: {str(n): sum(o["score"] for o in outputs if o["task"] == t and o["length"] == n) / samples
                  for n in lengths} for t in tasks}
    average = {str(n): sum(scores[t][str(n)] for t in tasks) / len(tasks) for n in lengths}
    return {"lengths": list(lengths), "tasks": list(tasks), "samples": samples, "seed": seed,
            "multi_turn": multi_turn, **({"read": read} if multi_turn else {}),
            **({"prefill_chunk": prefill_chunk} if prefill_chunk else {}), "scores": scores, "average": average,
            "outputs": outputs, "wall_s": round(time.time() - t0, 1)}


def ruler_markdown(rows: Sequence[dict[str, Any]]) -> str:
    """One line per (row, mode): the score (string-match recall, %) of every task at every length and their mean.
    ``rows``: the long-context rows holding ``ruler`` and / or ``ruler_multi_turn`` results ('multi (copy)': the
    document read by ``hf_polyattn.read_document``)."""
    modes = (("ruler", "single"), ("ruler_multi_turn", "multi"))
    with_ruler = [r for r in rows if any(r.get(key) for key, _ in modes)]
    if not with_ruler:
        return ""
    results = [r[key] for r in with_ruler for key, _ in modes if r.get(key)]
    first = results[0]
    # the union of the rows' tasks and lengths, in first-seen order: a row run at fewer of them shows "–" there
    tasks = list(dict.fromkeys(t for res in results for t in res["tasks"]))
    lengths = list(dict.fromkeys(n for res in results for n in res["lengths"]))
    head = ["attention", "turns", *[f"{t} @ {n:,}" for t in tasks for n in lengths],
            *[f"mean @ {n:,}" for n in lengths]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in with_ruler:
        for key, turns in modes:
            res = r.get(key)
            if not res:
                continue
            def pct(score, fmt):
                return "–" if score is None else format(100 * score, fmt)

            mode = turns + (" (copy)" if res.get("read") == "copy" else "")
            cells = [r["label"], mode,
                     *[pct(res["scores"].get(t, {}).get(str(n)), ".0f") for t in tasks for n in lengths],
                     *[pct(res["average"].get(str(n)) if res["tasks"] == tasks else None, ".1f") for n in lengths]]
            lines.append("| " + " | ".join(cells) + " |")
    samples = sorted({res["samples"] for res in results})
    note = (f"\nRULER-style suite (hf_polyattn/eval/ruler.py): {'/'.join(map(str, samples))} samples per task and "
            f"length, seed {first['seed']}, greedy decoding, string-match recall in % (the share of the gold strings "
            "found in the answer). 'multi': the haystack read in its own forward call first, the question asked on "
            "that cache.")
    return "\n".join(lines) + "\n" + note + "\n"
