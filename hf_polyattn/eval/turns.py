"""Serving-style generation for the evaluations: a document read into the cache first, questions asked after.

``long_context`` (multi-turn passkey) and ``ruler`` (multi-turn RULER) both use it; it sits in its own module so that
each of them imports it rather than the other.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["READS", "document_reader", "generate_turns"]

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


def _max_positions(model) -> int | None:
    """The positions of a model or of its config (None when it names none: no limit known)."""
    cfg = getattr(model, "config", model)
    return getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None)


@torch.no_grad()
def generate_turns(model, document: Sequence[int], questions: Sequence[Sequence[int]], *, max_new_tokens: int,
                   pad_token_id: int | None, reader=None) -> list[list[int]]:
    """Greedy answers to ``questions`` asked one after another about ``document`` (token ids, batch 1), served as a
    chat server or a prefix cache serves them: the document is read into the model's cache by its own forward call,
    then each question is appended to everything before it (the document, the earlier questions and the answers
    generated to them) and answered by ``generate()`` on that cache, which only reads the tokens the cache has not
    seen. The cache is the one the model's forward makes (a DynamicCache for softmax; hf_polyattn's recurrent layers
    for a converted model), passed and read back by ``hf_polyattn.cache_kwargs`` / ``returned_cache``.

    Why a separate path: a bounded cache (a sparse cache, a recurrent state) chooses what it keeps while reading the
    document, before any question exists; a single prompt lets a prefill-time rule (``sparse_observe``) see the
    question first. For softmax the split changes nothing but rounding (tests/eval/test_multi_turn.py).
    ``reader`` (model, ids (1, n)) -> cache reads the document instead of the plain forward (``document_reader``)."""
    from ..integration.compatibility import cache_kwargs, last_logits_only, returned_cache

    device = next(model.parameters()).device
    ids = torch.tensor([list(document)], device=device)
    keep = last_logits_only(model)  # the document's logits are never read (generate() computes the question's)
    if reader is not None:
        cache = reader(model, ids)
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
