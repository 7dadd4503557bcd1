"""Evaluation metrics, computed in the project.

``evaluate.load("accuracy")`` / ``evaluate.load("perplexity")`` fetch their metric scripts from
the Hub at load time and fail offline; the old ``perplexity`` metric also reloads the model by id,
which would silently evaluate softmax attention instead of the swapped one. Both metrics are a few
lines, so they live here and run on the model object they are given.

Perplexity = exp(mean token NLL) over a token stream, evaluated with windows of ``context``
tokens moved by ``stride``: each token is scored at most once, by the first window that covers
it with at least one token of context inside the window. With ``stride < context`` every token
but the very first is scored and sees at least ``context - stride`` tokens of context; with
``stride == context`` (non-overlapping windows) the first token of each window is not scored. The last window is
aligned to the end of the stream (a full window, scoring only tokens not scored yet), so all
windows have the same length and batch without padding.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.nn import functional as F

__all__ = ["accuracy", "perplexity", "perplexity_windows"]

# A batch's logits are batch x context x vocabulary floats: with Gemma 3's 262,144-token vocabulary, 8 windows of
# 1,024 tokens are 8.6 GB, and cross_entropy's temporaries as much again (the process was killed on a 24 GiB
# machine). So a batch holds at most LOGITS_BUDGET logits (at least one window; 8,192 tokens of SmolLM2's 49,152 are
# 0.4 G, unchanged), and the NLL is computed NLL_CHUNK logits at a time, upcast to fp32 chunk by chunk.
LOGITS_BUDGET = 1 << 30
NLL_CHUNK = 1 << 26


def _vocab_size(model) -> int | None:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    weight = getattr(head, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.dim() == 2:
        return int(weight.shape[0])
    return getattr(getattr(model, "config", None), "vocab_size", None)


def _nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-position NLL in fp32 of (L, V) logits against (L,) targets, NLL_CHUNK logits per cross_entropy call."""
    step = max(1, NLL_CHUNK // logits.shape[-1])
    return torch.cat([F.cross_entropy(logits[a:a + step].float(), targets[a:a + step], reduction="none")
                      for a in range(0, logits.shape[0], step)])


def perplexity_windows(num_tokens: int, context: int, stride: int) -> list[tuple[int, int, int]]:
    """(start, first scored position, end) of each window; targets t in [first, end) are scored once."""
    if context < 2:
        raise ValueError(f"context must be >= 2, got {context}")
    if not 1 <= stride <= context:
        raise ValueError(f"stride must be in [1, context={context}], got {stride}")
    if num_tokens < 2:
        raise ValueError(f"need at least 2 tokens, got {num_tokens}")
    if num_tokens <= context:
        return [(0, 1, num_tokens)]
    out = []
    scored_until = 1  # next target position not yet scored
    start = 0
    while True:
        end = start + context
        if end >= num_tokens:
            start = num_tokens - context
            end = num_tokens
            out.append((start, max(scored_until, start + 1), end))
            break
        out.append((start, max(scored_until, start + 1), end))
        scored_until = end
        start += stride
    return out


@torch.no_grad()
def perplexity(model, ids: torch.Tensor, *, context: int, stride: int, batch_size: int = 4,
               progress: bool = False, desc: str = "perplexity") -> dict[str, Any]:
    """exp(mean token NLL) of a causal LM over a 1-D token stream (see module docstring)."""
    ids = ids.reshape(-1).long()
    wins = perplexity_windows(ids.numel(), context, stride)
    vocab = _vocab_size(model)
    if vocab:
        batch_size = max(1, min(batch_size, LOGITS_BUDGET // (vocab * min(context, ids.numel()))))
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    total_nll = 0.0
    total_tokens = 0
    it = range(0, len(wins), batch_size)
    if progress:
        from tqdm.auto import tqdm

        it = tqdm(it, desc=desc, unit="batch")
    try:
        for b in it:
            chunk = wins[b : b + batch_size]
            x = torch.stack([ids[s:e] for s, _, e in chunk]).to(device)
            logits = model(input_ids=x, use_cache=False).logits
            for row, (s, first, e) in enumerate(chunk):
                # target position t is predicted at logits index t - 1 - s
                nll = _nll(logits[row, first - 1 - s : e - 1 - s], x[row, first - s : e - s])
                total_nll += nll.double().sum().item()
                total_tokens += e - first
            del logits
    finally:
        model.train(was_training)
    mean = total_nll / total_tokens
    return {
        "perplexity": math.exp(mean),
        "mean_nll": mean,
        "tokens": total_tokens,
        "context": context,
        "stride": stride,
        "windows": len(wins),
    }


@torch.no_grad()
def accuracy(model, batches, *, progress: bool = False, desc: str = "accuracy") -> dict[str, Any]:
    """Fraction of argmax(logits) == labels over an iterable of batches with a ``labels`` key."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    correct = total = 0
    hits: list[str] = []
    if progress:
        from tqdm.auto import tqdm

        batches = tqdm(batches, desc=desc, unit="batch")
    try:
        for batch in batches:
            labels = batch["labels"].to(device)
            inputs = {k: v.to(device) for k, v in batch.items() if k != "labels"}
            pred = model(**inputs).logits.argmax(-1)
            right = (pred == labels).flatten()
            correct += right.sum().item()
            total += labels.numel()
            hits.extend("1" if x else "0" for x in right.tolist())
    finally:
        model.train(was_training)
    if total == 0:
        raise ValueError("accuracy over an empty set of batches")
    # hits: per-example correctness in evaluation order, so two models scored on the same
    # rows can be compared pairwise (McNemar), which is far tighter than two separate intervals.
    return {"accuracy": correct / total, "correct": correct, "examples": total, "hits": "".join(hits)}
