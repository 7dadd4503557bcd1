"""Reading a document for questions asked later: the sparse cache chosen by copy scores.

Why: a bounded sparse cache (``sparse_cache``) chooses its keys by the queries that exist when it chooses
(``sparse_score='attention'``, ``sparse_observe``): a document read in its own call (a chat server, a prefix cache)
keeps what its own last sentences read, and a question asked in a later turn finds little else. KVzip (Kim et al.,
NeurIPS 2025, "KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction") scores each key by what the
model needs to repeat the document: after it, "Repeat the previous context exactly:" and the document again
(teacher-forced, in chunks, each chunk on the document's keys); a key's score is the largest softmax weight any
copying query of its kv head's query heads gives it. In SmolLM2-135M's ten softmax heads that read an 8k passkey
needle most when asked (weighted by that attention), 1.5% ('vault') and 5.9% ('classic') of the document's keys
outrank the needle's tokens by that score, against 14.8% and 14.0% by |v| (``sparse_value_keys``' rule)
(``recipes/results/later_question/needle_ranks_*_8000.json``).

``copy_scores`` computes them with the model's own q, k and exact softmax attention (the checkpoint's attention:
the converted layers are bypassed for that pass, as the attention transfer's teacher is), in one forward over the
document followed by every chunk's copy, each chunk's positions continuing the document's. Cost: a second pass
over the document's tokens, with every copying query reading the whole document: O(n^2) attention once per
document (KVzip's trade: a document read once and asked many times). The document's own rows need no weights:
PyTorch's SDPA computes them (the exact float32 path only under a logit soft-cap); the copying rows' weights are
exact float32, in query blocks of ``BLOCK`` rows, each block's softmax computed in place.

``read_document`` then reads the document into a fresh cache with every sparse layer's selection ranked by those
scores (``SparseMixin.selection_scores``: the |v| reserve of ``sparse_value_keys`` first, the rest of the budget the
document's top keys by copy score, no ``sparse_observe`` re-choice); the cache it returns answers questions as any
other (``generate()``, the decoding state unchanged in size).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from ..ops.hybrid import HybridAttention
from ..ops.sparse import SparseMixin
from .compatibility import find_attention_modules, last_logits_only, returned_cache

__all__ = ["COPY_PROMPT", "copy_scores", "read_document", "sparse_layers"]

# KVzip's reconstruction prompt: what the copying queries follow
COPY_PROMPT = "\n\nRepeat the previous context exactly:\n"
COPY_NAME = "hf_polyattn_copy"
BLOCK = 512  # query rows per attention block: 9 heads x 512 x 9,000 keys = 166 MB of fp32 weights at 8k
CHUNK = 1024  # document tokens copied per block by default
MIN_CHUNK = 16  # the fewest a block may copy: the prompt's tokens are repeated once per block


def _check_ids(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> int:
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.shape[0] != 1:
        shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise ValueError(f"input_ids must be one document as a (1, tokens) tensor, got {shape}: documents are read "
                         "one at a time")
    if input_ids.shape[1] < 1:
        raise ValueError("input_ids holds no token")
    if attention_mask is not None and not bool(attention_mask.bool().all()):
        raise ValueError("attention_mask must be None or all ones: a document is read without padding")
    return int(input_ids.shape[1])


def _exact_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qpos: torch.Tensor, kpos: torch.Tensor,
                visible: torch.Tensor, scale: float, softcap: float | None, window: int | None) -> torch.Tensor:
    """(H, R, d) the output of R query rows over K keys, exact softmax in float32: q (H, R, d), k / v (H, K, d)
    (already repeated to the query heads), ``visible`` (R, K) the pattern before a sliding ``window`` (keys less
    than ``window`` positions back) and the model's logit ``softcap``. The document rows of a soft-capped model
    (SDPA has no soft-capping)."""
    x = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if softcap:
        x = torch.tanh(x / softcap) * softcap
    if window:
        visible = visible & (qpos[:, None] - kpos[None, :] < window)
    return torch.matmul(x.masked_fill(~visible, float("-inf")).softmax(-1), v.float())


def _document_rows(q, k, v, scale: float, softcap: float | None, window: int | None) -> torch.Tensor:
    """(H, n, d) float32: the document's own rows, causal over the document (they only carry the hidden states to
    the copying rows: no weights needed). PyTorch's SDPA without soft-capping (no n x n weights in memory: its
    fused CPU / GPU kernels); under a soft-cap ``_exact_rows``, in blocks of ``BLOCK`` rows."""
    n = q.shape[1]
    q, k, v = q.float(), k.float(), v.float()
    if not softcap and (not window or window >= n):
        # 4-d: 3-d inputs take SDPA's math path on a CPU (1.2 s against 0.26 s for 9 heads x 4,000, one thread)
        return F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True, scale=scale)[0]
    out = torch.empty(q.shape[0], n, v.shape[-1], dtype=torch.float32, device=q.device)
    pos = torch.arange(n, device=q.device)
    for s in range(0, n, BLOCK):
        e = min(n, s + BLOCK)
        if softcap:
            out[:, s:e] = _exact_rows(q[:, s:e], k[:, :e], v[:, :e], pos[s:e], pos[:e],
                                      pos[:e][None, :] <= pos[s:e, None], scale, softcap, window)
            continue
        lo = max(0, s - window + 1)  # a window: only the keys it reaches, masked
        gap = pos[s:e, None] - pos[None, lo:e]
        out[:, s:e] = F.scaled_dot_product_attention(q[None, :, s:e], k[None, :, lo:e], v[None, :, lo:e],
                                                     attn_mask=(gap >= 0) & (gap < window), scale=scale)[0]
    return out


def _copy_rows(q, k_doc, v_doc, k_own, v_own, at: int, scale: float, softcap: float | None, window: int | None):
    """(out (H, R, d), weights' max over the rows (H, n)) of R copying rows: rows ``at`` .. ``at + R - 1`` of their
    copy block (at positions n + at ..., after the document's n), over the whole document (k_doc (H, n, d)) and
    their block's keys up to their own (k_own (H, at + R, d)), exact softmax in float32, in place over both parts.
    The document part takes no mask unless a ``window`` hides its far keys."""
    n, r = k_doc.shape[1], q.shape[1]
    qs = q.float() * scale
    x_doc = torch.matmul(qs, k_doc.float().transpose(-1, -2))  # (H, R, n)
    x_own = torch.matmul(qs, k_own.float().transpose(-1, -2))  # (H, R, at + R)
    if softcap:
        x_doc.div_(softcap).tanh_().mul_(softcap)
        x_own.div_(softcap).tanh_().mul_(softcap)
    rows = torch.arange(at, at + r, device=q.device)
    # own keys: causal within the block (key j <= row)
    x_own.masked_fill_(torch.arange(at + r, device=q.device)[None, :] > rows[:, None], float("-inf"))
    if window:  # the row at position n + row reaches the document keys less than window back
        far = (n + rows[:, None]) - torch.arange(n, device=q.device)[None, :] >= window
        x_doc.masked_fill_(far, float("-inf"))
        x_own.masked_fill_(rows[:, None] - torch.arange(at + r, device=q.device)[None, :] >= window, float("-inf"))
    # softmax over both parts in place (fewer passes over the R x n block than softmax / logsumexp: 0.21 s against
    # 0.24 / 0.31 s for 9 x 512 x 8,000 on one CPU thread)
    top = torch.maximum(x_doc.amax(-1, keepdim=True), x_own.amax(-1, keepdim=True))
    total = x_doc.sub_(top).exp_().sum(-1, keepdim=True) + x_own.sub_(top).exp_().sum(-1, keepdim=True)
    x_doc.div_(total)
    x_own.div_(total)
    return torch.matmul(x_doc, v_doc.float()) + torch.matmul(x_own, v_own.float()), x_doc.amax(1)


def _copy_attention(blocks: list[tuple[int, int]], n: int, scores: dict[int, torch.Tensor]):
    """The attention function of the copy pass over the packed sequence (the document's n tokens, then each copy
    block (start, end)): document rows causal over the document; a block's rows over the whole document and their
    own block, causally. Records, per layer, each document key's largest weight from any copying row."""

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, softcap=None,
                  sliding_window=None, **kwargs):
        _, h, total, d = query.shape
        hkv = key.shape[1]
        g = h // hkv
        scale = scaling if scaling is not None else d ** -0.5
        k, v = key[0].repeat_interleave(g, 0), value[0].repeat_interleave(g, 0)  # (H, total, d)
        q = query[0]
        out = torch.empty(h, total, v.shape[-1], dtype=torch.float32, device=query.device)
        out[:, :n] = _document_rows(q[:, :n], k[:, :n], v[:, :n], scale, softcap, sliding_window)
        best = torch.zeros(h, n, dtype=torch.float32, device=query.device)
        for start, end in blocks:
            for s in range(start, end, BLOCK):
                e = min(end, s + BLOCK)
                out[:, s:e], w = _copy_rows(q[:, s:e], k[:, :n], v[:, :n], k[:, start:e], v[:, start:e], s - start,
                                            scale, softcap, sliding_window)
                torch.maximum(best, w, out=best)
        best = best.view(hkv, g, n).amax(1)
        idx = module.layer_idx
        scores[idx] = torch.maximum(scores[idx], best) if idx in scores else best
        return out.to(query.dtype).unsqueeze(0).transpose(1, 2).contiguous(), None

    return attention


def _no_mask(*args, **kwargs):
    return None  # the copy pass builds its own pattern (a packed sequence: transformers' masks cannot say it)


@torch.no_grad()
def copy_scores(model, input_ids: torch.Tensor, prompt_ids: Sequence[int], *, chunk: int | None = None,
                attention_mask: torch.Tensor | None = None) -> dict[int, torch.Tensor]:
    """{layer index: (1, Hkv, n) float32} each document key's copy score (module docstring): its largest softmax
    weight (the model's own q, k, exact) from any query that copies the document after ``prompt_ids`` (the
    tokenised ``COPY_PROMPT``), chunk by chunk (``chunk`` document tokens each), max over the kv head's query heads.
    ``input_ids`` (1, n) one document. ``chunk`` None: ``CHUNK``, or fewer where the model's positions end before
    (a copy block's positions follow the document's: an 8k document on SmolLM2's 8,192 positions copies ~200 tokens
    at a time); an explicit chunk that passes the model's positions is refused. The model's attention
    implementation is restored on exit."""
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    n = _check_ids(input_ids, attention_mask)
    prompt = torch.as_tensor(list(prompt_ids), dtype=input_ids.dtype, device=input_ids.device)
    if prompt.dim() != 1 or prompt.numel() < 1:
        raise ValueError("prompt_ids must be a non-empty list of token ids (the tokenised COPY_PROMPT)")
    limit = getattr(model.config, "max_position_embeddings", None)
    if chunk is None:
        chunk = CHUNK if not limit else min(CHUNK, limit - n - prompt.numel())
        if chunk < MIN_CHUNK:
            raise ValueError(f"a {n}-token document leaves {max(chunk, 0)} of the model's {limit} positions for its "
                             f"copy (at least {MIN_CHUNK} needed beside the {prompt.numel()}-token prompt): read a "
                             "shorter document")
    elif isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk must be None or an int >= 1 (document tokens copied per block), got {chunk!r}")
    doc = input_ids[0]
    pieces, positions, blocks, at = [doc], [torch.arange(n, device=doc.device)], [], n
    for c in range(0, n, chunk):
        block = torch.cat([prompt, doc[c : c + chunk]])
        pieces.append(block)
        positions.append(n + torch.arange(block.numel(), device=doc.device))
        blocks.append((at, at + block.numel()))
        at += block.numel()
    longest = n + prompt.numel() + min(chunk, n)
    if limit and longest > limit:
        raise ValueError(f"the copy of a {n}-token document in chunks of {chunk} reaches position {longest}, past the "
                         f"model's {limit}: use a chunk of at most {limit - n - prompt.numel()} (or None)")
    scores: dict[int, torch.Tensor] = {}
    AttentionInterface.register(COPY_NAME, _copy_attention(blocks, n, scores))
    AttentionMaskInterface.register(COPY_NAME, _no_mask)
    previous = model.config._attn_implementation
    model.set_attn_implementation(COPY_NAME)
    try:
        model(torch.cat(pieces)[None], position_ids=torch.cat(positions)[None], use_cache=False,
              **last_logits_only(model))
    finally:
        model.set_attn_implementation(previous)
    return {idx: s[None] for idx, s in scores.items()}


def sparse_layers(model) -> list[tuple[int, SparseMixin]]:
    """(layer index, module) of every layer whose sparse cache ``read_document`` chooses; a layer with softmax heads
    beside a sparse kernel part is refused (ValueError)."""
    layers = []
    for name, mod, idx in find_attention_modules(model):
        module = getattr(mod, "polyattn", None)
        if isinstance(module, HybridAttention):
            kernel = module.kernel
            if kernel is not None and getattr(kernel.config, "sparse_cache", 0):
                raise ValueError(f"{name}: read_document does not choose the sparse cache of a layer with softmax "
                                 "heads (its kernel heads are a subset of the kv heads); such a layer's softmax heads "
                                 "keep every key already")
            continue
        if isinstance(module, SparseMixin) and getattr(module.config, "sparse_cache", 0):
            layers.append((idx, module))
    return layers


@torch.no_grad()
def read_document(model, input_ids: torch.Tensor, tokenizer, *, chunk: int | None = None,
                  attention_mask: torch.Tensor | None = None):
    """The cache after reading one document (``input_ids`` (1, n)) for questions asked later: every sparse layer's
    cache holds the document's top ``sparse_cache`` keys by copy score (``copy_scores``, ``chunk`` tokens copied at
    a time: None for its default), after its ``sparse_value_keys`` reserve by |v|; every other key is folded into
    the kernel state as the streaming rule folds it. Ask on it with
    ``generate(..., **hf_polyattn.cache_kwargs(cache))`` (the ids then hold the document and the question).
    Refuses a model without a sparse cache (nothing to choose)."""
    n = _check_ids(input_ids, attention_mask)
    layers = sparse_layers(model)
    if not layers:
        raise ValueError("read_document chooses a sparse cache by copy scores: no layer of this model has "
                         "sparse_cache (a softmax model keeps every key; convert with sparse_cache > 0)")
    prompt_ids = tokenizer(COPY_PROMPT, add_special_tokens=False)["input_ids"]
    scores = copy_scores(model, input_ids, prompt_ids, chunk=chunk)
    missing = [idx for idx, _ in layers if idx not in scores]
    if missing:
        raise RuntimeError(f"the copy pass scored no key for layers {missing[:4]}: their attention did not run "
                           "through transformers' attention interface")
    for idx, module in layers:
        module.selection_scores = scores[idx]
    try:
        out = model(input_ids, attention_mask=torch.ones_like(input_ids), use_cache=True, **last_logits_only(model))
    finally:
        for _, module in layers:
            module.selection_scores = None
    cache = returned_cache(out)
    if cache is None:
        raise ValueError(f"{type(model).__name__} returned no cache from a forward with use_cache=True")
    if cache.get_seq_length() != n:
        raise RuntimeError(f"the cache holds {cache.get_seq_length()} tokens after reading {n}")
    return cache
