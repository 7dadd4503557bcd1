"""Reformer LSH attention (Kitaev, Kaiser, Levskaya 2020, "Reformer: The Efficient Transformer",
arXiv:2001.04451), made causal and cache-consistent.

Hashing: angular LSH with random rotations R (one (D, num_buckets / 2) Gaussian matrix per round and query
head, drawn from the layer seed): h(x) = argmax([xR, -xR]) over ``num_buckets`` buckets, ``num_hashes``
rounds. With ``shared_qk`` (the paper's default) the keys are the unit-normalised queries, k_j = q_j / |q_j|
(one key head per query head, so grouped-query models work; the values keep their heads), and a token does
not attend to itself unless it has no other key. ``shared_qk=False`` hashes the model's own queries and keys
with the same rotations (for retrofitting stock checkpoints, whose W_k is trained).

The attended set (the paper's global sort-and-chunk is not causal: later tokens in other buckets shift the
chunk boundaries). In each round the unpadded keys are ordered by (bucket, position); ``rank_j`` is the
index of key j among the unpadded keys of its bucket. A query at position p with bucket b has
``rho = #{unpadded keys j < p in bucket b}`` and ``c = #{unpadded keys j <= p in bucket b}``, and attends to
the keys j of bucket b with

* causal: ``c - bucket_window <= rank_j < c`` (the last ``bucket_window`` keys of its bucket up to itself;
  with shared QK, ``0 <= rank_p - rank_j < bucket_window`` and ``j <= p``);
* bidirectional: ``|rho - rank_j| < bucket_window`` (shared QK: ``|rank_p - rank_j| < bucket_window``).

Rounds are combined by a softmax over the UNION of their sets, each key counted once. Only the order of the
unpadded keys enters, so a row depends on its keys and not on Lq or on padding: padded keys contribute
nothing, and a left- or right-padded row equals the row unpadded; decoding (keeps every key, re-sorts them
and recomputes the new row) gives the rows of one call. A query whose union is empty (every key padded) gets 0.

Algorithm (no n x n matrix): per round, sort the keys by (bucket, position) (padded keys last) and the queries
the same way; each query's set is a contiguous range of <= m sorted keys (m = ``bucket_window`` causal,
``2 * bucket_window - 1`` bidirectional). Consecutive sorted queries are grouped into chunks of
``bucket_window`` whose ranges fit in one slice of m + ``bucket_window`` sorted keys (with shared QK and no
padding every chunk is full; otherwise a chunk ends early where the ranges jump: about Lk / bucket_window
extra chunks at most), so each chunk is two dense matmuls against a gathered slice. A pair attended in an
earlier round is masked in the later ones (exact union), and the rounds' partial softmaxes are merged with
their log-sum-exps. Cost O(n log n + n * num_hashes * bucket_window * D + n * num_hashes^2 * bucket_window),
processed in groups of chunks (a few MiB of scores each).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..ops.base import KVCacheAttention
from ..registry import KindSpec, Option, register_kind

__all__ = ["ReformerAttention", "reformer_reference"]

_CHUNK_ELEMENTS = 1 << 22  # (query, key) pairs per group of chunks, all rounds
_NORM_EPS = 1e-6


class ReformerAttention(KVCacheAttention):
    """LSH attention: exact softmax over the keys sharing a hash bucket within a rank window, over rounds."""

    def __init__(self, config, num_heads: int, head_dim: int, num_kv_heads: int | None = None, layer_idx: int = 0):
        super().__init__(config, num_heads, head_dim, num_kv_heads, layer_idx)
        opts = config.options
        self.num_buckets = int(opts["num_buckets"])
        self.num_hashes = int(opts["num_hashes"])
        self.bucket_window = int(opts["bucket_window"])
        self.shared_qk = bool(opts["shared_qk"])
        self._rotations: dict[tuple, torch.Tensor] = {}

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, num_buckets={self.num_buckets}, num_hashes={self.num_hashes}, "
                f"bucket_window={self.bucket_window}, shared_qk={self.shared_qk}")

    def read_keys(self, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
        """shared_qk: the unit-normalised queries (B, H, L, D) (one key head per query head); else the keys."""
        if not self.shared_qk:
            return key
        if query.shape[2] != key.shape[2]:
            raise ValueError(f"kind='reformer' with shared_qk=True makes its keys from the queries: query and key "
                             f"need one length, got {query.shape[2]} and {key.shape[2]} (use a cache state for "
                             "decoding, or shared_qk=False)")
        work = torch.float64 if query.dtype == torch.float64 else torch.float32
        return F.normalize(query.to(work), dim=-1, eps=_NORM_EPS).to(query.dtype)

    def rotations(self, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """(num_hashes, H, D, num_buckets / 2) Gaussian rotations, drawn on the CPU from the layer seed."""
        key = (str(device), dtype)
        rot = self._rotations.get(key)
        if rot is None:
            gen = torch.Generator().manual_seed(self.seed)
            rot = torch.randn(self.num_hashes, self.num_heads, self.head_dim, self.num_buckets // 2, generator=gen,
                              dtype=torch.float64).to(device=device, dtype=dtype)
            self._rotations[key] = rot
        return rot

    @torch.no_grad()
    def buckets(self, x: torch.Tensor) -> torch.Tensor:
        """(B, H, num_hashes, L) bucket of every vector of x (B, H, L, D) (H = the query heads)."""
        xr = torch.einsum("bhld,rhdc->bhrlc", x, self.rotations(x.device, x.dtype))
        return torch.cat([xr, -xr], dim=-1).argmax(dim=-1)

    def attend(self, q, k, v, *, causal, scale, mask):
        b, h, lq, d = q.shape
        lk = k.shape[2]
        w, nh, nbk = self.bucket_window, self.num_hashes, self.num_buckets
        dev = q.device
        m = w if causal else 2 * w - 1  # candidate keys of one query in one round (sorted key order)
        c = min(w, lq)  # queries per chunk
        span = m + c  # keys a chunk reads
        with torch.no_grad():
            hash_keys = k if k.shape[1] == h else k.repeat_interleave(h // k.shape[1], dim=1)
            kb = self.buckets(hash_keys)  # (B, H, R, Lk)
            qb = kb[..., lk - lq:] if self.shared_qk else self.buckets(q)  # (B, H, R, Lq)
            keep = torch.ones(b, lk, dtype=torch.bool, device=dev) if mask is None else mask
            kpos = torch.arange(lk, device=dev)
            qpos = lk - lq + torch.arange(lq, device=dev)
            # keys sorted by (bucket, position), the padded ones last; spos = sorted index of key j
            sorted_code, korder = (torch.where(keep[:, None, None, :], kb, nbk) * lk + kpos).sort(dim=-1)
            spos = torch.empty_like(korder).scatter_(-1, korder, kpos.expand_as(korder))
            # queries sorted the same way; the sorted key range [lo, hi) each one reads, in sorted query order
            qcode, qorder = (qb * lk + qpos).sort(dim=-1)
            start = torch.searchsorted(sorted_code, qcode - qcode % lk)
            if causal:
                hi = torch.searchsorted(sorted_code, qcode, right=True)  # after its bucket's last key <= p
                first = hi - w
                lo = torch.maximum(start, first)
            else:
                s0 = torch.searchsorted(sorted_code, qcode)  # its bucket's keys < p end here
                first = s0 - w + 1
                lo = torch.maximum(start, first)
                hi = torch.minimum(torch.searchsorted(sorted_code, qcode - qcode % lk + lk), s0 + w)
            # chunks: consecutive sorted queries with the same (t // c, (first + w - 1) // c); a chunk reads the
            # sorted keys [base, base + span), which holds every query's [first, first + m)
            t = torch.arange(lq, device=dev)
            key2 = torch.div(first + (w - 1), c, rounding_mode="floor")
            change = torch.ones_like(qorder, dtype=torch.bool)
            change[..., 1:] = (key2[..., 1:] != key2[..., :-1]) | ((t[1:] // c) != (t[:-1] // c))
            chunk = change.long().cumsum(-1) - 1
            begin = torch.where(change, t, torch.zeros_like(t)).cummax(-1).values
            slot = chunk * c + (t - begin)  # (B, H, R, Lq) slot of each sorted query
            nch = int(chunk.amax()) + 1
            base = torch.zeros(b, h, nh, nch, dtype=torch.long, device=dev).scatter_(-1, chunk, key2 * c - (w - 1))
            # per slot: original query index (lq = empty slot), its range
            qidx = torch.full((b, h, nh, nch * c), lq, dtype=torch.long, device=dev).scatter_(-1, slot, qorder)
            lo_s = torch.zeros(b, h, nh, nch * c, dtype=torch.long, device=dev).scatter_(-1, slot, lo)
            hi_s = torch.zeros(b, h, nh, nch * c, dtype=torch.long, device=dev).scatter_(-1, slot, hi)
            # each original query's range in every round (for the duplicate counts) and its slot
            lo_o = torch.empty_like(lo).scatter_(-1, qorder, lo)
            hi_o = torch.empty_like(hi).scatter_(-1, qorder, hi)
            slot_o = torch.empty_like(slot).scatter_(-1, qorder, slot)
        # self exclusion (shared QK): key p sits in its own window whenever it is unpadded; it is dropped unless
        # no round offers another key. sidx = its sorted index in each round (-1: keep it / not there)
        with torch.no_grad():
            if self.shared_qk:
                own = spos[..., lk - lq:]  # (B, H, R, Lq) sorted index of key p, original query order
                inside = (own >= lo_o) & (own < hi_o) & keep[:, None, None, lk - lq:]
                others = (hi_o - lo_o - inside.long()).clamp_min(0)
                exclude = (others > 0).any(dim=2, keepdim=True) & inside
                sidx_o = torch.where(exclude, own, torch.full_like(own, -1))
                has_key = ((others > 0) | inside).any(dim=2)  # (B, H, Lq)
            else:
                sidx_o = torch.full_like(lo_o, -1)
                has_key = (hi_o > lo_o).any(dim=2)
            qsl = qidx.clamp_max(lq - 1)
            sidx_s = torch.where(qidx < lq, sidx_o.gather(-1, qsl), torch.full_like(qsl, -1))
        group = max(1, _CHUNK_ELEMENTS // max(1, b * h * nh * c * span))
        kflat = k.reshape(-1, d)
        vflat = v.reshape(-1, d)
        hk, hv = k.shape[1], v.shape[1]
        heads = torch.arange(h, device=dev)
        krow = (torch.arange(b, device=dev)[:, None] * hk + heads // (h // hk))[:, :, None, None, None] * lk
        vrow = (torch.arange(b, device=dev)[:, None] * hv + heads // (h // hv))[:, :, None, None, None] * lk
        qflat = torch.cat([q * scale, q.new_zeros(b, h, 1, d)], dim=2).reshape(-1, d)  # a zero row for empty slots
        qrow = (torch.arange(b, device=dev)[:, None] * h + heads)[:, :, None, None] * (lq + 1)
        low = torch.finfo(q.dtype).min
        outs, lses = [], []
        for g0 in range(0, nch, group):
            g1 = min(nch, g0 + group)
            n_g = g1 - g0
            with torch.no_grad():
                kidx, blocked = self._chunk_sets(korder, spos, base[..., g0:g1], qidx, qsl, lo_s, hi_s, sidx_s, lo_o,
                                                 hi_o, g0, g1, c, span, lk)
            qs = qflat.index_select(0, (qrow + qidx[..., g0 * c: g1 * c]).flatten()).view(b, h, nh, n_g, c, d)
            ks = kflat.index_select(0, (krow + kidx).flatten()).view(b, h, nh, n_g, span, d)
            vs = vflat.index_select(0, (vrow + kidx).flatten()).view(b, h, nh, n_g, span, d)
            logits = torch.matmul(qs, ks.transpose(-1, -2)).masked_fill_(blocked, low)
            top = logits.amax(dim=-1, keepdim=True).detach()
            p = logits.sub_(top).exp_()
            den = p.sum(dim=-1, keepdim=True)
            outs.append((torch.matmul(p, vs) / den).reshape(b, h, nh, n_g * c, d))
            lses.append((top + torch.log(den)).reshape(b, h, nh, n_g * c))
        out_r = torch.cat(outs, dim=3) if len(outs) > 1 else outs[0]  # (B, H, R, slots, D)
        lse_r = torch.cat(lses, dim=3) if len(lses) > 1 else lses[0]
        out_r = out_r.gather(3, slot_o[..., None].expand(b, h, nh, lq, d))  # original query order
        lse_r = lse_r.gather(3, slot_o)
        weight = torch.softmax(lse_r, dim=2)  # the rounds' shares of the union softmax
        out = (weight[..., None] * out_r).sum(dim=2)
        return torch.where(has_key[..., None], out, torch.zeros_like(out))

    def _chunk_sets(self, korder, spos, base, qidx, qsl, lo_s, hi_s, sidx_s, lo_o, hi_o, g0, g1, c, span, lk):
        """For chunks g0..g1: the key positions (B, H, R, g, span) and which (query, key) pairs are NOT attended
        (B, H, R, g, c, span). A pair found in several rounds is kept in the first one only, so that the union
        counts it once."""
        b, h, nh, n_g = base.shape
        u = base[..., None] + torch.arange(span, device=base.device)  # sorted key indices
        kidx = korder.gather(-1, u.clamp(0, lk - 1).reshape(b, h, nh, n_g * span)).view(b, h, nh, n_g, span)
        sl = slice(g0 * c, g1 * c)
        uu = u[..., None, :]
        blocked = (uu < lo_s[..., sl].view(b, h, nh, n_g, c, 1)) | (uu >= hi_s[..., sl].view(b, h, nh, n_g, c, 1))
        blocked |= uu == sidx_s[..., sl].view(b, h, nh, n_g, c, 1)
        qi = qsl[..., sl]
        for r in range(nh - 1):  # drop from the later rounds what round r attends already
            later = nh - r - 1
            where = spos[:, :, r].gather(-1, kidx[:, :, r + 1:].reshape(b, h, -1)).view(b, h, later, n_g, 1, span)
            lo_r = lo_o[:, :, r].gather(-1, qi[:, :, r + 1:].reshape(b, h, -1)).view(b, h, later, n_g, c, 1)
            hi_r = hi_o[:, :, r].gather(-1, qi[:, :, r + 1:].reshape(b, h, -1)).view(b, h, later, n_g, c, 1)
            blocked[:, :, r + 1:] |= (where >= lo_r) & (where < hi_r)
        return kidx, blocked


def reformer_reference(module: ReformerAttention, q, k, v, *, causal: bool, scaling: float | None = None,
                       key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Naive Reformer: the dense union mask of the definition (module docstring) from the hashes and ranks."""
    b, h, lq, d = q.shape
    hkv = k.shape[1]
    scale = 1.0 / math.sqrt(d) if scaling is None else float(scaling)
    keys = F.normalize(q, dim=-1, eps=_NORM_EPS) if module.shared_qk else k.repeat_interleave(h // hkv, dim=1)
    lk = keys.shape[2]
    vv = v.repeat_interleave(h // hkv, dim=1)
    kb = module.buckets(keys)
    qb = kb[..., lk - lq:] if module.shared_qk else module.buckets(q)
    keep = torch.ones(b, lk, dtype=torch.bool, device=q.device) if key_padding_mask is None else key_padding_mask
    pos = torch.arange(lq, device=q.device) + lk - lq
    j = torch.arange(lk, device=q.device)
    w = module.bucket_window
    allowed = torch.zeros(b, h, lq, lk, dtype=torch.bool, device=q.device)
    for r in range(module.num_hashes):
        onehot = F.one_hot(kb[:, :, r], module.num_buckets).long() * keep[:, None, :, None].long()  # (B, H, Lk, NB)
        incl = onehot.cumsum(dim=2)  # unpadded keys <= j of each bucket
        excl = incl - onehot  # unpadded keys < j of each bucket
        rank = (excl * onehot).sum(-1)  # (B, H, Lk)
        bucket_q = qb[:, :, r, :, None]
        c = incl[:, :, pos].gather(-1, bucket_q)  # (B, H, Lq, 1)
        rho = excl[:, :, pos].gather(-1, bucket_q)
        same = (kb[:, :, r, None, :] == bucket_q) & keep[:, None, None, :]
        if causal:
            inside = same & (j <= pos[:, None]) & (rank[:, :, None, :] >= c - w)
        else:
            inside = same & ((rho - rank[:, :, None, :]).abs() < w)
        allowed |= inside
    if module.shared_qk:
        is_self = j == pos[:, None]
        other = (allowed & ~is_self).any(dim=-1, keepdim=True)
        allowed = allowed & (~is_self | ~other)
    scores = (q @ keys.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    top = scores.amax(dim=-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    p = torch.exp(scores - top)
    den = p.sum(dim=-1, keepdim=True)
    return torch.where(den > 0, (p @ vv) / torch.where(den > 0, den, torch.ones_like(den)), torch.zeros_like(q))


def _validate(config) -> None:
    nb = config.options["num_buckets"]
    if nb % 2:
        raise ValueError(f"num_buckets must be even (angular LSH: argmax over [xR, -xR]), got {nb}")


def _label(config) -> str:
    o = config.options
    return (f"{o['num_hashes']}x{o['num_buckets']} buckets, window={o['bucket_window']}"
            + (", shared QK" if o["shared_qk"] else ""))


register_kind(KindSpec(
    name="reformer",
    module=ReformerAttention,
    title="Reformer LSH attention (Kitaev et al. 2020, arXiv:2001.04451)",
    reference=reformer_reference,
    causal=True,
    bidirectional=True,
    linear_time=True,
    fields=("seed",),
    options={
        "num_buckets": Option(32, "hash buckets per round (even: angular LSH argmax over [xR, -xR])",
                              minimum=2, maximum=1 << 16),
        "num_hashes": Option(2, "hashing rounds; a key found in several rounds is counted once", minimum=1,
                             maximum=64),
        "bucket_window": Option(64, "keys of its bucket a query reads per round, by rank (causal: the last ones up "
                                    "to itself; bidirectional: within this rank distance)", minimum=1,
                                maximum=1 << 16),
        "shared_qk": Option(True, "keys = the unit-normalised queries, no attention to itself (the paper); False "
                                  "hashes the model's own keys (stock checkpoints)"),
    },
    validate=_validate,
    label=_label,
    memory=lambda config: ("Generation keeps every value and every key (with shared_qk, the normalised query of "
                           "each query head), like a softmax KV cache." if config.options["shared_qk"] else
                           "Generation keeps every key and value, like a softmax KV cache."),
    cross_attention=False,  # defined within one sequence
    bench={"reformer-2x32": {"kind": "reformer", "options": {"num_hashes": 2, "num_buckets": 32}}},
))
