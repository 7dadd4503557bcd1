"""Serving-style generation for the evaluations: a document read into the cache first, questions asked after.

``long_context`` (multi-turn passkey) and ``ruler`` (multi-turn RULER) both use it; it sits in its own module so that
each of them imports it rather than the other.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["READS", "check_chunk_size", "check_prefill_chunk", "document_reader", "generate_prompt", "generate_turns",
           "prefill"]

# how a multi-turn evaluation reads the document into the cache: 'stream' one forward call (a chat server, a prefix
# cache); 'copy' hf_polyattn.read_document (a sparse cache chosen by copy scores, for questions asked later)
READS = ("stream", "copy")


def check_read(read: str) -> str:
    if read not in READS:
        raise ValueError(f"read must be one of {list(READS)}, got {read!r}")
    return read


def document_reader(model, tokenizer, read: str):
    """(the reader ``generate_turns`` takes, the read used): None for 'stream'; for 'copy' a function reading the
    document with ``hf_polyattn.read_document``, when the model has a sparse cache to choose. A model without one
    (softmax, a window) keeps what no reading order changes: it reads by 'stream', and says so (the read used)."""
    from ..integration.reading import read_document, sparse_layers

    if check_read(read) == "stream" or not sparse_layers(model):
        return None, "stream"
    return (lambda m, ids: read_document(m, ids, tokenizer)), "copy"


def check_chunk_size(chunk: int) -> int:
    """``chunk`` when it is an int >= 0 (the model-free half of ``check_prefill_chunk``); else a ValueError."""
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 0:
        raise ValueError(f"prefill_chunk must be an int >= 0 (0: the whole prompt in one forward call), got {chunk!r}")
    return chunk


def check_prefill_chunk(model, chunk: int) -> int:
    """``chunk`` (the tokens of each forward call that reads a prompt or a document; 0: one call) when reading in
    calls of that size gives what one call gives. It does for softmax (a DynamicCache, sliding layers included), the
    kernels' recurrent state and a window (tests/eval/test_prefill_chunk.py); it does not for a sparse cache, which
    chooses its keys at the end of each call (``sparse_observe`` reads the call's last queries), so a model with one
    is refused (ValueError) rather than scored on a different selection."""
    if check_chunk_size(chunk):
        from ..ops.sparse import SparseMixin

        sparse = [name for name, m in model.named_modules()
                  if isinstance(m, SparseMixin) and getattr(m.config, "sparse_cache", 0)]
        if sparse:
            raise ValueError(f"prefill_chunk={chunk}: {type(model).__name__} has a sparse cache ({sparse[0]}), which "
                             "chooses its keys at the end of every forward call, so reading a prompt in chunks would "
                             "change what it keeps: use prefill_chunk=0 (one call) for it")
    return chunk


@torch.no_grad()
def prefill(model, ids: torch.Tensor, chunk: int):
    """The cache after reading ``ids`` (1, n) in forward calls of ``chunk`` tokens (``check_prefill_chunk``).

    Why: a checkpoint's sliding layers run as full attention under a mask in one call (transformers' SDPA path), so a
    16k prompt costs 16k x 16k per sliding layer; in calls of 2k each reads its window and its own tokens only (Gemma
    3 270M at 16k on one CPU thread: recipes/results/gemma3_270m/prefill_chunk.md)."""
    from ..integration.compatibility import cache_kwargs, last_logits_only, returned_cache

    keep = last_logits_only(model)  # the read's logits are never used
    cache = None
    for start in range(0, ids.shape[1], chunk):
        part = ids[:, start:start + chunk]
        past = cache_kwargs(cache) if cache is not None else {}
        out = model(part, attention_mask=torch.ones(1, start + part.shape[1], dtype=torch.long, device=ids.device),
                    use_cache=True, **past, **keep)
        cache = returned_cache(out)
        if cache is None:
            raise ValueError(f"{type(model).__name__} returned no cache from a forward with use_cache=True: "
                             "prefill_chunk needs one")
    return cache


@torch.no_grad()
def generate_prompt(model, prompt: Sequence[int], *, max_new_tokens: int, pad_token_id: int | None,
                    prefill_chunk: int = 0) -> list[int]:
    """Greedy answer to one prompt (token ids, batch 1) by the model's ``generate()``; ``prefill_chunk`` > 0 reads
    all but its last token first in calls of that many tokens (``prefill``), and ``generate()`` reads the rest on
    that cache."""
    from ..integration.compatibility import cache_kwargs

    device = next(model.parameters()).device
    ids = torch.tensor([list(prompt)], device=device)
    extra = {}
    if prefill_chunk and ids.shape[1] > prefill_chunk:
        extra = cache_kwargs(prefill(model, ids[:, :-1], prefill_chunk))
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                         pad_token_id=pad_token_id, **extra)
    return out[0, ids.shape[1]:].tolist()


def _max_positions(model) -> int | None:
    """The positions of a model or of its config (None when it names none: no limit known)."""
    cfg = getattr(model, "config", model)
    return getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None)


@torch.no_grad()
def generate_turns(model, document: Sequence[int], questions: Sequence[Sequence[int]], *, max_new_tokens: int,
                   pad_token_id: int | None, reader=None, prefill_chunk: int = 0) -> list[list[int]]:
    """Greedy answers to ``questions`` asked one after another about ``document`` (token ids, batch 1), served as a
    chat server or a prefix cache serves them: the document is read into the model's cache by its own forward call,
    then each question is appended to everything before it (the document, the earlier questions and the answers
    generated to them) and answered by ``generate()`` on that cache, which only reads the tokens the cache has not
    seen. The cache is the one the model's forward makes (a DynamicCache for softmax; hf_polyattn's recurrent layers
    for a converted model), passed and read back by ``hf_polyattn.cache_kwargs`` / ``returned_cache``.

    Why a separate path: a bounded cache (a sparse cache, a recurrent state) chooses what it keeps while reading the
    document, before any question exists; a single prompt lets a prefill-time rule (``sparse_observe``) see the
    question first. For softmax the split changes nothing but rounding (tests/eval/test_multi_turn.py).
    ``reader`` (model, ids (1, n)) -> cache reads the document instead of the plain forward (``document_reader``);
    without one, ``prefill_chunk`` > 0 reads it in forward calls of that many tokens (``prefill``)."""
    from ..integration.compatibility import cache_kwargs, last_logits_only, returned_cache

    device = next(model.parameters()).device
    ids = torch.tensor([list(document)], device=device)
    keep = last_logits_only(model)  # the document's logits are never read (generate() computes the question's)
    if reader is not None:
        cache = reader(model, ids)
    elif prefill_chunk and ids.shape[1] > prefill_chunk:
        cache = prefill(model, ids, prefill_chunk)
    else:
        cache = returned_cache(model(ids, attention_mask=torch.ones_like(ids), use_cache=True, **keep))
    if cache is None:
        raise ValueError(f"{type(model).__name__} returned no cache from a forward with use_cache=True: multi-turn "
                         "retrieval needs one")
    answers = []
    for q in questions:
        ids = torch.cat([ids, torch.tensor([list(q)], device=device)], dim=1)
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=pad_token_id, return_dict_in_generate=True,
                             **cache_kwargs(cache))
        cache = returned_cache(gen)  # the same object, now holding the question and the answer but its last token
        answers.append(gen.sequences[0, ids.shape[1]:].tolist())
        ids = gen.sequences
    return answers
