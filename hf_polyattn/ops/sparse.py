"""A bounded sparse cache beside the sliding window and the kernel state (LoLA, McDermott, Heath and Parhi,
arXiv:2505.23666).

Why: a kernel state S = sum phi(k)^T [v 1] is a fixed-size associative memory; keys whose features collide with
others' are recalled as a blend (a SmolLM2-135M retrofit with every head linear-time found 1 / 1 / 0 of 10 passkeys
at 1k / 2k / 4k tokens). LoLA keeps, per head, a small budget of past key/value pairs exactly, chosen by how badly
the state represents them, and folds the rest into the state.

Memory of one kv head, for a causal query i (keys bottom-right aligned, s sinks, window w, budget
lambda = ``sparse_cache``, blocks of C = ``sparse_chunk`` real keys):

* the sinks and the window W(i) (``ops/window.py``), exact;
* the **pending block**: real keys that left the window while their block of C real keys has not wholly left it,
  exact (so the exact part spans w to w + C - 1 keys);
* the **sparse cache** Cache_e (<= lambda keys of earlier blocks), exact, under the same normaliser (scored like window
  keys with the model's own q, k; softmax rows share one stabiliser);
* the **kernel state** of every other real key of the complete blocks, read through the features (decayed,
  ``window_mix``-ed and stabilised as the plain window's kernel part).

Selection. Let r_i be the real keys that left query i's window and e_i = floor(r_i / C) its block count. When block b
(real keys b C .. b C + C - 1) has wholly left the window, its keys that are not sinks join Cache_b as candidates;
each candidate (k, v) gets its self-recall error against the state before that block:

    err(k, v) = | v - phi(k) S_v / (phi(k) . S_1) |      (S_v: the value columns, S_1: the normaliser column)

(0 recall while the state is empty); the lambda largest errors form Cache_{b+1} and the other candidates are added to
the state, decayed from their own key to the block's last key. ``sparse_score='attention'`` ranks instead by what the
candidates are read for (an H2O / TOVA-like rule, arXiv:2306.14048 and arXiv:2401.06104, on blocks): the softmax
weight each candidate gets over the candidates (the model's own q, k) from each of the C real queries before the
first query that reads Cache_{b+1}, summed over them and the kv head's query heads, plus ``ATTENTION_CARRY`` (0.9)
times the score a cached key had when last kept. Why: against a state that recalls little (a bounded decay forgets
within ~256 tokens) the recall error is about |v|, which says nothing of which keys a later query reads; on
SmolLM2-135M's linear-only retrofit with 2,048 keys the first 8,192 held-out tokens' perplexity went from 1.074x
softmax's to 1.008x (recipes/results/retrieval/diag/attention_score_8k.json). The decoding state keeps the last C
queries (``RecurrentState.sparse_q``) and the cache's scores (``sparse_score``): constant size. Ties of invalid
candidates break by age, so the outcome does not depend on the batch layout; the cache keeps its keys in candidate
order.

Where this departs from the paper, and why:
* LoLA selects as each token leaves the window; here a whole block of C real keys at a time, at absolute
  boundaries counted in real keys. Selection is sequential (each step's errors read the state the previous step
  left), so a token-by-token rule would force a loop over every token in a training forward. With blocks the
  forward runs one step per C keys (a loop over n / C blocks, O(n) time and memory, nothing n x n) and computes
  exactly what chunked prefill and token-by-token decoding compute (same blocks, same states, same errors); the
  keys of an incomplete block stay exact until their block is scored, so no key is ever taken back out of the
  state.
* The recall reads the key's own (key-side) features phi(k): what the state returns for a query whose features equal
  the key's. For the symmetric maps (elu, relu, taylor, polysketch) that is the query-side feature too.
* Padding: the blocks count real keys, so a left-padded row computes what the row computes alone. A key padding
  mask must hold each row's real keys contiguously (left padding; right padding too when no state is carried):
  another mask is refused. A padded query's row is empty: its output is 0.

Chosen again by a prompt's question (``sparse_observe`` L, SnapKV's observation window, Li et al.,
arXiv:2404.14469). The streaming rule chooses before anything asks for a key: on SmolLM2-135M's linear-only retrofit
it keeps the passkeys of the last ~2k tokens only (recipes/results/SECTION_retrieval.md), while a cache of 128 keys
chosen by the prompt's last 16 queries finds 9 of 10 at 4k (SECTION_retrieval_question.md). So in every call of
more than one query (a prefill), each of its last L real queries is computed again (``SparseMixin._observe``) from
a cache chosen anew from the call's pool: the cache it started with and every non-sink key of the blocks completed
at that query (the keys the streaming selection saw, kept with the call's activations, O(n) like them). A
candidate's score is its softmax weight (the model's own q, k, over the candidates) under each observed query from
the first of the L up to this one, summed over them and the kv head's query heads, max-pooled over
``sparse_observe_pool`` neighbours (a key is several tokens: a 7-digit number is 7); ties, which the pooling makes,
break by the key's own score, then its place. The lambda first are exact; every other candidate is folded into the
state the call started with, decayed to the query's reference (the state the streaming rule would hold there had
it evicted those keys). Causal: a query's choice reads no later query. Why every one of the L and not the last
alone: each layer's observed rows then read the chosen keys before the next layer forms its queries from them, as
they would had every key been exact (a prompt prefilled with every key exact is where the 9 of 10 above came from).
The last query's choice is the state the call leaves; within a call and between calls (decoding) the streaming
rule runs as before, and the decoding state keeps its size. The outputs therefore depend on where calls end: a
prompt prefilled in two calls is chosen again twice, and one call over prompt and answer only at its end. Cost:
one pass over the call's candidates per layer for the scores and one for the fold (again only where the observed
queries straddle a block's edge), then per observed query its sort and its kept keys' terms
(recipes/experiments/retrieval/observe_cost.py times a prefill with and without); the candidates' keys are held
with the call's activations, O(n) like them.

Kept for a later question (``sparse_value_keys`` K, pooled over ``sparse_value_pool`` neighbours). Both rules above
choose by queries that exist when they choose: a document read in its own call (a chat server, a prefix cache) is
chosen again by its own last queries, and a question asked in a later turn finds only what those kept. So K of the
``sparse_cache`` slots go, in every selection (streaming, observed and decoding alike), to the candidates of largest
|v| max-pooled over their neighbours in candidate order (``value_rank``; an invalid candidate counts 0), whatever the
score; the rest of the budget is ranked as before. |v| needs no query and no state: in SmolLM2-135M's heads that
answer a passkey, the needle's tokens rank high by |v| and low by the attention later text gives them
(recipes/results/later_question/needle_ranks_*.json).

The forward (``SparseMixin._sparse_call``) and the generic recurrent state (``RecurrentState``'s ``sparse_*`` fields)
share ``select_and_fold``; the decoding ring (``ops/decode.py``) keeps the cache and the pending block in slots after
the sinks and calls the same function (``ring_leave``). Pure PyTorch: never imports transformers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .common import _safe_divide, _with_normaliser, normalised_sum, to_work
from .local import far_scale
from .sketches import symmetric_square
from .state import RecurrentState
from .window import OUTSIDE, Sinks, first_true, gather_keys, keep_sinks, slot_scores
from .window_flash import rows_flash

__all__ = ["ATTENTION_CARRY", "SparseMixin", "attention_score", "choose_kept", "fold_evicted", "pending_log",
           "recall_error", "ring_leave", "ring_query", "ring_select", "select_and_fold", "sparse_from_recurrent",
           "sparse_to_recurrent", "pooled_order", "pooled_rank", "value_norm", "value_rank", "value_reserved"]


def recall_error(kv: torch.Tensor, feats: torch.Tensor, vext: torch.Tensor, relative: bool = False) -> torch.Tensor:
    """|v - phi(k) S_v / (phi(k) . S_1)| (..., N) of N candidates with full features ``feats`` (..., N, F) and
    [v, 1] ``vext`` (..., N, d + 1) against the state ``kv`` (..., F, d + 1); 0 recall where the denominator is 0.
    ``relative`` (``sparse_score='relative'``): that error over |v| (a zero v over the dtype's smallest normal
    number: such a key is kept before any other)."""
    d = vext.shape[-1] - 1
    pred = torch.matmul(feats, kv)
    recall = _safe_divide(pred[..., :d], pred[..., d:])
    err = torch.linalg.vector_norm(vext[..., :d] - recall, dim=-1)
    if relative:
        err = err / torch.linalg.vector_norm(vext[..., :d], dim=-1).clamp_min(torch.finfo(err.dtype).tiny)
    return err


# sparse_score='attention': the weight a kept key's earlier score keeps at the next selection (an exponential average
# of the attention it drew over the blocks it stayed). Measured on SmolLM2-135M's linear-only retrofit (2,048 keys,
# the first 8,192 held-out tokens in one call, recipes/results/retrieval/diag/attention_score_8k.json): perplexity
# 28.10 / 28.02 / 27.86 / 28.14 / 28.52 with 0 / 0.5 / 0.9 / 0.97 / 1 (a plain sum: old keys hardly leave); softmax
# 27.64, the recall error 29.68
ATTENTION_CARRY = 0.9


def attention_score(q: torch.Tensor, q_valid: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, scale: float,
                    carried: torch.Tensor | None = None) -> torch.Tensor:
    """``sparse_score='attention'``: (B, Hkv, N) each of N candidates' softmax weight over the valid candidates
    (the model's own q, k) under each valid query, summed over the queries and the kv head's G query heads, plus
    ``ATTENTION_CARRY`` times ``carried`` (B, Hkv, M), the score each of the first M candidates (the cache's slots)
    had when it was last kept. q (B, Hkv, G, C, d) the ``sparse_chunk`` queries before the selection, ``q_valid``
    (B, C) the real ones; keys (B, Hkv, N, d), ``valid`` (B, Hkv, N). float32 at least (the sum of C G weights)."""
    work = torch.promote_types(q.dtype, torch.float32)
    x = torch.matmul(q.to(work) * scale, keys.to(work).transpose(-1, -2).unsqueeze(2))  # (B, Hkv, G, C, N)
    x = x.masked_fill(~valid[:, :, None, None, :], float("-inf"))
    weights = torch.nan_to_num(x.softmax(-1), nan=0.0)  # no valid candidate: no weight
    score = (weights * q_valid[:, None, None, :, None].to(work)).sum((2, 3))
    if carried is not None:
        score = torch.cat([score[..., : carried.shape[-1]] + ATTENTION_CARRY * carried.to(work),
                           score[..., carried.shape[-1] :]], dim=-1)
    return score


def select_and_fold(kv: torch.Tensor, feats: torch.Tensor, vext: torch.Tensor, valid: torch.Tensor, budget: int,
                    to_ref: torch.Tensor | None = None, decay: torch.Tensor | None = None, relative: bool = False,
                    score: torch.Tensor | None = None, value_keys: int = 0, value_pool: int = 1):
    """One selection step: (the state after it, keep (..., budget) the kept candidates' indices in increasing order,
    their validity (..., budget)).

    kv (..., F, e) the state; feats (..., N, F), vext (..., N, e), valid (..., N) the N >= budget candidates (the
    cache, then the block); ``to_ref`` (..., N) each candidate's log-decay to the state's new reference (the block's
    last key) and ``decay`` (...) the state's own, or None without decay; ``relative`` ranks by ``recall_error``'s
    relative error (``sparse_score``); ``score`` (..., N) ranks by it instead (``attention_score``);
    ``value_keys`` (``sparse_value_keys``) of the budget go first to the candidates of largest |v| pooled over
    ``value_pool`` neighbours (``sparse_value_pool``). The errors are
    read under no_grad (the choice is not differentiable); the fold is (gradients flow into the state through the
    evicted keys)."""
    with torch.no_grad():
        if score is None:
            score = recall_error(kv.detach(), feats.detach(), vext.detach(), relative)
        keep = choose_kept(score.detach(), valid, budget, value_norm(vext.detach()) if value_keys else None,
                           value_keys, value_pool)
    return fold_evicted(kv, feats, vext, valid, keep, to_ref, decay)


def value_norm(vext: torch.Tensor) -> torch.Tensor:
    """|v| (..., N) of candidates [v, 1] ``vext`` (..., N, d + 1), in float32 at least: what
    ``sparse_value_keys`` ranks by."""
    v = vext[..., :-1]
    return torch.linalg.vector_norm(v.to(torch.promote_types(v.dtype, torch.float32)), dim=-1)


def pooled_order(own: torch.Tensor, width: int) -> torch.Tensor:
    """Candidate indices (..., N), best first, of N scores ``own`` (..., N) max-pooled over ``width`` neighbours:
    by the pooled score, ties (the plateaus pooling makes) by the own score, then the earlier; stable sorts, so the
    choice does not depend on topk's order among ties (``pooled_rank``'s order)."""
    pooled = own
    if width > 1:
        pooled = torch.nn.functional.max_pool1d(own.reshape(-1, 1, own.shape[-1]), width, 1, width // 2)
        pooled = pooled.reshape(own.shape)
    order = own.sort(dim=-1, descending=True, stable=True).indices
    return order.gather(-1, pooled.gather(-1, order).sort(dim=-1, descending=True, stable=True).indices)


def pooled_rank(own: torch.Tensor, width: int) -> torch.Tensor:
    """Ranks (..., N), larger first, all distinct, of N scores ``own`` (..., N) in ``pooled_order``
    (``sparse_observe_pool``, ``sparse_value_pool``)."""
    order = pooled_order(own, width)
    ranks = torch.arange(own.shape[-1], 0, -1, device=own.device, dtype=own.dtype).expand_as(order)
    return torch.empty_like(own).scatter_(-1, order, ranks)


def _value_scores(norm: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    return torch.where(valid, torch.nan_to_num(norm, nan=0.0), 0.0)


def value_rank(norm: torch.Tensor, valid: torch.Tensor, width: int) -> torch.Tensor:
    """``sparse_value_keys``' ranking of N candidates (..., N): ``pooled_rank`` of their |v| ``norm`` over ``width``
    neighbours in candidate order (``sparse_value_pool``; invalid ones count 0). Why pooled: a heavy token brings
    its neighbours (a passkey's digits and the space token before them, which the answer's first query reads)."""
    return pooled_rank(_value_scores(norm, valid), width)


def value_reserved(norm: torch.Tensor, valid: torch.Tensor, count: int, width: int) -> torch.Tensor:
    """(..., N) bool: the ``count`` valid candidates first by ``value_rank`` (all of them when fewer are valid):
    ``sparse_value_keys``' reserve. The valid prefix of ``pooled_order`` by a running count, not a third sort of the
    ranks (a selection sorts 2,112 candidates per kv head, every 64 prefill tokens per layer)."""
    order = pooled_order(_value_scores(norm, valid), width)
    ok = valid.gather(-1, order)
    return torch.zeros_like(valid).scatter_(-1, order, ok & (ok.cumsum(dim=-1) <= count))


def choose_kept(err: torch.Tensor, valid: torch.Tensor, budget: int, norm: torch.Tensor | None = None,
                value_keys: int = 0, width: int = 1) -> torch.Tensor:
    """``select_and_fold``'s choice: (..., budget) indices of the ``budget`` valid candidates of largest ``err``
    (..., N) (NaN counts as 0; of equal errors the earlier), the valid ones first, each part in candidate order.
    ``value_keys`` > 0 (``sparse_value_keys``): the ``value_keys`` valid candidates first by ``value_rank`` of
    ``norm`` (..., N) (|v|, ``value_norm``) pooled over ``width`` are kept first (``value_reserved``), the rest of
    the budget by ``err``."""
    n = valid.shape[-1]
    # invalid candidates rank below every valid one (errors are >= 0); equal scores keep the earlier candidate (a
    # stable sort, as the reference's), so invalid ones go older first: sparse_score='relative' scores every
    # candidate 1 against an empty state, and topk's order among ties is the implementation's
    score = torch.where(valid, torch.nan_to_num(err, nan=0.0), -1.0)
    if value_keys:
        # ahead of every error; their order: candidate order
        score = torch.where(value_reserved(norm, valid, value_keys, width), torch.inf, score)
    keep = score.sort(dim=-1, descending=True, stable=True).indices[..., :budget]
    # the valid ones first, each part in candidate order: every kv head of a row then has its valid slots in the
    # same places (as many valid candidates, ranked first), which the decoding ring's per-row slot mask needs
    return keep.gather(-1, (keep + n * (~valid.gather(-1, keep))).argsort(dim=-1))


def fold_evicted(kv: torch.Tensor, feats: torch.Tensor, vext: torch.Tensor, valid: torch.Tensor, keep: torch.Tensor,
                 to_ref: torch.Tensor | None = None, decay: torch.Tensor | None = None):
    """``select_and_fold``'s second half once ``keep`` is chosen: every valid candidate not kept added to the state
    (decayed to the new reference), the state decayed by its own ``decay``; (state, keep, kept validity)."""
    kept = torch.zeros_like(valid).scatter_(-1, keep, True)
    weight = (valid & ~kept).to(vext.dtype)
    if to_ref is not None:
        weight = weight * torch.exp(torch.where(weight > 0, to_ref, 0.0))
    if feats.dim() == 4 and keep.shape[-1] * 2 > valid.shape[-1]:
        # only the N - budget candidates not kept can add anything (a prefill's block step: 64 of 576): their rows
        # alone in the product, a ninth of the full one's multiply-adds
        out = torch.sort(kept.to(torch.uint8), dim=-1, stable=True).indices[..., : valid.shape[-1] - keep.shape[-1]]
        feats, vext, weight = _take(feats, out), _take(vext, out), weight.gather(-1, out)
    add = torch.matmul((feats * weight.unsqueeze(-1)).transpose(-1, -2), vext)
    if decay is not None:
        kv = kv * torch.exp(decay)[..., None, None]
    return kv + add, keep, valid.gather(-1, keep)


def _last_queries(q: torch.Tensor, real: torch.Tensor, count: torch.Tensor, chunk: int):
    """(queries (B, Hkv, G, C, d), real (B, C)): aligned rows count - C .. count - 1 of q (B, Hkv, G, L, d) and
    ``real`` (B, L), zero and False before row 0 (what ``sparse_score='attention'`` scores the next selection with)."""
    b, hkv, g, _, d = q.shape
    at = count[:, None] - chunk + torch.arange(chunk, device=q.device)  # (B, C)
    here = at >= 0
    at = at.clamp(min=0)
    here = here & real.gather(1, at)
    out = q.gather(3, at[:, None, None, :, None].expand(b, hkv, g, chunk, d))
    return out * here[:, None, None, :, None].to(q.dtype), here


def _take(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Rows ``idx`` (B, Hkv, K) of x (B, Hkv, N, f) along N."""
    b, h, n, f = x.shape
    if not x.is_contiguous() or idx.shape[:2] != (b, h):
        return x.gather(2, idx.unsqueeze(-1).expand(*idx.shape, f))
    # whole rows through index_select: ~10x the CPU's element-wise gather (512 rows of 64 of 3 x 4,608: 76 against
    # 750 us, one thread), which took a fifth of a 4k prefill's sparse-cache layer
    flat = idx + (torch.arange(b * h, device=idx.device) * n).view(b, h, 1)
    return x.reshape(b * h * n, f).index_select(0, flat.reshape(-1)).view(b, h, idx.shape[2], f)


def _fold_all_but(folded: torch.Tensor, weight: torch.Tensor, feats: torch.Tensor, vext: torch.Tensor,
                  idx: torch.Tensor) -> torch.Tensor:
    """``folded`` (every candidate of the pool in the state, weighted by ``weight`` (B, Hkv, P)) without the slots
    ``idx`` (B, Hkv, K): their terms taken back out (0 weight where a slot holds no candidate)."""
    w_idx = weight.gather(-1, idx)
    return folded - torch.matmul((_take(feats, idx) * w_idx.unsqueeze(-1)).transpose(-1, -2), _take(vext, idx))


def real_span(mask: torch.Tensor | None, batch: int, n: int, device, carried: bool):
    """(P, L), both (B,) int64: each row's leading padded keys and real keys; a mask whose real keys are not
    contiguous (or, when a state is carried, any padding after a real key) is refused."""
    if mask is None:
        return torch.zeros(batch, dtype=torch.long, device=device), torch.full((batch,), n, device=device)
    real = mask.expand(batch, n)
    count = real.sum(-1)
    first = torch.where(count > 0, real.long().argmax(-1), n)
    pos = torch.arange(n, device=device)
    span = (pos >= first[:, None]) & (pos < (first + count)[:, None])
    if bool((span != real).any()):
        row = int((span != real).any(-1).nonzero()[0, 0])
        raise ValueError(f"sparse_cache counts each row's real keys in blocks: key_padding_mask row {row} has padded "
                         "keys between real ones; pad on the left (or on the right of a call without a recurrent "
                         "state)")
    if carried and bool(((first + count < n) & (count > 0)).any()):
        raise ValueError("sparse_cache with a recurrent state needs left padding: a padded key after a row's real "
                         "keys would sit between them and the next call's")
    return torch.where(count > 0, first, 0), count


@dataclass
class _Aligned:
    """A call's tensors with each row shifted left by its leading padding (``real_span``): real key m of every row at
    position m, so the blocks and the window's epochs fall at the same positions in every row."""

    idx: torch.Tensor | None  # (B, n) the gather index, None when no row is shifted
    lead: torch.Tensor  # (B,) P

    def keys(self, x: torch.Tensor | None, dim: int = 3) -> torch.Tensor | None:
        return x if x is None or self.idx is None else gather_keys(x, self.idx, dim)

    def mask(self, m: torch.Tensor) -> torch.Tensor:
        return m if self.idx is None else m.expand(self.idx.shape[0], -1).gather(1, self.idx)

    def unshift(self, out: torch.Tensor) -> torch.Tensor:
        """Aligned rows (B, Hkv, G, n, e) back to their positions (zero at the leading padded ones)."""
        if self.idx is None:
            return out
        n = out.shape[3]
        pos = torch.arange(n, device=out.device)
        back = (pos[None, :] - self.lead[:, None]).clamp(min=0)
        return gather_keys(out, back, 3) * (pos[None, :] >= self.lead[:, None])[:, None, None, :, None].to(out.dtype)


@dataclass
class SparseRows:
    """One epoch's rows before their normalisation (``SparseMixin._sparse_parts``): the exact weights over the
    row's keys, cache slots and sinks (B, Hkv, G, rows, n_loc + lambda + sinks) in that order (the cache from
    ``n_loc``, the sinks after it), their weighted [v, 1] ``loc``, the kernel part ``far`` (B, Hkv, G, rows, e)
    and its factor ``scale_far`` (None: 1). The output is ``normalised_sum(far, loc, scale_far, offset)``."""

    weights: torch.Tensor
    loc: torch.Tensor
    far: torch.Tensor
    scale_far: torch.Tensor | None
    n_loc: int


class SparseMixin:
    """Methods of ``PolyAttention`` for ``sparse_cache`` (module docstring)."""

    # a diagnostic, not a setting (never saved): how many of the re-chosen keys ``sparse_observe``'s rows read, the
    # state the call leaves keeping its first ``sparse_cache`` of the same ranking; None: ``sparse_cache``. With
    # every candidate read, an observed row of a single call is exact softmax attention over the whole prompt (the
    # sinks scored where sink_position puts them)
    # (recipes/experiments/retrieval/probe_observe_wide.py: whether the choice or the streamed rows lose a needle)
    observe_keys: int | None = None
    # a diagnostic, not a setting (never saved): False keeps a float32 CPU call without gradients on the rows as
    # tensors instead of the fused kernel (recipes/experiments/retrieval/fused_rows_cost.py times the two)
    fused_rows: bool = True
    # a runtime input, not a setting (never saved): (B, Hkv, Lk) a score for each key of the next call (a fresh
    # state's only: nothing carried), ranking every selection of that call instead of ``sparse_score`` (the |v|
    # reserve of sparse_value_keys still first), with no re-choice by ``sparse_observe`` at its end. A fixed score
    # per key makes the streaming choice the call's top ``sparse_cache`` keys (hf_polyattn.read_document sets the
    # copy scores there: what a later question needs, chosen before it is asked)
    selection_scores: torch.Tensor | None = None

    def _full_features(self, side: torch.Tensor) -> torch.Tensor:
        return symmetric_square(side) if self.feature_map.squares else side

    def _sparse_call(self, q5, k5, v5, pad_mask, scale, state, raw, sink_q, key, value):
        """(output (B, Hkv, G, Lq, d), the state after the call or None) of a causal call with the sparse cache.

        q5 (B, Hkv, G, Lq, d'), k5 (B, Hkv, 1, Lk, d'): the kernel inputs (the state's raw keys, then the call's);
        v5 their values; ``pad_mask`` (B, Lk) or None their padding; ``raw`` the model's own q, k (the exact parts
        score them); ``sink_q`` the queries that score the sinks (``Sinks.q``) or None; ``key``/``value`` the call's
        own (the state keeps them raw)."""
        cfg = self.config
        w, chunk, budget = cfg.window, cfg.sparse_chunk, cfg.sparse_cache
        if self.observe_keys is not None and self.observe_keys < budget:
            raise ValueError(f"observe_keys={self.observe_keys} (a diagnostic: the re-chosen keys sparse_observe's "
                             f"rows read) must be None or >= sparse_cache={budget}: its rows would read fewer keys "
                             "than the state they leave keeps")
        b, hkv, g, lq = q5.shape[:4]
        lk = k5.shape[3]
        device = q5.device
        q5, k5, v5 = to_work(q5, k5, v5)
        q_raw, k_raw = to_work(*raw)
        work = q5.dtype
        # the keys of complete blocks the state keeps raw (for the convolution) read as padding from here on
        mask = pad_mask
        if state is not None and state.sparse_skip is not None:
            real = torch.ones(b, lk, dtype=torch.bool, device=device) if mask is None else mask.expand(b, lk)
            mask = real & (real.long().cumsum(-1) > state.sparse_skip[:, None])
        sinks = self._window_sinks(k_raw, v5, mask, None if state is None else state.sinks, sink_q=sink_q)
        lead, count = real_span(mask, b, lk, device, state is not None)
        fq, q_log_scale = self._side_features(q5, scale, True)
        fk, _ = self._side_features(k5, scale, False)
        logs = self.log_decays(v5, mask)  # G from the state's reference; the sinks decay like every real key
        rest = sinks.rest(mask) if sinks is not None else mask
        vext = _with_normaliser(v5, rest)
        valid = torch.ones(b, lk, dtype=torch.bool, device=device) if rest is None else rest.expand(b, lk)

        pad = lk - lq  # queries bottom-right aligned: pad them to the keys' rows
        def rows(x):
            return None if x is None else torch.nn.functional.pad(x, (0, 0, pad, 0)) if pad else x

        shifted = bool((lead > 0).any())
        al = _Aligned(None, lead)
        if shifted:
            pos = torch.arange(lk, device=device)
            al = _Aligned((pos[None, :] + lead[:, None]).clamp(max=lk - 1), lead)
        qa, fqa, qls = al.keys(rows(q_raw)), al.keys(rows(fq)), al.keys(rows(q_log_scale))
        ka, fka, kina, vexta = al.keys(k_raw), al.keys(fk), al.keys(k5), al.keys(vext)
        ga = None if logs is None else al.keys(logs.unsqueeze(-1)).squeeze(-1)  # (B, Hkv, 1, Lk)
        pos = torch.arange(lk, device=device)
        valid_a = al.mask(valid) & (pos[None, :] < (lk - lead)[:, None])
        sinks_a = None
        if sinks is not None:
            spos = sinks.pos.expand(b, -1)
            spos = torch.where(spos.abs() < OUTSIDE, spos - lead[:, None], spos)
            sinks_a = Sinks(sinks.k, sinks.v, spos, q=al.keys(rows(sinks.q)), learned=sinks.learned)

        # the pool every cached key comes from: the state's cache (``budget`` slots), then the call's keys
        c_k, c_v, c_valid, c_kin, c_logs = self._carried_cache(state, b, work, device)
        c_side = self._side_features(c_kin.unsqueeze(2), scale, False)[0].squeeze(2)  # maps take (B, Hkv, 1, L, .)
        pool_raw = torch.cat([c_k, ka.squeeze(2)], dim=2)
        pool_side = torch.cat([c_side, fka.squeeze(2)], dim=2)
        pool_vext = torch.cat([_with_normaliser(c_v, None) * c_valid[..., None].to(work), vexta.squeeze(2)], dim=2)
        pool_kin = torch.cat([c_kin, kina.squeeze(2)], dim=2)
        pool_g = None if ga is None else torch.cat([-c_logs, ga.squeeze(2)], dim=2)
        cache_idx = torch.arange(budget, device=device).expand(b, hkv, budget)
        cache_valid = c_valid
        pool_given = self._given_scores(state, b, hkv, lk, al, work, device)
        e_dim = vext.shape[-1]
        nf = self.feature_map.num_features
        kv = state.kv.squeeze(2).to(work) if state is not None and state.kv is not None else \
            torch.zeros(b, hkv, nf, e_dim, dtype=work, device=device)
        kv_in = kv  # the carried state, referenced at the call's G = 0 (sparse_observe folds from it again)
        g_ref = torch.zeros(b, hkv, dtype=work, device=device)
        last = count - 1  # each row's last real query (aligned)
        first_q = (pad - lead).clamp(min=0)  # each row's first aligned query of the call
        attn = cfg.sparse_score == "attention"
        q_hist = q_real = acc = None
        if attn:  # the queries that score each selection (the state's last ones before the call's) and the scores
            q_hist, q_real, acc = self._query_history(state, qa, first_q, last, b, work, device)
        first_out = lk - lq - int(lead.max())  # the first aligned row any caller reads
        outs, starts = [], []
        epoch = 0
        while True:
            a = 0 if epoch == 0 else epoch * chunk + w - 1
            if a >= lk:
                break
            end = min(lk, (epoch + 1) * chunk + w - 1)
            if epoch:  # block epoch - 1 has wholly left the window of the epoch's queries: select
                lo = budget + (epoch - 1) * chunk
                cand = torch.cat([cache_idx, torch.arange(lo, lo + chunk, device=device).expand(b, hkv, chunk)], -1)
                cand_valid = torch.cat([cache_valid, valid_a[:, None, (epoch - 1) * chunk : epoch * chunk]
                                        .expand(b, hkv, chunk)], dim=-1)
                to_ref = decay = None
                if pool_g is not None:
                    new_ref = pool_g[..., budget + epoch * chunk - 1]
                    to_ref, decay = new_ref[..., None] - pool_g.gather(2, cand), new_ref - g_ref
                score = None
                if pool_given is not None:
                    score = pool_given.gather(2, cand)
                elif attn:  # the chunk queries before the epoch's first (aligned rows a - C .. a - 1)
                    score = attention_score(q_hist[:, :, :, a - chunk : a], q_real[:, a - chunk : a],
                                            _take(pool_raw, cand), cand_valid, scale, acc)
                new_kv, keep, keep_valid = select_and_fold(
                    kv, self._full_features(_take(pool_side, cand)), _take(pool_vext, cand), cand_valid, budget,
                    to_ref, decay, cfg.sparse_score == "relative", score, cfg.sparse_value_keys,
                    cfg.sparse_value_pool)
                active = (epoch * chunk + w - 1 <= last)[:, None]  # rows whose queries reach this epoch
                if attn:
                    acc = torch.where(active[..., None], score.gather(-1, keep), acc)
                kv = torch.where(active[..., None, None], new_kv, kv)
                cache_idx = torch.where(active[..., None], cand.gather(2, keep), cache_idx)
                cache_valid = torch.where(active[..., None], keep_valid, cache_valid)
                if pool_g is not None:
                    g_ref = torch.where(active, new_ref, g_ref)
            if end > first_out:
                ks = 0 if epoch == 0 else epoch * chunk
                outs.append(self._sparse_rows(qa, fqa, qls, ka, vexta, valid_a, ga, sinks_a, a, end, ks, scale,
                                              _take(pool_raw, cache_idx), _take(pool_vext, cache_idx), cache_valid,
                                              kv, g_ref))
                starts.append(a)
            epoch += 1
        out = torch.cat(outs, dim=3)
        if starts[0]:
            out = torch.nn.functional.pad(out, (0, 0, starts[0], 0))
        if cfg.sparse_observe and lq > 1 and pool_given is None:
            pool_valid = torch.cat([c_valid, valid_a[:, None, :].expand(b, hkv, lk)], dim=-1)
            o_kv, o_idx, o_valid, o_score = self._observe(
                out, (qa, fqa, qls, ka, vexta, valid_a, ga, sinks_a), pool_raw, pool_side, pool_vext, pool_valid,
                pool_g, kv_in, count, first_q, scale)
            asked = count - 1 >= first_q  # rows with a real query in the call (the others keep the streaming state)
            kv = torch.where(asked[:, None, None, None], o_kv, kv)
            cache_idx = torch.where(asked[:, None, None], o_idx, cache_idx)
            cache_valid = torch.where(asked[:, None, None], o_valid, cache_valid)
            if attn:  # the kept keys' scores: their weights under the observed queries
                acc = torch.where(asked[:, None, None], o_score, acc)
        out = al.unshift(out)[..., pad:, :]
        if pad_mask is not None:  # a padded query's row is empty (ops/reference.py's definition): 0
            out = out * pad_mask[:, None, None, lk - lq :, None].to(out.dtype)
        if state is None:
            return out, None
        history = None if not attn else _last_queries(q_hist, q_real, count, chunk) + (acc,)
        return out, self._sparse_state(state, key, value, pad_mask, mask, lead, count, sinks, kv, g_ref, cache_idx,
                                       cache_valid, pool_raw, pool_vext, pool_kin, pool_g, history)

    def _observe(self, out, rows, pool_raw, pool_side, pool_vext, pool_valid, pool_g, kv_in, count, first, scale):
        """``sparse_observe`` at the end of a call: the last L real queries' rows of ``out`` (aligned, in place)
        computed again, each from its own re-chosen cache and state; (state, cache indices into the pool, their
        validity, their scores under the observed queries, which ``sparse_score='attention'`` carries) of the last
        one, the state after the call.

        ``rows`` the aligned tensors ``_sparse_rows`` reads; ``pool_valid`` (B, Hkv, P) the pool's candidates (the
        carried cache's slots, then every real non-sink key of the call); ``kv_in`` the carried state (referenced
        at the call's G = 0); ``count`` (B,) each row's real keys, ``first`` (B,) its first aligned query.
        Observation row r (the L rows count - L .. count - 1 that are queries of the call) chooses among the carried
        cache and the keys of the blocks complete at r (those its streaming row saw as candidates): each candidate's
        softmax weight over them (the model's own q, k) under every observation query from the first up to r,
        summed with the kv head's query heads, max-pooled over ``sparse_observe_pool`` neighbours, ranked by
        (pooled, own, pool order); the ``sparse_cache`` first are exact, every other candidate is folded into
        ``kv_in`` decayed to r's reference (its last complete block's last key): the state the streaming rule
        holds there, had it evicted those. Causal: row r reads nothing from the queries after it."""
        cfg = self.config
        w, chunk, budget, n_obs, width = (cfg.window, cfg.sparse_chunk, cfg.sparse_cache, cfg.sparse_observe,
                                          cfg.sparse_observe_pool)
        qa = rows[0]
        b, hkv, g, lk, d = qa.shape
        device = qa.device
        n_pool = pool_raw.shape[2]
        obs = (count - n_obs)[:, None] + torch.arange(n_obs, device=device)  # (B, L) aligned rows, ascending
        seen = (obs >= first[:, None]) & (obs >= 0)
        feats = self._full_features(pool_side)
        pos = torch.arange(lk, device=device)
        norms = value_norm(pool_vext.detach()) if cfg.sparse_value_keys else None
        with torch.no_grad():  # the choice is not differentiable (as the streaming selection's)
            q = qa.detach().gather(3, obs.clamp(min=0)[:, None, None, :, None].expand(b, hkv, g, n_obs, d))
            x = torch.matmul(q * scale, pool_raw.detach()[:, :, None].transpose(-1, -2)).float()  # (B, Hkv, G, L, P)
        result = None
        # the candidates' softmax weights and every candidate folded, once per distinct set of complete blocks (the
        # L rows share one but at a block's edge): a row's scores are the running sum of the queries' weights, its
        # state that fold minus its kept keys' terms (sparse_cache keys instead of the whole call's); one pass per
        # row over every candidate cost several times more (observe_cost.py times the re-choice)
        folded_all: dict[tuple, torch.Tensor] = {}
        scored: dict[tuple, torch.Tensor] = {}
        for j in range(n_obs):
            at = obs[:, j]  # (B,)
            blocks = (at + 1 - w).clamp(min=0) // chunk  # the blocks complete at row `at`
            in_block = torch.cat([torch.ones(b, budget, dtype=torch.bool, device=device),
                                  pos[None, :] < (blocks * chunk)[:, None]], dim=-1)
            cand = pool_valid & in_block[:, None, :]
            key = tuple(blocks.tolist())
            with torch.no_grad():
                if key not in scored:  # every observed query's weights over these candidates, summed up to each
                    xs = x.masked_fill(~cand[:, :, None, None, :], float("-inf"))
                    weights = torch.nan_to_num(xs.softmax(-1), nan=0.0)  # a row with no candidate gives none
                    weights = weights * seen[:, None, None, :, None]
                    scored[key] = weights.sum(2).cumsum(2)  # (B, Hkv, L, P)
                own = scored[key][:, :, j]  # (B, Hkv, P): the observed queries up to this one
                ranked = pooled_rank(own, width)  # by (pooled, own, pool order)
                keep = choose_kept(ranked, cand, budget, norms, cfg.sparse_value_keys, cfg.sparse_value_pool)
                read = keep if self.observe_keys is None else choose_kept(
                    ranked, cand, min(self.observe_keys, n_pool), norms, cfg.sparse_value_keys,
                    cfg.sparse_value_pool)
            g_ref = to_ref = None
            if pool_g is not None:
                ref = (budget + blocks * chunk - 1).clamp(min=budget)  # blocks == 0: no reference moved (G = 0)
                g_ref = torch.where((blocks > 0)[:, None], pool_g.gather(2, ref[:, None, None].expand(b, hkv, 1))
                                    .squeeze(2), 0.0)
                to_ref = g_ref[..., None] - pool_g
            weight = cand.to(pool_vext.dtype)
            if to_ref is not None:
                weight = weight * torch.exp(torch.where(cand, to_ref, 0.0))
            if key not in folded_all:
                base = kv_in if g_ref is None else kv_in * torch.exp(g_ref)[..., None, None]
                folded_all[key] = base + torch.matmul((feats * weight.unsqueeze(-1)).transpose(-1, -2), pool_vext)
            kv = _fold_all_but(folded_all[key], weight, feats, pool_vext, keep)
            result = kv, keep, cand.gather(-1, keep), own.gather(-1, keep)
            if read is not keep:
                kv = _fold_all_but(folded_all[key], weight, feats, pool_vext, read)
            keep_valid = cand.gather(-1, read)
            ck, cvx = _take(pool_raw, read), _take(pool_vext, read)
            g_rows = torch.zeros(b, hkv, dtype=kv.dtype, device=device) if g_ref is None else g_ref
            for r in sorted(set(at[seen[:, j]].tolist())):
                new = self._sparse_rows(*rows, r, r + 1, (r + 1 - w) // chunk * chunk if r + 1 >= w else 0, scale,
                                        ck, cvx, keep_valid, kv, g_rows)
                take = ((at == r) & seen[:, j])[:, None, None, None, None]
                out[..., r : r + 1, :] = torch.where(take, new.to(out.dtype), out[..., r : r + 1, :])
        return result

    def _given_scores(self, state, b, hkv, lk, al, work, device):
        """``selection_scores`` aligned as the pool (B, Hkv, budget + Lk): 0 for the (empty) carried slots, then
        each key's given score; None when none is given. Refused where the state carries keys or a cache (the
        scores name the call's keys only) or where their shape is not the call's."""
        given = self.selection_scores
        if given is None:
            return None
        if state is not None and (state.k is not None or (state.sparse_mask is not None
                                                          and bool(state.sparse_mask.any()))):
            raise ValueError("selection_scores rank the keys of a call on a fresh state: this state already holds "
                             "keys (read the document first, before any other call on the cache)")
        if tuple(given.shape) != (b, hkv, lk):
            raise ValueError(f"selection_scores must be (batch, kv heads, keys) = {(b, hkv, lk)}, got "
                             f"{tuple(given.shape)}")
        given = torch.nan_to_num(given.to(device=device, dtype=work), nan=0.0)
        return torch.cat([torch.zeros(b, hkv, self.config.sparse_cache, dtype=work, device=device),
                          al.keys(given, dim=2)], dim=2)

    def _query_history(self, state, qa, first_q, last, b, work, device):
        """(queries (B, Hkv, G, Lk, d), which are real (B, Lk), the cache's scores (B, Hkv, sparse_cache)) for
        ``sparse_score='attention'``: the call's aligned queries (rows first_q .. last), with the state's last
        ``sparse_chunk`` queries in the rows just before first_q (those that fall at row 0 or later)."""
        chunk, budget = self.config.sparse_chunk, self.config.sparse_cache
        hkv, g, lk, d = qa.shape[1], qa.shape[2], qa.shape[3], qa.shape[4]
        rows = torch.arange(lk, device=device)
        real = (rows[None, :] >= first_q[:, None]) & (rows[None, :] <= last[:, None])
        q = qa.detach()
        if state is None or state.sparse_q is None:
            return q, real, torch.zeros(b, hkv, budget, dtype=work, device=device)
        at = rows[None, :] - (first_q[:, None] - chunk)  # (B, Lk): the carried query each row holds, if in 0 .. C - 1
        held = (at >= 0) & (rows[None, :] < first_q[:, None])
        at = at.clamp(0, chunk - 1)
        carried = state.sparse_q.to(work).gather(3, at[:, None, None, :, None].expand(b, hkv, g, lk, d))
        q = torch.where(held[:, None, None, :, None], carried, q)
        real = torch.where(held, state.sparse_q_mask.gather(1, at), real)
        return q, real, state.sparse_score.to(work)

    def _carried_cache(self, state, b, work, device):
        """The state's sparse cache as (keys, values, valid, kernel inputs, log-decays), empty when it has none."""
        budget, d = self.config.sparse_cache, self.head_dim
        hkv, kdim = self.num_kv_heads, self.kernel_dim
        if state is None or state.sparse_k is None:
            k = torch.zeros(b, hkv, budget, d, dtype=work, device=device)
            kin = k if kdim == d else torch.zeros(b, hkv, budget, kdim, dtype=work, device=device)
            return (k, k, torch.zeros(b, hkv, budget, dtype=torch.bool, device=device), kin,
                    torch.zeros(b, hkv, budget, dtype=work, device=device))
        k, v = state.sparse_k.to(work), state.sparse_v.to(work)
        kin = k if state.sparse_kin is None else state.sparse_kin.to(work)
        logs = state.sparse_logs.to(work) if state.sparse_logs is not None else torch.zeros(
            b, hkv, budget, dtype=work, device=device)
        return k, v, state.sparse_mask, kin, logs

    def _sparse_rows(self, qa, fqa, qls, ka, vexta, valid_a, ga, sinks, a, end, ks, scale, ck, cv, c_valid, kv,
                     g_ref):
        """Outputs (B, Hkv, G, end - a, d) of the aligned queries a .. end - 1 of one epoch: exactly on the keys ks ..
        their own (the pending block and the window), the sinks and the sparse cache (ck, cv (B, Hkv, lambda, .)),
        through the features on the state kv (B, Hkv, F, e) referenced at G = g_ref (B, Hkv)."""
        if self.fused_rows and self._fused_exact(qa):
            # inference on the CPU: the exact part through the fused kernel (window_flash.rows_flash)
            loc, log_far = rows_flash(qa[..., a:end, :], torch.cat([ka[:, :, 0, ks:end], ck], dim=2),
                                      torch.cat([vexta[:, :, 0, ks:end, :-1], cv[..., :-1]], dim=2),
                                      self._sparse_allowed(valid_a, a, end, ks, c_valid), scale,
                                      torch.arange(a, end, device=qa.device), sinks,
                                      None if sinks is None or sinks.q is None else sinks.q[..., a:end, :])
            far, scale_far = self._sparse_far(fqa, qls, ga, a, end, kv, g_ref, log_far)
            return normalised_sum(far, loc, scale_far, self.config.denominator_offset, far.dtype)
        parts = self._sparse_parts(qa, fqa, qls, ka, vexta, valid_a, ga, sinks, a, end, ks, scale, ck, cv, c_valid,
                                   kv, g_ref)
        return normalised_sum(parts.far, parts.loc, parts.scale_far, self.config.denominator_offset, parts.far.dtype)

    @staticmethod
    def _sparse_allowed(valid_a, a, end, ks, c_valid):
        """(B, Hkv, end - a, n_loc + lambda) bool: the keys ks .. end - 1 each aligned query a .. end - 1 reads
        (causal, real), then the cache's valid slots."""
        qpos = torch.arange(a, end, device=c_valid.device)
        kpos = torch.arange(ks, end, device=c_valid.device)
        b, hkv, lam = c_valid.shape
        own = ((kpos[None, :] <= qpos[:, None]) & valid_a[:, None, None, ks:end]).expand(b, hkv, end - a, end - ks)
        return torch.cat([own, c_valid[:, :, None, :].expand(b, hkv, end - a, lam)], dim=-1)

    def _sparse_far(self, fqa, qls, ga, a, end, kv, g_ref, log_far):
        """(far (B, Hkv, G, rows, e), its factor or None) of the aligned queries a .. end - 1: the kernel part on the
        state kv referenced at G = g_ref, on the exact part's scale exp(log_far), FAVOR+'s and window_mix's."""
        far = torch.matmul(self._full_features(fqa[..., a:end, :]), kv.unsqueeze(2))
        if ga is not None:
            far = far * torch.exp(ga[..., a:end] - g_ref[..., None, None]).unsqueeze(-1)
        scale_far = far_scale(log_far, None if qls is None else qls[..., a:end, :])
        if self.config.window_mix:
            mix = self.window_mix.abs().to(far.dtype)
            scale_far = mix if scale_far is None else scale_far * mix
        return far, scale_far

    def _sparse_parts(self, qa, fqa, qls, ka, vexta, valid_a, ga, sinks, a, end, ks, scale, ck, cv, c_valid, kv,
                      g_ref) -> SparseRows:
        """``_sparse_rows``' terms before their normalisation (``SparseRows``); its arguments."""
        cfg = self.config
        q = qa[..., a:end, :] * scale
        b, hkv, g, r, d = q.shape
        qpos = torch.arange(a, end, device=q.device)
        n_loc, n_main = end - ks, end - ks + ck.shape[2]
        # the row's own keys and the cache in one product per kv head, its G query heads' rows stacked (G r rows):
        # a product broadcast over G copied the cache G times, and two products' scores were concatenated. With
        # _take's index_select and fold_evicted's evicted rows, a 4k prefill's sparse-cache layer (SmolLM2's 9 / 3
        # heads, 512 keys, random inputs) went from 1.15 to 0.84 s on one thread, 0.69 to 0.63 s on two (2-core CPU)
        keys = torch.cat([ka[:, :, 0, ks:end], ck], dim=2)
        vals = torch.cat([vexta[:, :, 0, ks:end], cv], dim=2)
        x = torch.matmul(q.reshape(b, hkv, g * r, d), keys.transpose(-1, -2)).view(b, hkv, g, r, n_main)
        allowed = [self._sparse_allowed(valid_a, a, end, ks, c_valid).unsqueeze(2)]  # (B, Hkv, 1, r, n_main)
        if sinks is not None:
            x = torch.cat([x, slot_scores(q, sinks.k, None if sinks.q is None else sinks.q[..., a:end, :] * scale,
                                          sinks.learned)], dim=-1)
            allowed.append(sinks.visible(qpos).expand(b, hkv, 1, r, sinks.k.shape[-2]))
        weights, log_far = self.exact_weights(x, torch.cat(allowed, dim=-1), cfg.resolved_local_kernel)
        main = weights[..., :n_main]  # rows of stride n_main + E: (G r) rows view without a copy
        loc = torch.matmul(main.reshape(b, hkv, g * r, n_main), vals).view(b, hkv, g, r, vals.shape[-1])
        if sinks is not None:
            loc = loc + torch.matmul(weights[..., n_main:], sinks.v)
        far, scale_far = self._sparse_far(fqa, qls, ga, a, end, kv, g_ref, log_far)
        return SparseRows(weights, loc, far, scale_far, n_loc)

    def _sparse_state(self, state, key, value, pad_mask, mask, lead, count, sinks, kv, g_ref, cache_idx, cache_valid,
                      pool_raw, pool_vext, pool_kin, pool_g, history=None) -> RecurrentState:
        """The state after a call: the last window + chunk - 1 keys raw (every key after each row's last complete
        block among them, ``sparse_skip`` counting the others), the sinks of the complete blocks in their slots, the
        cache. ``pad_mask`` / ``mask``: the call's padding, and the keys the sparse path read; ``history``
        (``sparse_score='attention'``): the last queries, which are real, and the cache's scores."""
        cfg = self.config
        w, chunk = cfg.window, cfg.sparse_chunk
        raw_k = key if state.k is None else torch.cat([state.k.to(key.dtype), key], dim=2)
        raw_v = value if state.v is None else torch.cat([state.v.to(value.dtype), value], dim=2)
        lk = raw_k.shape[2]
        blocks = (count - w).clamp(min=0) // chunk  # complete blocks of each row after the call
        keep_from = lead + blocks * chunk  # the first key each row keeps raw
        pos = torch.arange(lk, device=raw_k.device)
        kept = pos[None, :] >= keep_from[:, None]
        if mask is not None:
            kept = kept & mask
        sink_parts = state.sink_k, state.sink_v, state.sink_mask
        if sinks is not None and sinks.flags is not None:  # the sinks of the complete blocks go to their slots
            leaving = sinks.flags & ~kept
            if bool(leaving.any()):
                sink_parts = keep_sinks(*sink_parts, raw_k, raw_v, leaving, cfg.sinks)
        size = min(lk, w + chunk - 1)
        b = raw_k.shape[0]
        real = (torch.ones(b, lk, dtype=torch.bool, device=raw_k.device) if pad_mask is None
                else pad_mask.expand(b, lk))[:, lk - size :]
        skip = (real & (pos[None, lk - size :] < keep_from[:, None])).sum(-1)
        d = self.head_dim
        ck = _take(pool_raw, cache_idx)
        cvx = _take(pool_vext, cache_idx)
        kin = _take(pool_kin, cache_idx) if (self._maps_inputs or cfg.short_conv) else None
        logs = None if pool_g is None else g_ref[..., None] - pool_g.gather(2, cache_idx)
        return RecurrentState(kv.unsqueeze(2), raw_k[:, :, lk - size :], raw_v[:, :, lk - size :],
                              None if bool(real.all()) else real, state.length + key.shape[2], *sink_parts,
                              sparse_k=ck.to(key.dtype), sparse_v=cvx[..., :d].to(value.dtype),
                              sparse_mask=cache_valid, sparse_kin=kin, sparse_logs=logs, sparse_skip=skip,
                              **({} if history is None else dict(sparse_q=history[0].to(key.dtype),
                                                                 sparse_q_mask=history[1], sparse_score=history[2])))


# The decoding ring (``ops/decode.py``): ``extra`` = cache + chunk slots after the sinks, the cache's then the waiting
# block's, in the ring's ``keys`` / ``vext`` / ``valid`` (read exactly with the window's), ``kin`` their kernel inputs,
# ``slot_log`` (decay) the cache keys' log-decay to ``kv``'s reference and the waiting keys' own log-gates, ``pending``
# (B,) the waiting keys per row (a sink among them holds its place and gate, not a candidate: ``valid`` False).


def pending_log(ring) -> torch.Tensor:
    """(B, Hkv): the log-gates of the keys waiting for selection, between ``kv``'s reference and the window."""
    return ring.slot_log[..., ring.cache :].sum(-1)


def ring_leave(module, ring, slot: int, is_sink: torch.Tensor | None, scale: float) -> None:
    """The key in ring slot ``slot`` leaves the window: it waits in the block (a sink too, for its gate, but not as a
    candidate) and, in the rows whose block is now complete, the cache is chosen (``select_and_fold``)."""
    lam, s = ring.cache, ring.sinks
    chunk = ring.extra - lam
    real = ring.valid[:, slot]  # (B,): padded keys leave without a trace
    at = (torch.arange(chunk, device=real.device) == ring.pending[:, None]) & real[:, None]  # (B, C)
    wait = slice(s + lam, s + ring.extra)
    pick = at[:, None, :, None]
    ring.keys[:, :, wait] = torch.where(pick, ring.keys[:, :, slot : slot + 1], ring.keys[:, :, wait])
    ring.vext[:, :, wait] = torch.where(pick, ring.vext[:, :, slot : slot + 1], ring.vext[:, :, wait])
    ring.valid[:, wait] |= at if is_sink is None else at & ~is_sink[:, None]
    if is_sink is not None and bool(is_sink.any()):
        ring.sink_waiting = True
    kin = module.kernel_input(ring.keys[:, :, slot : slot + 1].unsqueeze(2), False).squeeze(2)  # (B, Hkv, 1, d')
    ring.kin[:, :, lam:] = torch.where(pick, kin.to(ring.kin.dtype), ring.kin[:, :, lam:])
    if ring.slot_log is not None:
        gate = ring.logg[:, :, ring.head : ring.head + 1]  # the leaving key's log-gate (B, Hkv, 1)
        ring.slot_log[:, :, lam:] = torch.where(at[:, None, :], gate, ring.slot_log[:, :, lam:])
    ring.pending += real.long()
    done = ring.pending == chunk
    if bool(done.any()):
        ring_select(module, ring, done, scale)


def ring_select(module, ring, done: torch.Tensor, scale: float) -> None:
    """The rows ``done`` (B,) have a complete block: cache and block compete, the evicted join ``kv``, the block
    slots empty."""
    lam, s = ring.cache, ring.sinks
    b, hkv = ring.keys.shape[:2]
    both = slice(s, s + ring.extra)
    feats = module._full_features(module._side_features(ring.kin.unsqueeze(2), scale, False)[0].squeeze(2))
    valid = ring.valid[:, None, both].expand(b, hkv, ring.extra)
    to_ref = decay = None
    if ring.slot_log is not None:
        waiting = ring.slot_log[..., lam:]
        decay = waiting.sum(-1)  # the state moves its reference to the block's last key
        to_ref = torch.cat([ring.slot_log[..., :lam] + decay[..., None], decay[..., None] - waiting.cumsum(-1)], -1)
    score = None
    if ring.q_hist is not None:
        score = attention_score(ring.q_hist, ring.q_real, ring.keys[:, :, both], valid, scale, ring.score)
    new_kv, keep, keep_valid = select_and_fold(ring.kv, feats, ring.vext[:, :, both], valid, lam, to_ref, decay,
                                               module.config.sparse_score == "relative", score,
                                               module.config.sparse_value_keys, module.config.sparse_value_pool)
    rows = done[:, None, None, None]
    ring.kv.copy_(torch.where(rows, new_kv, ring.kv))
    if score is not None:
        ring.score = torch.where(done[:, None, None], score.gather(-1, keep), ring.score)
    cache, wait = slice(s, s + lam), slice(s + lam, s + ring.extra)
    kept_valid = keep_valid[:, 0]  # the same slots in every kv head (select_and_fold's order)
    # a slot that holds no key keeps a zero key (and a zero [v, 1]): ``decode.fused_step`` reads the slots unmasked
    ring.keys[:, :, cache] = torch.where(rows, _take(ring.keys[:, :, both], keep) * keep_valid[..., None],
                                         ring.keys[:, :, cache])
    ring.vext[:, :, cache] = torch.where(rows, _take(ring.vext[:, :, both], keep) * keep_valid[..., None],
                                         ring.vext[:, :, cache])
    ring.kin[:, :, :lam] = torch.where(rows, _take(ring.kin, keep), ring.kin[:, :, :lam])
    if ring.slot_log is not None:
        ring.slot_log[..., :lam] = torch.where(done[:, None, None], to_ref.gather(-1, keep), ring.slot_log[..., :lam])
        ring.slot_log[..., lam:] = torch.where(done[:, None, None], 0.0, ring.slot_log[..., lam:])
    ring.valid[:, cache] = torch.where(done[:, None], kept_valid, ring.valid[:, cache])
    ring.valid[:, wait] &= ~done[:, None]
    ring.keys[:, :, wait] = torch.where(rows, 0.0, ring.keys[:, :, wait])
    ring.vext[:, :, wait] = torch.where(rows, 0.0, ring.vext[:, :, wait])
    ring.pending = torch.where(done, 0, ring.pending)
    if bool(done.all()):
        ring.sink_waiting = False


def ring_query(ring, q5: torch.Tensor, mask: torch.Tensor | None) -> None:
    """``sparse_score='attention'``: the step's query q5 (B, Hkv, G, 1, d) joins the ring's last queries (where
    ``mask`` (B, 1) says it is real; a padded query leaves them as they are)."""
    new = torch.cat([ring.q_hist[:, :, :, 1:], q5.to(ring.q_hist.dtype)], dim=3)
    real = torch.cat([ring.q_real[:, 1:], torch.ones_like(ring.q_real[:, :1])], dim=1)
    if mask is None:
        ring.q_hist, ring.q_real = new, real
        return
    ring.q_hist = torch.where(mask[:, None, None, :, None], new, ring.q_hist)
    ring.q_real = torch.where(mask, real, ring.q_real)


def sparse_from_recurrent(module, ring, state: RecurrentState, region: int) -> None:
    """Give ``ring`` (built by ``decode.from_recurrent`` with its extra slots empty) the state's sparse cache and its
    waiting block: the real keys of ``state.k``'s first ``region`` positions after its ``sparse_skip`` ones; the
    sinks among them (they left the window) go to the sink slots too."""
    cfg = module.config
    lam, chunk, s, d = cfg.sparse_cache, cfg.sparse_chunk, ring.sinks, module.head_dim
    b, hkv = ring.keys.shape[:2]
    work, device = ring.keys.dtype, ring.keys.device
    ring.extra, ring.cache = lam + chunk, lam
    ring.kin = torch.zeros(b, hkv, lam + chunk, module.kernel_dim, dtype=work, device=device)
    ring.slot_log = None if ring.logg is None else torch.zeros(b, hkv, lam + chunk, dtype=work, device=device)
    ring.pending = torch.zeros(b, dtype=torch.long, device=device)
    if cfg.sparse_score == "attention":
        ring.q_hist = torch.zeros(b, hkv, module.groups, chunk, d, dtype=work, device=device)
        ring.q_real = torch.zeros(b, chunk, dtype=torch.bool, device=device)
        ring.score = torch.zeros(b, hkv, lam, dtype=torch.promote_types(work, torch.float32), device=device)
        if state.sparse_q is not None:
            ring.q_hist = state.sparse_q.to(work).expand(b, -1, -1, -1, -1).clone()
            ring.q_real = state.sparse_q_mask.expand(b, -1).clone()
            ring.score = state.sparse_score.to(ring.score.dtype).expand(b, -1, -1).clone()
    if state.sparse_k is not None:
        c_valid = state.sparse_mask[:, 0]
        ring.keys[:, :, s : s + lam] = state.sparse_k.to(work) * c_valid[:, None, :, None]  # (``ring_select``)
        ring.vext[:, :, s : s + lam] = _with_normaliser(state.sparse_v.to(work), None) * c_valid[:, None, :, None]
        ring.valid[:, s : s + lam] = c_valid
        ring.kin[:, :, :lam] = (state.sparse_k if state.sparse_kin is None else state.sparse_kin).to(work)
        if ring.slot_log is not None:
            ring.slot_log[..., :lam] = state.sparse_logs.to(work)
    if not region:
        return
    real = torch.ones(b, region, dtype=torch.bool, device=device) if state.mask is None else state.mask[:, :region]
    if state.sparse_skip is not None:
        real = real & (real.long().cumsum(-1) > state.sparse_skip[:, None])
    idx, found = first_true(real, chunk - 1)  # the waiting keys, in order
    k = gather_keys(state.k[:, :, :region].to(work), idx, 2)
    v = gather_keys(state.v[:, :, :region].to(work), idx, 2)
    vext = _with_normaliser(v, None) * found[:, None, :, None]
    is_sink = torch.zeros_like(found)
    if ring.filled is not None:  # the row's next sinks: its first waiting keys
        is_sink = found & (torch.arange(chunk - 1, device=device) < (s - ring.filled)[:, None])
        sk, sv, sm = keep_sinks(ring.keys[:, :, :s], ring.vext[:, :, :s, :d], ring.valid[:, :s], k, v, is_sink, s)
        ring.keys[:, :, :s] = sk
        ring.vext[:, :, :s] = _with_normaliser(sv, None) * sm[:, None, :, None]
        ring.valid[:, :s] = sm
        ring.filled = sm.sum(-1)
        ring.sink_waiting = bool(is_sink.any())
        if bool((ring.filled == s).all()):
            ring.filled = None
    wait = slice(s + lam, s + lam + chunk - 1)
    ring.keys[:, :, wait] = k * found[:, None, :, None]
    ring.vext[:, :, wait] = vext
    ring.valid[:, wait] = found & ~is_sink
    ring.kin[:, :, lam : lam + chunk - 1] = module.kernel_input(k.unsqueeze(2), False).squeeze(2).to(work)
    if ring.slot_log is not None:
        ring.slot_log[..., lam : lam + chunk - 1] = module.log_gates(v.unsqueeze(2), found).squeeze(2)
    ring.pending = found.sum(-1)


def sparse_to_recurrent(ring) -> RecurrentState:
    """``ring`` with a sparse cache as the generic ``RecurrentState``: the waiting block (right-aligned in chunk - 1
    positions, its sinks back among its keys instead of in their slots), then the window in order."""
    lam, s, d = ring.cache, ring.sinks, ring.keys.shape[-1]
    chunk = ring.extra - lam
    b, hkv = ring.keys.shape[:2]
    device = ring.keys.device
    order = ring._ring_order()
    base = s + ring.extra
    win_k, win_v = ring.keys[:, :, base:][:, :, order], ring.vext[:, :, base:, :d][:, :, order]
    win_real = ring.valid[:, base:][:, order]
    t = torch.arange(chunk - 1, device=device)
    at = t[None, :] - (chunk - 1 - ring.pending[:, None])  # the waiting slot at each position, < 0: none
    here = at >= 0
    wait = slice(s + lam, s + lam + chunk - 1)
    wk = gather_keys(ring.keys[:, :, wait], at.clamp(min=0), 2)
    wv = gather_keys(ring.vext[:, :, wait, :d], at.clamp(min=0), 2)
    k = torch.cat([wk, win_k], dim=2).to(ring.key_dtype)
    v = torch.cat([wv, win_v], dim=2).to(ring.key_dtype)
    mask = torch.cat([here, win_real], dim=1)
    sink_k = sink_v = sink_mask = None
    if s and bool(ring.valid[:, :s].any()):
        # the waiting sinks (real, not candidates) leave their slots: the generic state keeps them among its keys
        waiting_sinks = ((torch.arange(chunk, device=device)[None, :] < ring.pending[:, None])
                         & ~ring.valid[:, s + lam : s + ring.extra]).sum(-1)
        filled = ring.valid[:, :s].sum(-1)
        sink_mask = ring.valid[:, :s] & (torch.arange(s, device=device)[None, :] < (filled - waiting_sinks)[:, None])
        if bool(sink_mask.any()):
            sink_k = ring.keys[:, :, :s].to(ring.key_dtype)
            sink_v = ring.vext[:, :, :s, :d].to(ring.key_dtype)
        else:
            sink_mask = None
    c_valid = ring.valid[:, None, s : s + lam].expand(b, hkv, lam).clone()
    return RecurrentState(ring.kv.unsqueeze(2), k, v, None if bool(mask.all()) else mask, ring.length, sink_k, sink_v,
                          sink_mask, ring.seen, sparse_k=ring.keys[:, :, s : s + lam].to(ring.key_dtype),
                          sparse_v=ring.vext[:, :, s : s + lam, :d].to(ring.key_dtype), sparse_mask=c_valid,
                          sparse_kin=ring.kin[:, :, :lam].clone(),
                          sparse_logs=None if ring.slot_log is None else ring.slot_log[..., :lam].clone(),
                          sparse_q=None if ring.q_hist is None else ring.q_hist.to(ring.key_dtype),
                          sparse_q_mask=None if ring.q_real is None else ring.q_real.clone(),
                          sparse_score=None if ring.score is None else ring.score.clone())
