"""Long-context evaluation: perplexity at a list of contexts and passkey retrieval, beside softmax and StreamingLLM.

A linear-time attention is judged at contexts many times its exact window, where the kernel part carries what the
window cannot see: a perplexity figure at 256 tokens with a 128-token window says little about it. This module
evaluates a causal LM

* by **perplexity at every context of a list** (256 ... 8,192) on the *same* held-out tokens: for each context the
  stream is cut into non-overlapping windows of that length (``metrics.perplexity`` with stride = context): every
  token but the first of each window is scored once per context, with 1 to ``context`` - 1 tokens before it;
* by **passkey retrieval**: a 5-digit key hidden at evenly spread depths (cell centres) of a filler text of a
  given length in tokens, then "What is the pass key? The pass key is"; the model answers by greedy decoding
  through its own ``generate()`` (its own cache: a recurrent state for the linear-time kinds), and a hit is an
  exact match of the first number it writes. Keys are drawn from a seeded generator, one per (length, depth) cell;
* beside **baselines** on the same tokens and prompts: the checkpoint's softmax attention, StreamingLLM
  (Xiao et al. 2023, arXiv:2309.17453: exact softmax on the first ``sinks`` tokens plus a recent window, everything
  else dropped, no training), which is the library's ``sliding_window`` kind with ``sinks``, and two rows at matched
  memory: ``sparse`` (the sparse cache's selection on the checkpoint's own softmax, ``matched_memory_config``) and
  ``streaming_matched`` (StreamingLLM whose window holds as many keys);
* optionally **multi-turn** (``multi_turn``): every passkey and RULER prompt again with the document read into the
  cache by its own forward call and the question asked after on that cache (``generate_turns``), and a second
  passkey question after the first answer: what a chat server or a prefix cache serves, where a bounded cache chose
  its keys before any question existed;
* optionally the **RULER-style suite** (``ruler_lengths``, ``eval/ruler.py``).

Nothing here builds an n x n tensor on the linear-time path: a model is run as it is (batch 1 at 8k fits a 2-core
CPU's 24 GiB for SmolLM2-135M). ``write_long_context`` writes the results as JSON, a Markdown table and two plots
(perplexity against context, a passkey heatmap per row).
"""

from __future__ import annotations

import json
import random
import re
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from .metrics import perplexity
from .passkey import TEMPLATES, draw_passkey, passkey_prompt
from .turns import (
    _max_positions,
    check_chunk_size,
    check_prefill_chunk,
    check_read,
    document_reader,
    generate_prompt,
    generate_turns,
)

__all__ = [
    "DEFAULT_CONTEXTS",
    "DEFAULT_PASSKEY_LENGTHS",
    "LongContextSettings",
    "evaluate_model",
    "evaluate_rows",
    "long_context_markdown",
    "passkey_retrieval",
    "perplexity_curve",
    "plot_long_context",
    "generate_turns",
    "matched_memory_config",
    "streaming_config",
    "write_long_context",
]

DEFAULT_CONTEXTS = (256, 1024, 2048, 4096, 8192)
DEFAULT_PASSKEY_LENGTHS = (1024, 2048, 4096)
MATCHED_CACHE = 2048  # the matched-memory rows' keys when neither the settings nor the evaluated model name them

def _check_lengths(name: str, values: Iterable[int], minimum: int) -> tuple[int, ...]:
    out = tuple(values)
    if not out or any(isinstance(v, bool) or not isinstance(v, int) or v < minimum for v in out):
        raise ValueError(f"{name} must be a non-empty list of ints >= {minimum}, got {list(out)!r}")
    return out


@dataclass
class LongContextSettings:
    """What ``evaluate_model`` measures (one object: the results record it)."""

    contexts: tuple[int, ...] = field(default=DEFAULT_CONTEXTS, metadata={
        "help": "perplexity contexts in tokens; each evaluates the same held-out tokens in windows of that length"})
    max_tokens: int = field(default=12288, metadata={
        "help": "held-out tokens evaluated at every context (the first ones of the stream)"})
    tokens_per_batch: int = field(default=8192, metadata={
        "help": "windows per forward pass = max(1, tokens_per_batch // context)"})
    passkey_lengths: tuple[int, ...] = field(default=DEFAULT_PASSKEY_LENGTHS, metadata={
        "help": "passkey prompt lengths in tokens (empty: no passkey)"})
    passkey_depths: int = field(default=10, metadata={
        "help": "needle depths per length, the centres of that many equal parts of the filler"})
    passkey_seed: int = field(default=0, metadata={"help": "seed of the keys"})
    passkey_templates: tuple[str, ...] = field(default=("classic",), metadata={
        "help": f"passkey templates, each scored at every length and depth: {list(TEMPLATES)} ('classic': the "
                "Landmark-Attention prompt; 'vault': other filler, phrasing and 4-7 digit keys; 'multi': four "
                "labelled keys, one asked)"})
    baselines: tuple[str, ...] = field(default=("softmax", "streaming"), metadata={
        "help": "baseline rows on the same tokens: 'softmax' (the checkpoint), 'streaming' (StreamingLLM)"})
    streaming_sinks: int = field(default=4, metadata={"help": "StreamingLLM row: sink tokens"})
    streaming_window: int = field(default=128, metadata={"help": "StreamingLLM row: window"})
    matched_cache: int | None = field(default=None, metadata={
        "help": "keys of the matched-memory rows: the 'sparse' row's sparse_cache beside its sinks and window, and the "
                "'streaming_matched' row's window beyond the sparse row's (None: the evaluated model's sparse_cache, "
                f"else {MATCHED_CACHE})"})
    multi_turn: bool = field(default=False, metadata={
        "help": "also score retrieval with the document read first in its own forward call and the question(s) "
                "asked after on that cache (two passkey questions in a row), beside the single-prompt scores"})
    read: str = field(default="stream", metadata={
        "help": "how multi-turn reads the document: 'stream' (one forward call, as a chat server or a prefix cache) "
                "or 'copy' (hf_polyattn.read_document: a sparse cache chosen by copy scores for questions asked "
                "later; rows without a sparse cache read by 'stream' and their results say so)"})
    ruler_lengths: tuple[int, ...] = field(default=(), metadata={
        "help": "RULER-style suite (eval/ruler.py) at these prompt lengths in tokens (empty: none)"})
    ruler_tasks: tuple[str, ...] = field(default=(), metadata={"help": "RULER tasks (empty: all of them)"})
    ruler_samples: int = field(default=4, metadata={"help": "RULER samples per task and length"})
    ruler_seed: int = field(default=0, metadata={"help": "seed of the RULER samples"})
    prefill_chunk: int = field(default=0, metadata={
        "help": "passkey and RULER prompts (and multi-turn documents) read in forward calls of this many tokens, "
                "the same result as one call (0: one call); refused for a sparse cache, which chooses its keys per "
                "call, and so with the 'sparse' baseline"})

    def __post_init__(self) -> None:
        self.contexts = _check_lengths("contexts", self.contexts, 2)
        self.passkey_lengths = tuple(self.passkey_lengths)
        if self.passkey_lengths:
            self.passkey_lengths = _check_lengths("passkey_lengths", self.passkey_lengths, 64)
        for name in ("max_tokens", "tokens_per_batch", "passkey_depths", "streaming_sinks", "streaming_window"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < (0 if name == "streaming_sinks" else 1):
                raise ValueError(f"{name} must be an int >= {0 if name == 'streaming_sinks' else 1}, got {v!r}")
        if isinstance(self.passkey_seed, bool) or not isinstance(self.passkey_seed, int):
            raise ValueError(f"passkey_seed must be an int, got {self.passkey_seed!r}")
        self.passkey_templates = tuple(self.passkey_templates)
        bad = [name for name in self.passkey_templates if name not in TEMPLATES]
        if not self.passkey_templates or bad or len(set(self.passkey_templates)) != len(self.passkey_templates):
            raise ValueError(f"passkey_templates must be distinct names from {list(TEMPLATES)}, got "
                             f"{list(self.passkey_templates)!r}")
        self.baselines = tuple(self.baselines)
        bad = [b for b in self.baselines if b not in BASELINES]
        if bad:
            raise ValueError(f"baselines must be a subset of {list(BASELINES)}, got {list(self.baselines)!r}")
        if self.matched_cache is not None and (isinstance(self.matched_cache, bool)
                                               or not isinstance(self.matched_cache, int) or self.matched_cache < 1):
            raise ValueError(f"matched_cache must be None or an int >= 1, got {self.matched_cache!r}")
        if not isinstance(self.multi_turn, bool):
            raise ValueError(f"multi_turn must be True or False, got {self.multi_turn!r}")
        if check_read(self.read) != "stream" and not self.multi_turn:
            raise ValueError(f"read={self.read!r} says how a multi-turn evaluation reads its document: set multi_turn "
                             "(--multi-turn) too")
        from .ruler import RULER_TASKS, _check_list

        self.ruler_lengths = tuple(self.ruler_lengths)
        if self.ruler_lengths:
            self.ruler_lengths = _check_list("ruler_lengths", self.ruler_lengths, minimum=64)
        self.ruler_tasks = _check_list("ruler_tasks", self.ruler_tasks or tuple(RULER_TASKS), allowed=RULER_TASKS)
        for name in ("ruler_samples", "ruler_seed"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < (1 if name == "ruler_samples" else 0):
                raise ValueError(f"{name} must be an int >= {1 if name == 'ruler_samples' else 0}, got {v!r}")
        v = check_chunk_size(self.prefill_chunk)
        if v and "sparse" in self.baselines:
            raise ValueError(f"prefill_chunk={v} with the 'sparse' baseline: a sparse cache chooses its keys at the "
                             "end of every forward call, so reading in chunks would change what it keeps: drop one "
                             "of them")

    def check_positions(self, config) -> None:
        """Refuse (ValueError) a context or passkey prompt (+ its template's answer tokens) longer than the model's
        positions, read from ``config``: called where a run learns its model, before any training, so that a
        30-minute retrofit does not end in this error at its evaluation (SmolLM2: 8,192 positions, so an 8k passkey
        prompt of the 'vault' template, up to 7-digit keys + 3, is at most 8,182 tokens)."""
        limit = _max_positions(config)
        if not limit:
            return
        long = [c for c in self.contexts if c > limit]
        if long:
            raise ValueError(f"contexts {long} are longer than the model's {limit} positions: drop them")
        if self.passkey_lengths:
            answer = max(_answer_tokens(t) for t in self.passkey_templates)
            if max(self.passkey_lengths) + answer > limit:
                raise ValueError(f"passkey_lengths: {max(self.passkey_lengths)} (+{answer} answer tokens of the "
                                 f"templates {list(self.passkey_templates)}) is longer than the model's {limit} "
                                 f"positions: use at most {limit - answer}")
            if self.multi_turn:
                # the second question comes after the first answer and its own tokens: at most 2 x (question + answer)
                second = answer + 40
                if max(self.passkey_lengths) + answer + second > limit:
                    raise ValueError(f"passkey_lengths: {max(self.passkey_lengths)} with multi_turn (two questions "
                                     f"and answers, up to {answer + second} tokens) is longer than the model's "
                                     f"{limit} positions: use at most {limit - answer - second}")
        if self.ruler_lengths:
            from .ruler import RULER_TASKS

            answer = max(RULER_TASKS[t].max_new_tokens for t in self.ruler_tasks)
            if max(self.ruler_lengths) + answer > limit:
                raise ValueError(f"ruler_lengths: {max(self.ruler_lengths)} (+{answer} answer tokens) is longer than "
                                 f"the model's {limit} positions: use at most {limit - answer}")


# ----------------------------------------------------------------------------------------------- perplexity


def perplexity_curve(model, ids: torch.Tensor, contexts: Sequence[int], *, tokens_per_batch: int = 8192,
                     progress: bool = False) -> list[dict[str, Any]]:
    """``metrics.perplexity`` of ``model`` on the 1-D stream ``ids`` at every context (stride = context).

    A context longer than the stream or than the model's positions is refused (never silently shortened).
    """
    ids = ids.reshape(-1)
    contexts = _check_lengths("contexts", contexts, 2)
    limit = _max_positions(model)
    for c in contexts:
        if c > ids.numel():
            raise ValueError(f"context {c} is longer than the evaluated stream ({ids.numel()} tokens): give more "
                             "tokens (max_tokens) or drop the context")
        if limit and c > limit:
            raise ValueError(f"context {c} is longer than the model's {limit} positions")
    out = []
    for c in contexts:
        t0 = time.time()
        r = perplexity(model, ids, context=c, stride=c, batch_size=max(1, tokens_per_batch // c), progress=progress,
                       desc=f"perplexity @ {c}")
        r["wall_s"] = round(time.time() - t0, 1)
        out.append(r)
    return out


def _answer_tokens(template: str) -> int:
    """Tokens generated for a passkey answer: the template's longest key + 3 (8 for the classic 5-digit keys)."""
    return TEMPLATES[template].digits[1] + 3


# ----------------------------------------------------------------------------------------------- passkey


_NUMBER = re.compile(r"\d+")


def _second_question(tokenizer, p) -> tuple[list[int], str]:
    """The second question of a multi-turn passkey cell and its key: another label's key for a multi-key template
    (the first of the others), else the same question again."""
    t = TEMPLATES[p.template]
    if not t.labels:
        return p.question(tokenizer), p.key
    rest = [lab for lab in t.labels if lab != p.label]
    return p.question(tokenizer, rest[0]), p.others[0]


def _hit(text: str, key: str) -> int:
    found = _NUMBER.search(text)
    return int(found is not None and found.group(0) == key)


@torch.no_grad()
def passkey_retrieval(model, tokenizer, lengths: Sequence[int], depths: int = 10, *, seed: int = 0,
                      max_new_tokens: int | None = None, progress: bool = False,
                      template: str = "classic", multi_turn: bool = False, read: str = "stream",
                      draw_lengths: Sequence[int] | None = None, prefill_chunk: int = 0) -> dict[str, Any]:
    """Greedy passkey retrieval at every (length, depth) with the prompts of ``template`` (``passkey.TEMPLATES``);
    hits are exact matches of the first number answered. The keys come from ``seed`` (the classic template's are
    those of earlier runs: one 5-digit draw per cell). ``max_new_tokens``: the template's longest key + 3 by default
    (8 for the classic 5-digit keys, as before).

    ``multi_turn``: the same prompts, the document (all before the question) read first in its own forward call and
    the question asked on that cache (``generate_turns``); then a second question after the first answer, on the
    same cache (another label's key for the 'multi' template, the same key again otherwise): ``hits`` / ``answers``
    score the first question, ``hits_second`` / ``answers_second`` / ``keys_second`` the second. ``read``: how
    multi-turn reads the document (``turns.READS``; 'copy': ``hf_polyattn.read_document`` where the model has a
    sparse cache, the read used recorded as ``read``). ``draw_lengths``: the lengths whose cells draw keys, in order
    (``lengths`` among them; None: ``lengths``), so that a run of 8k alone asks the keys a 1k..8k run asks at 8k.
    ``prefill_chunk`` > 0: each prompt (or document) is read in forward calls of that many tokens (``turns.prefill``;
    refused for a sparse cache), recorded as ``prefill_chunk``."""
    lengths = _check_lengths("lengths", lengths, 64)
    if isinstance(depths, bool) or not isinstance(depths, int) or depths < 1:
        raise ValueError(f"depths must be an int >= 1, got {depths!r}")
    if template not in TEMPLATES:
        raise ValueError(f"template must be one of {list(TEMPLATES)}, got {template!r}")
    if max_new_tokens is None:
        max_new_tokens = _answer_tokens(template)
    limit = _max_positions(model)
    if limit and max(lengths) + max_new_tokens > limit:
        raise ValueError(f"passkey length {max(lengths)} (+{max_new_tokens} answer tokens) is longer than the "
                         f"model's {limit} positions")
    rng = random.Random(seed)
    was_training = model.training
    model.eval()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    # cell centres (i + 0.5) / depths: a needle at depth 1.0 would sit right before the question, where even the
    # softmax checkpoint answers by copying the question's own words ("the pass key. ...") instead of the key
    grid = [(i + 0.5) / depths for i in range(depths)]
    reader, read = document_reader(model, tokenizer, read) if multi_turn else (None, check_read(read))
    prefill_chunk = check_prefill_chunk(model, prefill_chunk)
    hits, answers, keys, seconds = [], [], [], []
    hits2, answers2, keys2 = [], [], []
    drawn_at = list(lengths) if draw_lengths is None else list(draw_lengths)
    if any(n not in drawn_at for n in lengths):
        raise ValueError(f"draw_lengths {drawn_at} must hold every passkey length {list(lengths)}")
    draws = [(length, d) for length in drawn_at for d in grid]  # one key per cell, in this order
    cells = [(length, d) for length, d in draws if length in lengths]
    keys_at = {cell: draw_passkey(rng, template) for cell in draws}
    it = cells
    if progress:
        from tqdm.auto import tqdm

        it = tqdm(cells, desc="passkey", unit="prompt")
    try:
        for length, depth in it:
            drawn = keys_at[(length, depth)]
            key = drawn["key"]
            p = passkey_prompt(tokenizer, length=length, depth=depth, template=template, **drawn)
            t0 = time.time()
            if multi_turn:
                second, key2 = _second_question(tokenizer, p)
                first_ids = p.prompt[p.question_start:]
                gen = generate_turns(model, p.document, [first_ids, second], max_new_tokens=max_new_tokens,
                                     pad_token_id=pad, reader=reader, prefill_chunk=prefill_chunk)
                text2 = tokenizer.decode(gen[1], skip_special_tokens=True)
                hits2.append(_hit(text2, key2))
                answers2.append(text2)
                keys2.append(key2)
                new = gen[0]
            else:
                new = generate_prompt(model, p.prompt, max_new_tokens=max_new_tokens, pad_token_id=pad,
                                      prefill_chunk=prefill_chunk)
            seconds.append(time.time() - t0)
            text = tokenizer.decode(new, skip_special_tokens=True)
            hits.append(_hit(text, key))
            answers.append(text)
            keys.append(key)
    finally:
        model.train(was_training)
    nd = len(grid)

    def rows(xs):
        return [xs[i * nd:(i + 1) * nd] for i in range(len(lengths))]

    result = {"template": template, "lengths": list(lengths), "depths": grid, "seed": seed, "hits": rows(hits),
              "keys": rows(keys),
              "answers": rows(answers),
              "accuracy": {str(length): sum(h) / nd for length, h in zip(lengths, rows(hits))},
              "wall_s": round(sum(seconds), 1), **({"prefill_chunk": prefill_chunk} if prefill_chunk else {})}
    if multi_turn:
        result.update(multi_turn=True, read=read, hits_second=rows(hits2), keys_second=rows(keys2),
                      answers_second=rows(answers2),
                      accuracy_second={str(n): sum(h) / nd for n, h in zip(lengths, rows(hits2))})
    return result


# ----------------------------------------------------------------------------------------------- rows


def streaming_config(sinks: int = 4, window: int = 128):
    """StreamingLLM as a library kind: exact softmax on ``sinks`` first tokens + a ``window``, nothing else."""
    from ..config import PolyAttnConfig

    return PolyAttnConfig.for_kind("sliding_window", window=window, sinks=sinks)


# the settings a matched-memory row copies from an evaluated model with a sparse cache: where its exact keys sit and
# how they are chosen (sparse_cache itself is the budget, from matched_cache or the model)
MATCHED_FIELDS = ("sinks", "window", "sink_position", "sink_span", "sparse_cache", "sparse_chunk", "sparse_score",
                  "sparse_observe", "sparse_observe_pool", "sparse_value_keys",
                  "sparse_value_pool")


def matched_memory_config(sparse_cache: int = MATCHED_CACHE, *, like=None, sinks: int = 4, window: int = 128,
                          **selection):
    """The sparse cache on a softmax checkpoint's own attention, training-free: exact softmax over the sinks, the
    window, the pending block and ``sparse_cache`` selected keys (one normaliser), nothing else.

    Why this construction: the sparse cache (``ops/sparse.py``) lives in the kernel kinds' layer, where the keys it
    does not keep are folded into a kernel state. ``kind='linear'`` with ``window_mix=True`` and
    ``window_mix_init=0.0`` weighs that state's part by |0| = 0 in numerator and normaliser alike, so every output is
    the exact softmax over the kept keys, with the sparse cache's own selection and decoding ring (tested against
    a naive softmax over ``reference_weights``' kept keys in tests/eval/test_matched_memory.py). The kernel's elu
    features are computed and ignored: time, not results.

    ``like``: a ``PolyAttnConfig`` with a sparse cache (the evaluated model's) whose placement and selection rules
    (``MATCHED_FIELDS``) the row copies; ``sparse_cache`` still sets the budget. Otherwise ``sinks`` and ``window``
    place the exact keys and ``selection`` (``sparse_chunk``, ``sparse_score``, ``sparse_observe``,
    ``sparse_observe_pool``, ``sink_position``) chooses them, by default ``sparse_score='attention'``: the recall
    error ranks keys by a kernel state this row weighs 0."""
    from ..config import PolyAttnConfig

    if isinstance(sparse_cache, bool) or not isinstance(sparse_cache, int) or sparse_cache < 1:
        raise ValueError(f"sparse_cache must be an int >= 1 (the matched-memory row's selected keys), got "
                         f"{sparse_cache!r}")
    if like is not None:
        if not getattr(like, "sparse_cache", 0):
            raise ValueError("like must be a PolyAttnConfig with sparse_cache > 0 (the selection rules to copy), got "
                             f"{like!r}")
        opts = {f: getattr(like, f) for f in MATCHED_FIELDS}
        opts.update(selection)
    else:
        opts = {"sinks": sinks, "window": window, "sparse_score": "attention", **selection}
    opts["sparse_cache"] = sparse_cache
    return PolyAttnConfig.for_kind("linear", window_mix=True, window_mix_init=0.0, **opts)


def _matched(settings: LongContextSettings, like) -> tuple[int, Any]:
    """(budget, the sparse row's config) of the matched-memory rows."""
    budget = settings.matched_cache or (like.sparse_cache if like is not None else MATCHED_CACHE)
    if like is not None:
        return budget, matched_memory_config(budget, like=like)
    return budget, matched_memory_config(budget, sinks=settings.streaming_sinks, window=settings.streaming_window)


def _matched_label(settings: LongContextSettings, like=None) -> str:
    budget, cfg = _matched(settings, like)
    obs = f", sparse_observe {cfg.sparse_observe}" if cfg.sparse_observe else ""
    obs += ", sinks at their own positions" if cfg.sink_position == "own" else ""
    if cfg.sparse_value_keys:
        obs += f", {cfg.sparse_value_keys} of them by the largest |v| pooled over {cfg.sparse_value_pool}"
    return (f"sparse cache on softmax (matched memory): exact softmax on {cfg.sinks} sinks + a {cfg.window}-token "
            f"window + {budget} selected keys (sparse_score {cfg.sparse_score!r}, blocks of {cfg.sparse_chunk}{obs}), "
            "no training")


def _streaming_matched(settings: LongContextSettings, like) -> tuple[int, int]:
    """(sinks, window) of StreamingLLM holding as many keys as the sparse row: its window + its selected keys."""
    budget, cfg = _matched(settings, like)
    return cfg.sinks, cfg.window + budget


BASELINES = {
    "softmax": lambda s, like=None: "softmax (the checkpoint)",
    "streaming": lambda s, like=None: f"StreamingLLM: softmax on {s.streaming_sinks} sink tokens + a "
                                      f"{s.streaming_window}-token window (sliding_window kind, no training)",
    "sparse": _matched_label,
    "streaming_matched": lambda s, like=None: (
        "StreamingLLM at matched memory: softmax on {} sink tokens + a {}-token window (sliding_window kind, no "
        "training)".format(*_streaming_matched(s, like))),
}


def evaluate_model(label: str, model, tokenizer, ids: torch.Tensor, settings: LongContextSettings, *,
                   progress: bool = False) -> dict[str, Any]:
    """One row: the perplexity curve and passkey grid of ``model``."""
    t0 = time.time()
    check_prefill_chunk(model, settings.prefill_chunk)  # before the perplexity curve, not after it
    ids = ids.reshape(-1)[: settings.max_tokens]
    row: dict[str, Any] = {"label": label, "attention": _attention_of(model)}
    row["perplexity"] = perplexity_curve(model, ids, settings.contexts, tokens_per_batch=settings.tokens_per_batch,
                                         progress=progress)
    for template in settings.passkey_templates if settings.passkey_lengths else ():
        # the first template's grid is the row's "passkey" (the heatmap, the card); the others sit beside it
        name = "passkey" if template == settings.passkey_templates[0] else f"passkey_{template}"
        for multi in (False, True) if settings.multi_turn else (False,):
            row[name + ("_multi_turn" if multi else "")] = passkey_retrieval(
                model, tokenizer, settings.passkey_lengths, settings.passkey_depths, seed=settings.passkey_seed,
                progress=progress, template=template, multi_turn=multi, read=settings.read,
                prefill_chunk=settings.prefill_chunk)
    if settings.ruler_lengths:
        from .ruler import run_ruler

        for multi in (False, True) if settings.multi_turn else (False,):
            row["ruler_multi_turn" if multi else "ruler"] = run_ruler(
                model, tokenizer, settings.ruler_lengths, settings.ruler_tasks, samples=settings.ruler_samples,
                seed=settings.ruler_seed, multi_turn=multi, progress=progress, read=settings.read,
                prefill_chunk=settings.prefill_chunk)
    row["wall_s"] = round(time.time() - t0, 1)
    return row


def _attention_of(model) -> dict[str, Any] | str:
    from ..integration import get_polyattn_config

    cfg = get_polyattn_config(model)
    if cfg is None or getattr(model.config, "_attn_implementation", None) != cfg.kind:
        return f"softmax ({getattr(model.config, '_attn_implementation', '?')})"
    return cfg.to_dict()


def evaluate_rows(model, tokenizer, ids: torch.Tensor, settings: LongContextSettings, *, label: str,
                  load_base: Callable[[], Any] | None = None, progress: bool = False,
                  log: Callable[[str], None] = print) -> dict[str, Any]:
    """``model``'s row and the baseline rows (``load_base()`` returns a fresh copy of the softmax checkpoint on the
    model's device; needed when ``settings.baselines`` is not empty). Returns the full result record."""
    import hf_polyattn

    # the matched-memory rows copy the evaluated model's sparse cache (budget and selection rules) when it has one
    like = hf_polyattn.get_polyattn_config(model)
    like = like if like is not None and getattr(like, "sparse_cache", 0) else None
    rows = []
    for name in settings.baselines:
        if load_base is None:
            raise ValueError("baselines need load_base: a function returning the softmax checkpoint")
        base = load_base()
        if name == "streaming":
            hf_polyattn.convert(base, streaming_config(settings.streaming_sinks, settings.streaming_window))
        elif name == "streaming_matched":
            hf_polyattn.convert(base, streaming_config(*_streaming_matched(settings, like)))
        elif name == "sparse":
            hf_polyattn.convert(base, _matched(settings, like)[1])
        log(f"[long context] {name} row")
        rows.append({**evaluate_model(BASELINES[name](settings, like), base, tokenizer, ids, settings,
                                      progress=progress), "baseline": name})
        del base
    log(f"[long context] {label}")
    rows.append(evaluate_model(label, model, tokenizer, ids, settings, progress=progress))
    from .. import machine

    return {"settings": _jsonable(asdict(settings)), "tokens": int(min(ids.numel(), settings.max_tokens)),
            "rows": rows, "machine": machine.summary()}


def _jsonable(d: dict[str, Any]) -> dict[str, Any]:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}


# ----------------------------------------------------------------------------------------------- output


def _softmax_row(result: dict[str, Any]) -> dict[str, Any] | None:
    return next((r for r in result["rows"] if r.get("baseline") == "softmax"), None)


def long_context_markdown(result: dict[str, Any]) -> str:
    """Perplexity at every context (and its ratio to the softmax row) and passkey accuracy per length."""
    rows = result["rows"]
    contexts = result["settings"]["contexts"]
    lengths = result["settings"]["passkey_lengths"]
    soft = _softmax_row(result)
    templates = result["settings"].get("passkey_templates", ["classic"])
    grids = [("passkey" if i == 0 else f"passkey_{name}", name) for i, name in enumerate(templates)]
    named = len(templates) > 1 or templates[0] != "classic"
    multi = bool(result["settings"].get("multi_turn"))
    # multi-turn: beside each single-prompt column, the first question on the cached document (turn 1) and the second
    # after the first answer (turn 2)
    modes = [("", "hits", "")] + ([("_multi_turn", "hits", " turn 1"), ("_multi_turn", "hits_second", " turn 2")]
                                  if multi else [])
    head = ["attention", *[f"ppl @ {c:,}" for c in contexts],
            *[f"{'passkey' if not named else name}{what} @ {n:,}" for _, name in grids for _, _, what in modes
              for n in lengths]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["label"]]
        for i, p in enumerate(r["perplexity"]):
            v = p["perplexity"]
            ratio = ""
            if soft is not None and r is not soft:
                ratio = f" ({v / soft['perplexity'][i]['perplexity']:.2f}x)"
            cells.append(f"{v:.2f}{ratio}")
        for key, _ in grids:
            for suffix, field_name, _ in modes:
                pk = r.get(key + suffix)
                for n in lengths:
                    if pk is None:
                        cells.append("–")
                    else:
                        hits = pk[field_name][pk["lengths"].index(n)]
                        cells.append(f"{sum(hits)}/{len(hits)}")
        lines.append("| " + " | ".join(cells) + " |")
    s = result["settings"]
    note = (f"\nPerplexity = exp(mean token NLL) over the first {result['tokens']:,} held-out tokens, non-overlapping "
            f"windows of each context (every token but a window's first scored once); ratios to the softmax row. "
            f"Passkey: {s['passkey_depths']} depths per length, seed {s['passkey_seed']}, greedy decoding through the "
            f"model's own cache, exact match of the key (templates: {', '.join(templates)}: "
            f"hf_polyattn/eval/passkey.py). Machine: {result.get('machine', '?')}.")
    if multi:
        note += (" Turn 1 / turn 2: the same prompts with the document read by its own forward call first, then the "
                 "question asked on that cache, then a second question after the first answer on the same cache (the "
                 "same key again; another label's key for 'multi').")
        copied = [r["label"] for r in rows if any((r.get(key + "_multi_turn") or {}).get("read") == "copy"
                                                  for key, _ in grids)]
        if copied:
            note += (f" Rows whose document was read by copy scores (hf_polyattn.read_document, --read copy): "
                     f"{'; '.join(copied)}; the others by their own forward call (no sparse cache to choose).")
    from .ruler import ruler_markdown

    ruler = ruler_markdown(rows)
    return "\n".join(lines) + "\n" + note + "\n" + ("\n" + ruler if ruler else "")


def long_context_figure(result: dict[str, Any]):
    """The matplotlib figure of ``plot_long_context``: perplexity vs context (left), a passkey heatmap per row
    (right). Each row is named by ``plot_label`` (short enough for a legend and a panel title: the full labels are
    in the table beside the plot). Raises ImportError without matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    with_pk = [r for r in rows if r.get("passkey")]
    ncols = 1 + len(with_pk)
    fig, axes = plt.subplots(1, ncols, figsize=(5.5 + 2.6 * len(with_pk), 4.2), squeeze=False,
                             gridspec_kw={"width_ratios": [2.2] + [1] * len(with_pk)})
    ax = axes[0][0]
    for r in rows:
        xs = [p["context"] for p in r["perplexity"]]
        ys = [p["perplexity"] for p in r["perplexity"]]
        ax.plot(xs, ys, marker="o", label=plot_label(r))
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("perplexity")
    ax.set_title("held-out perplexity vs context")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    for ax, r in zip(axes[0][1:], with_pk):
        pk = r["passkey"]
        ax.imshow(torch.tensor(pk["hits"], dtype=torch.float32).numpy(), vmin=0, vmax=1, cmap="RdYlGn",
                  aspect="auto")
        ax.set_yticks(range(len(pk["lengths"])), [f"{n:,}" for n in pk["lengths"]])
        # depths in percent of the prompt: one decimal of a fraction printed 0.05 and 0.15 both as 0.1
        ax.set_xticks(range(len(pk["depths"])), [f"{100 * d:.0f}" for d in pk["depths"]], fontsize=6)
        ax.set_xlabel("needle depth (%)")
        ax.set_title(f"passkey: {plot_label(r)}", fontsize=8)
    axes[0][1 if with_pk else 0].set_ylabel("prompt length" if with_pk else "perplexity")
    fig.tight_layout()
    return fig


def plot_long_context(result: dict[str, Any], path: str | Path) -> Path | None:
    """perplexity vs context (left) and a passkey heatmap per row (right), as a PNG at ``path``; None without
    matplotlib."""
    try:
        import matplotlib.pyplot as plt

        fig = long_context_figure(result)
    except ImportError:
        return None
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# how the plot names a baseline row (its table row keeps the full label)
PLOT_BASELINES = {"softmax": "softmax", "streaming": "StreamingLLM"}


def plot_label(row: dict[str, Any], width: int = 24) -> str:
    """A row's name in the plot: a baseline's short name, the model's kind ('this model (linear)'), else its label
    cut to ``width`` characters. The full labels (a kind's settings run to 150 characters) overflowed the legend
    and ran the heatmaps' titles into each other and off the figure."""
    if row.get("baseline"):
        return PLOT_BASELINES.get(row["baseline"], row["baseline"])
    attention = row.get("attention")
    kind = attention.get("kind") if isinstance(attention, dict) else None
    if kind:
        return f"this model ({kind})"
    label = row["label"]
    return label if len(label) <= width else label[: width - 1] + "…"


def write_long_context(result: dict[str, Any], out_dir: str | Path, name: str = "long_context") -> dict[str, Path]:
    """``name``.json, ``name``.md and ``name``.png (when matplotlib is installed) in ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / f"{name}.json", "md": out / f"{name}.md"}
    paths["json"].write_text(json.dumps(result, indent=1))
    paths["md"].write_text(long_context_markdown(result))
    png = plot_long_context(result, out / f"{name}.png")
    if png is not None:
        paths["png"] = png
    return paths
