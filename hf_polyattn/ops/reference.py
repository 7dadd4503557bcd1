"""Naive O(n^2) definitions of every kind: the ground truth the fast paths are tested against.

Each builds the full (B, H, Lq, Lk) weight matrix from the definition — the exact kernel
for 'polynomial', phi(q) . phi(k) for the feature kinds (the sketch / random features
*are* the definition of the approximation), the exact kernel inside the diagonal blocks
with ``local_exact``, inside the sliding window and at the attention sinks with ``window`` /
``sinks`` — masks it (causal bottom-right aligned, key padding) and normalises. Learned sink
slots (``learned_sinks`` m) are m extra keys and values in front of the sequence's, never masked:
the weights are then (B, H, Lq, m + Lk). With ``sink_position='window'`` and a RoPE module (``module.rope``) the sink
columns are scored by each query re-rotated to position min(p_i, S), p_i its row's real keys before it (S =
``cfg.resolved_sink_span``: ``sink_span``, or w + s - 1).
A layer's logit soft-cap c (``module.softcap``) turns every exact score x into c tanh(x / c) first; the kernel part
phi(q).phi(k) forms no score and stays as it is.
Slow and memory-hungry on purpose: no blocks, no prefix sums, no shared code paths with
``attention.py`` beyond the module's parameters.
"""

from __future__ import annotations

import math

import torch

from .attention import PolyAttention
from .conv import reference_causal_conv
from .sketches import symmetric_square
from .sparse import ATTENTION_CARRY

__all__ = ["reference_attention", "reference_delta", "reference_lt_product", "reference_weights"]


def reference_lt_product(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, block_size: int, include_diag: bool,
                         square: bool, decay: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """The causal product of ``backend.lt_product`` from its definition, with the full (..., n, n) weight matrix:
    row i = sum_j W_ij (phi(a_i) . phi(b_j)) c_j, W_ij = [j <= i] (and [block(j) != block(i)] without the diagonal
    blocks) times exp(qlog_i - klog_j) with ``decay=(qlog, klog)``; the exponent is masked before the exp."""
    fa, fb = (symmetric_square(a), symmetric_square(b)) if square else (a, b)
    n = a.shape[-2]
    i = torch.arange(n, device=a.device)
    keep = i[None, :] <= i[:, None]
    if not include_diag:
        keep = keep & ((i[None, :] // block_size) != (i[:, None] // block_size))
    w = torch.where(keep, fa @ fb.transpose(-1, -2), torch.zeros((), dtype=fa.dtype, device=a.device))
    if decay is not None:
        qlog, klog = decay
        w = w * torch.exp((qlog.unsqueeze(-1) - klog.unsqueeze(-2)).masked_fill(~keep, float("-inf")))
    return w @ c


def _kernel_inputs(module: PolyAttention, q: torch.Tensor, k: torch.Tensor,
                   key_padding_mask: torch.Tensor | None = None):
    """(q, k) as the kernel sees them (the short convolution with padded rows zeroed, the projection, then the
    LayerNorm) and the raw (q, k)."""
    b, h, lq, d = q.shape
    q5 = q.reshape(b, module.num_kv_heads, module.groups, lq, d)
    k5 = k.unsqueeze(2)
    raw = (q5, k5)
    if module.config.short_conv:
        if lq != k.shape[2]:
            raise ValueError("short_conv needs q_len == kv_len (it convolves the query of every key)")
        if key_padding_mask is not None:
            keep = key_padding_mask[:, None, None, :, None].to(q5.dtype)
            q5, k5 = q5 * keep, k5 * keep
        q5 = reference_causal_conv(q5, module.conv_q.weight)
        k5 = reference_causal_conv(k5, module.conv_k.weight)
    if module.config.feature_proj:
        q5, k5 = q5 @ module.feature_proj.weight, k5 @ module.feature_proj.weight
    if module.config.qk_norm:
        q5, k5 = module.q_norm(q5), module.k_norm(k5)
    return q5, k5, raw


def _decay_weights(module: PolyAttention, v: torch.Tensor | None, key_padding_mask: torch.Tensor | None, lq: int,
                   causal: bool) -> torch.Tensor:
    """(B, Hkv, 1, Lq, Lk) exp(G_i - G_j) for the causal pairs (0 elsewhere), G_i = sum_{t <= i} log g_t over the
    keys: log gamma = -exp(theta) ('scalar') or logsigmoid(v_t . w + b) ('gate'), 0 at padded keys."""
    cfg = module.config
    if not causal:
        raise ValueError(f"decay={cfg.decay!r} is defined for causal attention only")
    if v is None:
        raise ValueError(f"decay={cfg.decay!r}: the reference weights need the values (value=...)")
    lk = v.shape[2]
    g = _cumulative_log_gates(module, v, key_padding_mask)
    pos_q = torch.arange(lq, device=v.device) + lk - lq
    keep = torch.arange(lk, device=v.device)[None, :] <= pos_q[:, None]
    x = (g[..., pos_q, None] - g[..., None, :]).masked_fill(~keep, float("-inf"))
    return torch.exp(x).unsqueeze(2)


def _cumulative_log_gates(module: PolyAttention, v: torch.Tensor, key_padding_mask: torch.Tensor | None):
    """G (B, Hkv, Lk), G_t = sum_{s <= t} log g_s: log gamma = -exp(theta) ('scalar') or logsigmoid(v_t . w + b)
    ('gate'), at most -1/decay_max_horizon when set, 0 at padded keys; zeros without decay."""
    cfg = module.config
    b, hkv, lk, _ = v.shape
    if cfg.decay == "none":
        return torch.zeros(b, hkv, lk, dtype=v.dtype, device=v.device)
    if cfg.decay == "scalar":
        log_g = (-torch.exp(module.decay_theta.to(v.dtype)))[None, :, None].expand(b, hkv, lk)
    else:
        log_g = torch.nn.functional.logsigmoid(torch.einsum("bhld,hd->bhl", v, module.gate_weight.to(v.dtype))
                                               + module.gate_bias.to(v.dtype)[None, :, None])
    if cfg.decay_max_horizon:
        log_g = torch.minimum(log_g, torch.full_like(log_g, -1.0 / cfg.decay_max_horizon))
    if key_padding_mask is not None:
        log_g = torch.where(key_padding_mask[:, None, :], log_g, torch.zeros_like(log_g))
    return torch.cumsum(log_g, dim=-1)


def _sparse_exact(module: PolyAttention, fk: torch.Tensor, v: torch.Tensor | None,
                  key_padding_mask: torch.Tensor | None, lq: int, x_obs: torch.Tensor | None = None,
                  calls: list[int] | None = None) -> torch.Tensor:
    """(B, Hkv, 1, Lq, Lk) bool: the keys ``sparse_cache`` attends exactly besides the window and the sinks, from its
    definition (``ops/sparse.py``), one row, head and block at a time: for query i with r_i real keys at least
    ``window`` positions back and e_i = r_i // C (C = ``sparse_chunk``), every real key of block e_i or later (the
    pending block) and Cache_{e_i}; Cache_{b+1} = the ``sparse_cache`` largest of |v - phi(k) S_v / phi(k) S_1| over
    Cache_b and the non-sink keys of block b, S the kernel state of every key evicted so far (recomputed from its
    definition each block, each key weighed by exp(G_ref - G_j), ref = block b's last key). With
    ``sparse_score='attention'`` the score is instead each candidate's softmax weight over the candidates (``x_obs``)
    under the C real queries before the query that first needs Cache_{b+1}, summed over them and the G query heads,
    plus ``ATTENTION_CARRY`` times the score a cached key had when it was last kept (0 for the block's keys).

    ``sparse_observe`` L (``calls``: the queries of each call in order, one call of all Lq when None; ``x_obs``
    (B, Hkv, G, Lq, Lk) the model's own scaled scores q.k): in every call of more than one query, each of its last L
    real queries r reads a cache chosen again from the cache the call started with and the non-sink keys of the
    blocks completed at r: the call's last-L queries from the first of them up to r give each candidate its softmax
    weight over the candidates, summed over them and the G query heads; the scores, laid out as the carried cache's
    slots then every real key from the call's first block on, are max-pooled over ``sparse_observe_pool``
    neighbours; the ``sparse_cache`` first by (pooled score, own score, layout order) are kept, the other candidates
    join the state beside what it held when the call began. The call's last query's choice is the cache every later
    query starts from (under ``sparse_score='attention'`` with the kept keys' own scores as their carried ones)."""
    cfg = module.config
    if v is None:
        raise ValueError("sparse_cache: the reference weights need the values (value=...): they choose the cache")
    w, chunk, budget, sinks = cfg.window, cfg.sparse_chunk, cfg.sparse_cache, cfg.sinks
    n_obs, width = cfg.sparse_observe, cfg.sparse_observe_pool
    b, hkv, lk, d = v.shape
    g = _cumulative_log_gates(module, v, key_padding_mask).detach()
    fk, v = fk.detach(), v.detach()  # the choice is not differentiable
    attn = cfg.sparse_score == "attention"
    if attn and x_obs is None:
        raise ValueError("sparse_score='attention': the reference weights need the scores x_obs: they choose the cache")
    calls = [lq] if calls is None else list(calls)
    if sum(calls) != lq:
        raise ValueError(f"calls must split the {lq} queries, got {calls}")
    exact = torch.zeros(b, hkv, 1, lq, lk, dtype=torch.bool, device=v.device)
    for row in range(b):
        real = list(range(lk)) if key_padding_mask is None else key_padding_mask[row].nonzero()[:, 0].tolist()
        rank = {j: t for t, j in enumerate(real)}  # real index of each real key
        sink = set(real[:sinks])
        epochs = []
        for i in range(lq):
            at = lk - lq + i
            left = sum(1 for j in real if j <= at - w)
            epochs.append(left // chunk)
        asked = [i for i in range(lq) if lk - lq + i in rank]  # the row's real queries
        for h in range(hkv):
            cache, folded, done, seen, acc = [], [], 0, {}, {}
            first = 0
            for size in calls:
                queries = range(first, first + size)
                carried, carried_folded, start = list(cache), list(folded), done
                for i in queries:
                    while done < epochs[i]:
                        scores = None
                        if attn:  # the C real queries before query i
                            before = [t for t in asked if t < i][-chunk:]
                            scores = (x_obs[row, h][:, before], acc)
                        cache, folded, acc = _select_block(fk[row, h, 0], v[row, h], g[row, h], real, rank, sink,
                                                           chunk, budget, done, cache, folded,
                                                           cfg.sparse_score == "relative", scores,
                                                           cfg.sparse_value_keys, cfg.sparse_value_pool)
                        done += 1
                    seen[i] = list(cache)
                mine = [i for i in queries if lk - lq + i in rank]  # the call's real queries
                if n_obs and size > 1 and mine:
                    layout = carried + [None] * (budget - len(carried)) + [
                        j for j in real if rank[j] >= start * chunk]
                    observed = mine[-n_obs:]
                    for r in observed:
                        blocks = epochs[r]
                        cands = set(carried) | {j for j in real if start * chunk <= rank[j] < blocks * chunk
                                                and j not in sink}
                        col = [t for t, j in enumerate(layout) if j in cands]
                        own = torch.zeros(len(layout), dtype=torch.float64)
                        if col:
                            keys = torch.tensor([layout[t] for t in col])
                            for i in observed[: observed.index(r) + 1]:
                                own[col] += x_obs[row, h, :, i, keys].double().softmax(-1).sum(0)
                        order = _pooled_order([float(x) for x in own], col, width)
                        heavy = _heaviest([j if t in col else None for t, j in enumerate(layout)], v[row, h],
                                          cfg.sparse_value_keys, cfg.sparse_value_pool)
                        order = [t for t in col if layout[t] in heavy] + [t for t in order if layout[t] not in heavy]
                        kept = sorted(order[:budget])
                        seen[r] = [layout[t] for t in kept]
                        acc = {layout[t]: float(own[t]) for t in kept}
                    cache = seen[observed[-1]]
                    folded = carried_folded + [layout[t] for t in col if t not in kept]
                first += size
            for i, e in enumerate(epochs):
                for j in real:
                    if j <= lk - lq + i and (rank[j] >= e * chunk or j in seen[i]):
                        exact[row, h, 0, i, j] = True
    return exact


def _heaviest(layout: list, v: torch.Tensor, count: int, width: int) -> set:
    """``sparse_value_keys``: the ``count`` keys of ``layout`` (candidates in candidate order, None where a slot holds
    none) first by their |v| max-pooled over ``width`` neighbours in the layout (an empty slot counts 0), then by
    their own |v|, then the earlier."""
    norms = [0.0 if j is None else float(torch.linalg.vector_norm(v[j].float())) for j in layout]
    order = _pooled_order(norms, [t for t, j in enumerate(layout) if j is not None], width)
    return {layout[t] for t in order[:count]}


def _pooled_order(own: list, cols: list, width: int) -> list:
    """The places ``cols`` ranked by ``own`` (a score per place) max-pooled over ``width`` neighbours, then by their
    own score, then the earlier (``sparse_observe_pool``, ``sparse_value_pool``)."""
    pooled = [max(own[max(0, t - width // 2): t + width // 2 + 1]) for t in range(len(own))]
    return sorted(cols, key=lambda t: (-pooled[t], -own[t], t))


def _select_block(fk, v, g, real, rank, sink, chunk: int, budget: int, blk: int, cache: list, folded: list,
                  relative: bool = False, scores=None, value_keys: int = 0, value_pool: int = 1):
    """One row and head's streaming selection of block ``blk`` (Cache_blk -> Cache_blk+1, ``_sparse_exact``):
    (the new cache, the folded keys, the kept keys' scores). fk (Lk, F), v (Lk, d), g (Lk,) the row and head's
    features, values and cumulative log-gates; ``real`` its real keys, ``rank`` their real index, ``sink`` the
    sinks; ``relative`` ranks by the error over |v| (``sparse_score='relative'``); ``scores`` (x (G, Q, Lk) the
    scaled scores of the queries that choose, {key: its carried score}) ranks by ``sparse_score='attention'``;
    ``value_keys`` (``sparse_value_keys``) candidates of largest |v| pooled over ``value_pool`` neighbours are kept
    before any other, pooled in the layout the forward ranks (the cache's ``budget`` slots, its keys first, then the
    block with its sinks as empty slots)."""
    d = v.shape[-1]
    members = [j for j in real if blk * chunk <= rank[j] < (blk + 1) * chunk]
    ref = members[-1]
    cands = cache + [j for j in members if j not in sink]
    layout = cache + [None] * (budget - len(cache)) + [None if j in sink else j for j in members]
    heavy = _heaviest(layout, v, value_keys, value_pool) if value_keys else set()

    def first_heavy(ranked):  # the reserved candidates ahead, each part in its own order
        return [t for t in range(len(cands)) if cands[t] in heavy] + [t for t in ranked if cands[t] not in heavy]

    if scores is not None:
        x, carried = scores
        own = x[:, :, cands].double().softmax(-1).sum((0, 1)) if x.shape[1] else torch.zeros(len(cands))
        errors = [float(own[t]) + ATTENTION_CARRY * carried.get(j, 0.0) for t, j in enumerate(cands)]
        ranked = first_heavy(sorted(range(len(cands)), key=lambda t: -errors[t]))
        kept = sorted(ranked[:budget])
        return ([cands[t] for t in kept], folded + [cands[t] for t in ranked[budget:]],
                {cands[t]: errors[t] for t in kept})
    state = torch.zeros(fk.shape[-1], d + 1, dtype=v.dtype, device=v.device)
    for j in folded:
        state = state + torch.exp(g[ref] - g[j]) * torch.outer(fk[j], torch.cat([v[j], v.new_ones(1)]))
    errors = []
    for j in cands:
        pred = fk[j] @ state
        recall = pred[:d] / pred[d] if pred[d] > 0 else torch.zeros_like(pred[:d])
        err = float(torch.linalg.vector_norm(v[j] - recall))
        if relative:
            err /= max(float(torch.linalg.vector_norm(v[j])), torch.finfo(v.dtype).tiny)
        errors.append(err)
    ranked = first_heavy(sorted(range(len(cands)), key=lambda t: -errors[t]))
    return [cands[t] for t in sorted(ranked[:budget])], folded + [cands[t] for t in ranked[budget:]], {}


def _sink_keys(cfg, key_padding_mask: torch.Tensor | None, batch: int, lk: int, device) -> torch.Tensor:
    """(B, 1, 1, 1, Lk) bool: the attention sinks, each row's first ``cfg.sinks`` unpadded keys."""
    sink = torch.zeros(batch, lk, dtype=torch.bool, device=device)
    for b in range(batch):
        real = torch.arange(lk, device=device) if key_padding_mask is None else key_padding_mask[b].nonzero()[:, 0]
        sink[b, real[: cfg.sinks]] = True
    return sink[:, None, None, None, :]


def _sink_queries(module: PolyAttention, q_raw: torch.Tensor, key_padding_mask: torch.Tensor | None,
                  lk: int) -> torch.Tensor:
    """The queries (B, Hkv, G, Lq, d) that score the sink columns: q_raw itself, or with ``sink_position='window'``
    and ``module.rope`` each query i rotated from p_i to min(p_i, S) (S = ``cfg.resolved_sink_span``: ``sink_span``,
    or w + s - 1), p_i = the unpadded keys of its row before it (query i is key lk - lq + i), one row and query at a
    time; pair t of dims (a_t, b_t) (``rope.pairs``; the rotate_half pairs (t, t + F) when None) turns by the angle
    (P_i - p_i) f_t."""
    cfg, rope = module.config, module.rope
    if not cfg.sinks or cfg.sink_position != "window" or rope is None:
        return q_raw
    b, lq, f = q_raw.shape[0], q_raw.shape[3], rope.inv_freq.numel()
    pairs = torch.arange(2 * f).reshape(2, f) if rope.pairs is None else rope.pairs
    out = q_raw.clone()
    for row in range(b):
        for i in range(lq):
            key = lk - lq + i
            p = key if key_padding_mask is None else int(key_padding_mask[row, :key].sum())
            delta = min(p, cfg.resolved_sink_span) - p
            angle = delta * rope.inv_freq.to(torch.float64)
            cos, sin = angle.cos().to(q_raw.dtype), angle.sin().to(q_raw.dtype)
            x, (a, c) = q_raw[row, :, :, i], pairs
            out[row, :, :, i, a] = x[..., a] * cos - x[..., c] * sin
            out[row, :, :, i, c] = x[..., c] * cos + x[..., a] * sin
    return out


def reference_weights(module: PolyAttention, q: torch.Tensor, k: torch.Tensor, *, causal: bool,
                      scaling: float | None = None, key_padding_mask: torch.Tensor | None = None,
                      value: torch.Tensor | None = None, calls: list[int] | None = None) -> torch.Tensor:
    """Unnormalised attention weights (B, H, Lq, Lk), masked entries 0; (B, H, Lq, m + Lk) with m learned sink
    slots in front. ``value`` (B, Hkv, Lk, D): needed by decay='gate' (its gates read the values). ``calls``: the
    queries of each call in order (``sparse_observe`` chooses again at the end of each; one call when None)."""
    cfg = module.config
    if cfg.sinks and not causal:
        raise ValueError("sinks are defined for causal attention only")
    s = 1.0 / math.sqrt(module.head_dim) if scaling is None else float(scaling)
    q5, k5, (q_raw, k_raw) = _kernel_inputs(module, q, k, key_padding_mask)
    lq, lk = q.shape[2], k.shape[2]
    x = (q5 @ k5.transpose(-1, -2)) * s
    x_raw = (q_raw @ k_raw.transpose(-1, -2)) * s  # a sliding window scores with the model's own q, k
    x_obs = x_raw  # sparse_observe's scores: the model's own q, k (the sinks' re-rotated queries replace x_raw's)

    def exact(xx: torch.Tensor, kernel: str) -> torch.Tensor:
        if module.softcap is not None:  # the model's logit soft-capping, on every score an exact part forms
            xx = module.softcap * torch.tanh(xx / module.softcap)
        if kernel == "softmax":
            return torch.exp(xx)
        if cfg.poly_coefficients is not None:
            a = module.coefficients.to(xx.dtype)
            return sum(a[i] * xx**i for i in range(a.shape[0])) ** 2
        return ((xx + cfg.alpha) / cfg.beta) ** cfg.degree  # alpha, beta: kind='polynomial' only (validated)

    # exact beside the window: the attention sinks (the future ones are masked below, as every key), scored by the
    # queries of sink_position (a query at p_i <= S = cfg.resolved_sink_span is not rotated)
    sink = _sink_keys(cfg, key_padding_mask, q.shape[0], lk, q.device) if cfg.sinks else False
    if cfg.sinks:
        x_raw = torch.where(sink, (_sink_queries(module, q_raw, key_padding_mask, lk) @ k_raw.transpose(-1, -2)) * s,
                            x_raw)
    if module.exact_everywhere:
        w = exact(x, "polynomial")
    elif module.feature_map is None:  # the window alone
        local = cfg.resolved_local_kernel
        dist = (torch.arange(lq, device=q.device) + (lk - lq if causal else 0))[:, None] - torch.arange(
            lk, device=q.device)[None, :]
        inside = (dist >= 0) & (dist < cfg.window) if causal else dist.abs() < cfg.window
        w = torch.where(inside | sink, exact(x_raw, local), torch.zeros_like(x_raw))  # nothing beyond the window
    else:
        root = math.sqrt(s) if module.feature_map.scaled_inputs else 1.0
        if module.feature_map.log_scaled:
            fq, cq = module.feature_map.forward_with_log_scale(q5 * root, True)
            fq = fq * torch.exp(cq)  # undo the per-row stabiliser: the true FAVOR+ features
        else:
            fq = module.feature_map(q5 * root, True)
        fk = module.feature_map(k5 * root, False)
        w = fq @ fk.transpose(-1, -2)
        if cfg.decay != "none":  # the kernel part only: the exact window / blocks below replace their weights
            w = w * _decay_weights(module, value, key_padding_mask, lq, causal)
        local = cfg.resolved_local_kernel
        if cfg.window:
            # sliding window: exact on the previous `window` keys (|i - j| < window bidirectional),
            # the kernel (times the per-head mixing factor) on the rest
            dist = (torch.arange(lq, device=q.device) + (lk - lq if causal else 0))[:, None] - torch.arange(
                lk, device=q.device)[None, :]
            inside = (dist >= 0) & (dist < cfg.window) if causal else dist.abs() < cfg.window
            if cfg.sparse_cache:
                inside = inside | _sparse_exact(module, fk, value, key_padding_mask, lq, x_obs, calls)
            if cfg.window_mix:
                w = w * module.window_mix.abs().to(w.dtype)
            w = torch.where(inside | sink, exact(x_raw, local), w)
        elif local is not None:
            pos_q = torch.arange(lq, device=q.device) + (lk - lq if causal else 0)
            pos_k = torch.arange(lk, device=q.device)
            same_block = (pos_q[:, None] // cfg.block_size) == (pos_k[None, :] // cfg.block_size)
            w = torch.where(same_block, exact(x, local), w)
    w = w.reshape(q.shape[0], module.num_heads, lq, lk)
    keep = torch.ones(lq, lk, dtype=torch.bool, device=q.device)
    if causal:
        keep = torch.arange(lk, device=q.device)[None, :] <= (torch.arange(lq, device=q.device)[:, None] + lk - lq)
    keep = keep[None, None]
    if key_padding_mask is not None:
        keep = keep & key_padding_mask[:, None, None, :]
    w = torch.where(keep, w, torch.zeros_like(w))
    if cfg.learned_sinks:  # m slots per kv head, scored with the model's own q, seen by every query
        slots = exact((q_raw @ module.sink_k.transpose(-1, -2)) * s, cfg.resolved_local_kernel)
        w = torch.cat([slots.reshape(q.shape[0], module.num_heads, lq, -1), w], dim=-1)
    if cfg.sparse_cache and key_padding_mask is not None:  # its blocks count real keys: a padded query has no row
        w = w * key_padding_mask[:, None, lk - lq :, None].to(w.dtype)
    return w


def reference_attention(module: PolyAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
                        scaling: float | None = None, key_padding_mask: torch.Tensor | None = None,
                        calls: list[int] | None = None) -> torch.Tensor:
    """(B, H, Lq, D): sum_j w_ij v_j / (offset + sum_j w_ij), 0 for a row with no weight."""
    w = reference_weights(module, q, k, causal=causal, scaling=scaling, key_padding_mask=key_padding_mask, value=v,
                          calls=calls)
    g = module.groups
    if module.config.learned_sinks:  # the slots' values in front, as their weights
        v = torch.cat([module.sink_v.squeeze(1).expand(v.shape[0], -1, -1, -1).to(v.dtype), v], dim=2)
    v_rep = v.repeat_interleave(g, dim=1)
    num = w @ v_rep
    den = w.sum(-1, keepdim=True) + module.config.denominator_offset
    return torch.where(den > 0, num / torch.where(den > 0, den, torch.ones_like(den)), torch.zeros_like(num))


def reference_delta(module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
                    scaling: float | None = None, key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
    """(B, H, Lq, D) of kind 'delta' from its definition (``kinds/delta.py``), one token at a time in the paper's
    form: S_t = a_t S_{t-1} (I - b_t k^_t k^_t^T) + b_t v_t k^_t^T (S: d_v x F per kv head), o_i = S_i q^_i with
    q^, k^ the queries and keys (after the short convolution and the ``delta_feature_map``) over
    sqrt(|x|^2 + 1e-6); b_t = sigmoid(v_t . w_b + c_b), log a_t from the decay (0 without), both neutral (b = 0,
    a = 1) at padded keys; plus, with a window, the window and sinks' output (``reference_attention``) and the delta
    read-out times the per-head factor m."""
    if not causal:
        raise ValueError("kind='delta' is causal only")
    cfg = module.config
    b, h, lq, d = q.shape
    hkv, lk, g = module.num_kv_heads, k.shape[2], module.groups
    q5, k5, _ = _kernel_inputs(module, q, k, key_padding_mask)
    beta = torch.sigmoid(torch.einsum("bhld,hd->bhl", v, module.beta_weight.to(v.dtype))
                         + module.beta_bias.to(v.dtype)[None, :, None])
    if cfg.decay == "none":
        log_a = torch.zeros_like(beta)
    elif cfg.decay == "scalar":
        log_a = (-torch.exp(module.decay_theta.to(v.dtype)))[None, :, None].expand(b, hkv, lk)
    else:
        log_a = torch.nn.functional.logsigmoid(torch.einsum("bhld,hd->bhl", v, module.gate_weight.to(v.dtype))
                                               + module.gate_bias.to(v.dtype)[None, :, None])
    if cfg.decay_max_horizon:
        log_a = torch.minimum(log_a, torch.full_like(log_a, -1.0 / cfg.decay_max_horizon))
    if key_padding_mask is not None:
        real = key_padding_mask[:, None, :]
        beta, log_a = torch.where(real, beta, 0.0), torch.where(real, log_a, 0.0)

    def unit(x: torch.Tensor) -> torch.Tensor:
        return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)

    delta = torch.zeros(b, hkv, g, lq, d, dtype=v.dtype, device=v.device)
    if module.delta_map is not None:  # features before the norm
        q5, k5 = module.delta_map(q5, True), module.delta_map(k5, False)
    f = k5.shape[-1]
    eye = torch.eye(f, dtype=v.dtype, device=v.device)
    s = torch.zeros(b, hkv, d, f, dtype=v.dtype, device=v.device)
    for t in range(lk):
        kt = unit(k5[:, :, 0, t])  # (B, Hkv, f)
        a, bt = torch.exp(log_a[..., t])[..., None, None], beta[..., t][..., None, None]
        s = a * s @ (eye - bt * kt[..., :, None] * kt[..., None, :]) + bt * v[:, :, t, :, None] * kt[..., None, :]
        i = t - (lk - lq)  # the query on key t (rows bottom-right aligned)
        if i >= 0:
            delta[:, :, :, i] = torch.einsum("bhvk,bhgk->bhgv", s, unit(q5[:, :, :, i]))
    delta = delta.reshape(b, h, lq, d)
    if not cfg.window:
        return delta
    window = reference_attention(module, q, k, v, causal=True, scaling=scaling, key_padding_mask=key_padding_mask)
    return window + module.delta_mix.reshape(1, h, 1, 1).to(v.dtype) * delta
