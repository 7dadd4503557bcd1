"""Sliding-window hybrid attention: exact weights on the previous w keys, the linear-time
kernel on every key before them, one normaliser (LoLCATs' formulation).

For a causal query i (positions of keys, bottom-right aligned):

    window  W(i) = { j : i - w < j <= i }          exact kernel (softmax or polynomial)
    far     R(i) = { j : j <= i - w }              phi(q_i) . phi(k_j)

    out_i = (sum_W e_ij v_j + s_i sum_R phi_ij v_j) / (sum_W e_ij + s_i sum_R phi_ij)

with s_i = exp(-m_i) (times a learnable per-head mixing factor when asked) for a softmax
window whose row stabiliser is m_i, and s_i = 1 for a polynomial window. Bidirectional
(BERT): W(i) = { j : |i - j| < w }, R(i) = the rest.

Why not the block-diagonal ``local_exact``: there the first query of each block sees only
itself exactly; the calibration probe in PEERS.md got 62.6 perplexity with a 64-token exact
window against 95.3 without on SmolLM2. A sliding window is also translation invariant, so
left padding changes nothing (block boundaries shift with it).

Attention sinks (``sinks`` s, StreamingLLM, Xiao et al., arXiv:2309.17453) and learned sink slots
(``learned_sinks`` m, Lizard's meta-memory, arXiv:2507.09025), causal:

    S(i) = the first s real keys of the row (after left padding: the key padding mask decides)
    out_i = (sum_{W(i) u (S n R(i))} e_ij v_j + sum_slots e_iu v_u + s_i sum_{R(i) - S} phi_ij v_j) / (same weights)

Learned slots are m extra keys and values per kv head that every query sees, in both directions. Both enter the
window part as ``Sinks``: a few extra candidate keys of every tile, each with the key position from which query on
it is visible (slots: always), one softmax with the window's (a softmax row's stabiliser m_i is the maximum over
window, sinks and slots). A sink is attended through its slot by every query from its own position on, inside the
window too: the window and the kernel part read the sinks as padding (``Sinks.rest``), so each is counted once and
both parts read one [v, 1] (no second copy for the kernel part). Decoding keeps the s sinks beside the w window
keys (``RecurrentState.sink_k``): constant size.

Where the sinks are scored (``sink_position``): the keys arrive rotated by RoPE at their own positions 0..s-1, so a
query at position 8,000 scores them as if they were 8,000 tokens away, a role the model never saw them in. With
'window' (StreamingLLM's positions within the cache, its Section 3.2) the sink slots are scored by the query
re-rotated to position P_i = min(p_i, w + s - 1) (``Sinks.q``, ``rotary.RopeRotation``), so sink j sits w + s - 1 - j
positions before it, just beyond the window's oldest key; the window's keys, the learned slots and the kernel part keep
the real query. p_i counts the real keys before query i in its row (``sink_shifts``): the distance from the row's
first real key, which is what transformers' position_ids give it whenever a row's real tokens have consecutive
positions (generate's cumsum(mask) - 1, a forward's arange, left or right padded) and which left padding does not
move. A query with p_i <= w + s - 1 is not rotated: the sinks still in its window are scored as window keys were.
``sink_span`` S > w + s - 1 moves the sinks further out: P_i = min(p_i, S), so sink j sits up to S - j positions
before the query (between StreamingLLM's place and the sinks' own positions, 'own'); the span used is
``PolyAttnConfig.resolved_sink_span`` (S, or w + s - 1 when sink_span is 0).

Linear time: the far part is the ordinary causal product with queries shifted by w
(``lt(phi(Q)[w:], phi(K)[:-w]) V[:-w]``: row i sums keys j <= i - w), so it runs on every
backend of ``backend.lt_product``; the window is computed in tiles of w queries against
their 2w (bidirectional 3w) candidate keys: O(n w d) time, O(n w) memory per head (on the
'triton' backend, ``ops/triton/local.py`` instead: nothing n x w stored).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn import functional as F

from .backend import lt_product

__all__ = ["OUTSIDE", "Sinks", "first_true", "gather_keys", "keep_sinks", "shifted_lt", "sink_flags", "sink_shifts",
           "slot_scores", "window_scores", "window_tiles"]

# The position of a ``Sinks`` slot that has none: learned slots sit at -OUTSIDE (every query sees them), empty
# sink slots at +OUTSIDE (no query does). Sequences and windows stay far below 2**30 keys.
OUTSIDE = 2**30


@dataclass
class Sinks:
    """The keys a windowed call attends exactly besides each query's window, under the window's normaliser.

    ``k`` (B, Hkv, 1, E, d): the model's own keys (sinks) or learned slots; ``v`` (B, Hkv, 1, E, e + 1): their
    [v, 1], zero rows at empty slots; ``pos`` (B, E) int64: slot u is visible to the query at key position i of
    the call when pos_u <= i (causal: the sink's own position; learned slots and the sinks a decoding state kept at
    -OUTSIDE, empty slots at +OUTSIDE). ``flags`` (B or 1, n) bool or None: which of the call's own n keys are sinks;
    the window and the kernel part read them as padding (``rest``), their slots stand in for them.
    ``q`` (B, Hkv, G, Lq, d) or None: the call's queries re-rotated to where they score the sinks
    (``sink_position='window'``, RoPE models), used for every slot from ``learned`` on (the learned slots come first
    and are not positions: the real queries score them); None: the real queries score every slot.
    """

    k: torch.Tensor
    v: torch.Tensor
    pos: torch.Tensor
    flags: torch.Tensor | None = None
    q: torch.Tensor | None = None
    learned: int = 0

    def rest(self, mask: torch.Tensor | None) -> torch.Tensor | None:
        """The key padding mask (B, n) or None of what the window and the kernel part read: the real keys that are
        not sinks."""
        if self.flags is None:
            return mask
        return ~self.flags if mask is None else mask & ~self.flags

    def visible(self, qpos: torch.Tensor) -> torch.Tensor:
        """(B, 1, 1, *qpos.shape, E) bool: which slots the queries at key positions ``qpos`` see."""
        pos = self.pos.view(self.pos.shape[0], 1, 1, *(1,) * qpos.dim(), self.pos.shape[-1])
        return pos <= qpos.unsqueeze(-1)


def sink_shifts(key_mask: torch.Tensor | None, lq: int, lk: int, seen: int | torch.Tensor, span: int,
                device) -> torch.Tensor:
    """(B or 1, lq) int64: the rotation delta_i = min(0, span - p_i) (``span``: ``PolyAttnConfig.resolved_sink_span``,
    w + s - 1 unless ``sink_span`` is set) that moves each query of a causal call to where it scores the sinks, p_i =
    the real keys of its row before it: ``seen`` (an int, or (B,)) of the calls before, then the call's own keys
    (``key_mask`` (B, lk), None: all real) before query i's key lk - lq + i (rows bottom-right aligned)."""
    if key_mask is None:
        before = torch.arange(lk - lq, lk, device=device).unsqueeze(0)
    else:
        real = key_mask.long()
        before = (real.cumsum(-1) - real)[:, lk - lq :]
    before = before + (seen.view(-1, 1) if isinstance(seen, torch.Tensor) else seen)
    return (span - before).clamp(max=0)


def slot_scores(q: torch.Tensor, k: torch.Tensor, q_sinks: torch.Tensor | None = None, learned: int = 0):
    """q . k over the slots k (..., E, d) for queries q (..., n, d): (..., n, E). With ``q_sinks`` (q's shape) the
    slots from ``learned`` on are scored by q_sinks instead (``Sinks.q``)."""
    kt = k.transpose(-1, -2)
    if q_sinks is None:
        return torch.matmul(q, kt)
    return torch.cat([torch.matmul(q, kt[..., :learned]), torch.matmul(q_sinks, kt[..., learned:])], dim=-1)


def sink_flags(mask: torch.Tensor | None, n: int, need: int | torch.Tensor, device) -> torch.Tensor:
    """(B or 1, n) bool: the first ``need`` real keys of each row (``mask`` (B, n) False at padded keys; None:
    every key real). ``need``: an int, or (B,) for rows that lack different numbers of sinks."""
    real = torch.ones(1, n, dtype=torch.bool, device=device) if mask is None else mask
    if isinstance(need, torch.Tensor):
        need = need[:, None]
    return real & (real.cumsum(-1) <= need)


def first_true(flags: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(index, found), both (B, count): where the first ``count`` True entries of each row of ``flags`` (B, L)
    are, in order; index 0 and found False beyond a row's last one."""
    cum = flags.long().cumsum(-1)
    want = torch.arange(1, count + 1, device=flags.device).expand(flags.shape[0], count).contiguous()
    idx = torch.searchsorted(cum, want)  # the leftmost position where the running count reaches t: the t-th True
    found = idx < flags.shape[-1]
    return torch.where(found, idx, 0), found


def gather_keys(x: torch.Tensor, idx: torch.Tensor, dim: int) -> torch.Tensor:
    """Rows ``idx`` (B, count) of x along ``dim`` (x's batch may be 1): (B, ..., count, ...) with the rest of x."""
    x = x.expand(idx.shape[0], *x.shape[1:])
    shape = [1] * x.dim()
    shape[0], shape[dim] = idx.shape[0], idx.shape[1]
    size = list(x.shape)
    size[dim] = idx.shape[1]
    return x.gather(dim, idx.view(shape).expand(size))


def keep_sinks(kept_k, kept_v, kept_mask, k: torch.Tensor, v: torch.Tensor, leaving: torch.Tensor, count: int):
    """A decoding state's sink slots (k, v (B, Hkv, count, d), filled (B, count)) after the keys k, v (B, Hkv, L, d)
    leave the window, ``leaving`` (B or 1, L) marking the sinks among them: the kept slots (None: none yet), then
    the new sinks, in order."""
    leaving = leaving.expand(k.shape[0], -1)
    if kept_k is not None:
        k, v = torch.cat([kept_k.to(k.dtype), k], dim=2), torch.cat([kept_v.to(v.dtype), v], dim=2)
        leaving = torch.cat([kept_mask, leaving], dim=1)
    idx, found = first_true(leaving, count)
    return gather_keys(k, idx, 2), gather_keys(v, idx, 2), found


def shifted_lt(fq: torch.Tensor, fk: torch.Tensor, vext: torch.Tensor, shift: int, block: int, square: bool,
               backend: str = "auto", tf32: bool | None = None, decay: torch.Tensor | None = None) -> torch.Tensor:
    """Row i = sum_{j <= i - shift} phi(q_i).phi(k_j) vext_j (zero for i < shift), times exp(G_i - G_j) with
    ``decay`` = G (..., n), the cumulative log-decays of the keys (non-increasing; leading dims broadcasting like
    fk's and vext's): the product's qlog = G[shift:], klog = G[:n - shift] (``backend.lt_product``).

    fq (..., n, f), fk (..., n, f), vext (..., n, e), broadcastable leading dims.
    """
    n = fq.shape[-2]
    lead = torch.broadcast_shapes(fq.shape[:-2], fk.shape[:-2], vext.shape[:-2])
    if shift >= n:
        # Every key lies inside the window: the far part is empty, yet it stays in the autograd graph through a
        # sum over zero rows of each input (exactly 0 forward, zero gradients backward), so the kernel's
        # parameters get a zero gradient instead of none. DDP's reducer waits for every parameter each step
        # ("Expected to have finished reduction ... parameters that were not used in producing loss" at
        # context <= window), and an attention-transfer loss of such layers had no grad_fn at all. Chosen over
        # DDP's find_unused_parameters, which walks the autograd graph on every step of every run to serve
        # this one case and would still leave the transfer loss without a grad_fn.
        empty = fq[..., :0, :].sum() + fk[..., :0, :].sum() + vext[..., :0, :].sum()
        if decay is not None:  # the decay / gate parameters too
            empty = empty + decay[..., :0].sum()
        return vext.new_zeros(*lead, n, vext.shape[-1]) + empty.to(vext.dtype)
    logs = None if decay is None else (decay[..., shift:], decay[..., : n - shift])
    out = lt_product(fq[..., shift:, :], fk[..., : n - shift, :], vext[..., : n - shift, :], block, True, square,
                     backend, tf32, decay=logs)
    return F.pad(out, (0, 0, shift, 0))


def window_tiles(x: torch.Tensor, window: int, causal: bool) -> torch.Tensor:
    """Candidate keys of each tile of ``window`` queries: (..., tiles, span, d).

    Tile t holds queries [t w, (t+1) w); its candidates are keys [(t-1) w, (t+1) w) when
    causal, [(t-1) w, (t+2) w) otherwise (zero-padded at both ends). A strided view: no copy
    until the matmul reads it.
    """
    n = x.shape[-2]
    tiles = -(-n // window)
    after = tiles * window - n + (0 if causal else window)
    padded = F.pad(x, (0, 0, window, after))
    span = 2 * window if causal else 3 * window
    return padded.unfold(-2, span, window).transpose(-1, -2)


def window_scores(q: torch.Tensor, k: torch.Tensor, window: int, causal: bool, scale: float,
                  key_mask: torch.Tensor | None, sinks: Sinks | None = None):
    """Scores s q.k of every query against its tile's candidate keys, and which are in its window.

    q (B, Hkv, G, n, d), k (B, Hkv, 1, n, d), key_mask (B, n) bool or None.
    Returns scores (B, Hkv, G, tiles, w, span) and allowed (broadcastable bool): j in W(i),
    0 <= j < n and not padded. With ``sinks`` their E slots follow the span's candidates in both
    (last dim span + E; allowed as ``Sinks.visible``; scored by ``Sinks.q`` where given, aligned with q): one softmax
    over both (``key_mask`` is then ``Sinks.rest``, which leaves the sinks to their slots).
    """
    n = q.shape[-2]
    tiles = -(-n // window)

    def query_tiles(x):
        return F.pad(x, (0, 0, 0, tiles * window - n)).unflatten(-2, (tiles, window)) * scale

    qt = query_tiles(q)
    kt = window_tiles(k, window, causal)
    scores = torch.matmul(qt, kt.transpose(-1, -2))
    span = kt.shape[-2]
    qpos = torch.arange(tiles * window, device=q.device).view(tiles, window, 1)
    kpos = (torch.arange(tiles, device=q.device).view(tiles, 1, 1) * window - window
            + torch.arange(span, device=q.device).view(1, 1, span))
    dist = qpos - kpos
    allowed = (dist < window) & (kpos >= 0) & (kpos < n) & (qpos < n)
    allowed = allowed & ((dist >= 0) if causal else (dist > -window))
    if key_mask is not None:
        km = window_tiles(key_mask[:, None, None, :, None].to(q.dtype), window, causal)[..., 0] > 0
        allowed = allowed & km.unsqueeze(-2)
    if sinks is not None:
        # (B, Hkv, G, tiles, w, E): small
        extra = slot_scores(qt, sinks.k.unsqueeze(3), None if sinks.q is None else query_tiles(sinks.q), sinks.learned)
        seen = sinks.visible(qpos[..., 0]) & (qpos < n)
        lead = torch.broadcast_shapes(allowed.shape[:-1], seen.shape[:-1])
        scores = torch.cat([scores, extra], dim=-1)
        allowed = torch.cat([allowed.expand(*lead, span), seen.expand(*lead, seen.shape[-1])], dim=-1)
    return scores, allowed
