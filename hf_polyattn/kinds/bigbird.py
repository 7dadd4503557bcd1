"""BigBird block-sparse attention (Zaheer et al. 2020, "Big Bird: Transformers for Longer Sequences",
arXiv:2007.14062).

Keys and queries are cut into blocks of ``block`` tokens at absolute positions (block ``c`` holds
positions ``c * block .. (c + 1) * block - 1``). A query in block ``qb`` attends, with an exact
softmax, to the keys of the union (each key counted once) of

* the ``global_blocks`` first blocks (the global tokens: every query reads them);
* a sliding window of ``window_blocks`` blocks (odd; ``w = window_blocks // 2``): blocks ``qb - w .. qb + w``,
  causal: ``qb - w .. qb``;
* ``random_blocks`` random key blocks, outside the window and the global blocks, drawn deterministically
  from the layer seed and ``qb``: causal from the earlier blocks ``global_blocks .. qb - w - 1`` (so a row
  never depends on the sequence length), bidirectional from every block of the sequence up to its last
  unpadded key.

The queries of the global blocks attend to every key (bidirectional) or to every earlier key (causal: the
global keys are only visible to later queries and global queries still attend causally; their causal set is
the global blocks, which the sparse path covers). Causal also keeps ``key <= query`` inside the blocks.

What padding does: padded keys contribute nothing. A causal row depends only on its absolute position and
the keys up to it, so right padding leaves every unpadded row unchanged; bidirectional rows draw their random
blocks among the blocks up to the last unpadded key, so a right-padded row equals the row unpadded too. Left
padding shifts the absolute positions (the block boundaries and the global tokens move): a left-padded row is
a valid BigBird row of the shifted sequence, not the row unpadded.

Cost: every non-global query block reads its window (a strided view of the keys: consecutive blocks, no copy)
and its global and random blocks (gathered per query block), one softmax over both: O(n * selected_blocks *
block * D) time, processed in chunks of query blocks (a few MiB of scores each); the global query rows
(bidirectional) are dense, O(n) each. Decoding keeps every key (the base class) and recomputes the new row
exactly as in a full call.
"""

from __future__ import annotations

import math
import warnings

import torch

from ..ops.base import KVCacheAttention
from ..registry import KindSpec, Option, register_kind

__all__ = ["BigBirdAttention", "bigbird_reference"]

_CHUNK_ELEMENTS = 1 << 22  # scores per chunk of query blocks (16 MiB in float32)
_CACHE_LIMIT = 1 << 16


def _masked_softmax(scores: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Softmax over the allowed entries of the last axis (rows with none give weights 0)."""
    scores = scores.masked_fill(~allowed, float("-inf"))
    top = scores.amax(dim=-1, keepdim=True).detach()
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    p = torch.exp(scores - top)
    den = p.sum(dim=-1, keepdim=True)
    return p / torch.where(den > 0, den, torch.ones_like(den))


_WARNED_LEFT_PADDING = False


def _warn_if_left_padded(mask: torch.Tensor) -> None:
    """Blocks, global tokens and random blocks sit at absolute positions: say so once when left padding moves them
    (batched generation left-pads its prompts: such a row differs from the same prompt alone)."""
    global _WARNED_LEFT_PADDING
    if not _WARNED_LEFT_PADDING and bool((~mask[:, 0]).any()):
        _WARNED_LEFT_PADDING = True
        warnings.warn("bigbird with left padding: its blocks, global tokens and random blocks are placed at absolute "
                      "positions, so a left-padded row is computed as a different (shifted) BigBird row than the same "
                      "row unpadded. Pad on the right for padding-invariant outputs.", stacklevel=4)


class BigBirdAttention(KVCacheAttention):
    """BigBird: global + sliding-window + random key blocks, exact softmax on the selected keys."""

    def __init__(self, config, num_heads: int, head_dim: int, num_kv_heads: int | None = None, layer_idx: int = 0):
        super().__init__(config, num_heads, head_dim, num_kv_heads, layer_idx)
        opts = config.options
        self.block = int(opts["block"])
        self.window_blocks = int(opts["window_blocks"])
        self.global_blocks = int(opts["global_blocks"])
        self.random_blocks = int(opts["random_blocks"])
        self._random_cache: dict[tuple[int, int], tuple[int, ...]] = {}

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, block={self.block}, window_blocks={self.window_blocks}, "
                f"global_blocks={self.global_blocks}, random_blocks={self.random_blocks}")

    # -- the block sets -------------------------------------------------------------------------------------------
    def random_key_blocks(self, qb: int, num_blocks: int | None) -> tuple[int, ...]:
        """The random key blocks of query block ``qb``: ``num_blocks=None`` for causal (drawn among the earlier
        blocks before the window), else bidirectional among ``num_blocks`` blocks. Deterministic in the layer
        seed and ``qb`` (and ``num_blocks``); never a window or global block."""
        r, g, w = self.random_blocks, self.global_blocks, self.window_blocks // 2
        key = (qb, -1 if num_blocks is None else num_blocks)
        hit = self._random_cache.get(key)
        if hit is not None:
            return hit
        n = qb if num_blocks is None else num_blocks
        cands = torch.arange(g, max(g, qb - w if num_blocks is None else n))
        if num_blocks is not None:
            cands = cands[(cands - qb).abs() > w]
        if r == 0 or cands.numel() == 0:
            picked: tuple[int, ...] = ()
        else:
            gen = torch.Generator().manual_seed((self.seed * 0x9E3779B1 + qb * 2654435761 + 12345) % (2**63 - 1))
            scores = torch.rand(n, generator=gen, dtype=torch.float64)[cands]
            order = torch.argsort(scores, descending=True, stable=True)[:r]
            picked = tuple(sorted(int(c) for c in cands[order]))
        if len(self._random_cache) >= _CACHE_LIMIT:
            self._random_cache.clear()
        self._random_cache[key] = picked
        return picked

    def _far_table(self, qbs: range, num_blocks: list[int] | None, device) -> torch.Tensor:
        """(T, len(qbs), F) the key blocks outside the window (global, random), -1 = none: one table (T=1) for
        causal (``num_blocks=None``), else one per entry of ``num_blocks`` (the blocks of each batch row)."""
        w = self.window_blocks // 2
        tables = []
        for nb in ([None] if num_blocks is None else num_blocks):
            rows = []
            for qb in qbs:
                far = set(range(self.global_blocks)) | set(self.random_key_blocks(qb, nb))
                rows.append(sorted(c for c in far if abs(c - qb) > w and (c < qb if nb is None else c < nb)))
            width = max(1, max(len(r) for r in rows))
            tables.append(torch.tensor([r + [-1] * (width - len(r)) for r in rows], dtype=torch.long).view(-1, width))
        width = max(t.shape[1] for t in tables)
        tables = [torch.nn.functional.pad(t, (0, width - t.shape[1]), value=-1) for t in tables]
        return torch.stack(tables).to(device)

    def _effective_blocks(self, mask: torch.Tensor | None, batch: int, lk: int) -> list[int]:
        """Blocks up to each batch row's last unpadded key (bidirectional random draws)."""
        if mask is None:
            return [math.ceil(lk / self.block)] * batch
        pos = torch.arange(1, lk + 1, device=mask.device)
        last = torch.where(mask, pos, torch.zeros_like(pos)).amax(dim=1)
        return [max(1, math.ceil(int(x) / self.block)) for x in last.tolist()]

    # -- attention ------------------------------------------------------------------------------------------------
    def attend(self, q, k, v, *, causal, scale, mask):
        if mask is not None:
            _warn_if_left_padded(mask)
        lq, lk = q.shape[2], k.shape[2]
        bs = self.block
        nb = math.ceil(lk / bs)
        p0 = lk - lq  # absolute position of the first query (bottom-right aligned)
        first_qb = p0 // bs
        # bidirectional global query rows attend to every key: dense rows
        dense_end = 0 if causal else min(self.global_blocks * bs, lk)
        outs = []
        if p0 < dense_end:
            outs.append(self._dense_rows(q[:, :, : dense_end - p0], k, v, scale, mask))
        sparse_from = max(p0, dense_end)
        if sparse_from < lk:
            qb_start = max(first_qb, sparse_from // bs)
            outs.append(self._sparse_rows(q[:, :, sparse_from - p0:], k, v, causal, scale, mask, sparse_from,
                                          qb_start, nb))
        return torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]

    def _dense_rows(self, q, k, v, scale, mask):
        b, h, n, d = q.shape
        hkv = k.shape[1]
        qg = q.reshape(b, hkv, h // hkv, n, d)
        scores = torch.einsum("bkgid,bkjd->bkgij", qg, k) * scale
        allowed = (torch.ones(b, k.shape[2], dtype=torch.bool, device=q.device) if mask is None else mask)
        p = _masked_softmax(scores, allowed[:, None, None, None, :])
        return torch.einsum("bkgij,bkjd->bkgid", p, v).reshape(b, h, n, d)

    def _sparse_rows(self, q, k, v, causal, scale, mask, pos0, qb_start, nb):
        """Rows of queries at absolute positions pos0 .. lk - 1: the window blocks read as strided views of the
        keys (no copy), the global and random blocks gathered per query block."""
        b, h, n, d = q.shape
        hkv, lk = k.shape[1], k.shape[2]
        groups, bs, w = h // hkv, self.block, self.window_blocks // 2
        dev = q.device
        front = pos0 - qb_start * bs
        back = nb * bs - lk
        nqb = nb - qb_start
        # queries (B, Hkv, nqb, G * bs, D), scaled: one matrix per kv head and query block
        qp = torch.nn.functional.pad(q * scale, (0, 0, front, back)).reshape(b, hkv, groups, nqb, bs, d)
        qp = qp.transpose(2, 3).reshape(b, hkv, nqb, groups * bs, d)
        # window: blocks qb - w .. qb + w (causal .. qb) = (w + 1 + (0 if causal else w)) * bs consecutive keys
        ww = (w + 1 + (0 if causal else w)) * bs
        kw = torch.nn.functional.pad(k, (0, 0, w * bs, back + w * bs)).contiguous()
        vw = torch.nn.functional.pad(v, (0, 0, w * bs, back + w * bs)).contiguous()
        st = kw.stride()
        kwin = kw.as_strided((b, hkv, nqb, ww, d), (st[0], st[1], bs * st[2], st[2], st[3]), qb_start * bs * st[2])
        vwin = vw.as_strided((b, hkv, nqb, ww, d), (st[0], st[1], bs * st[2], st[2], st[3]), qb_start * bs * st[2])
        qpos = torch.arange(qb_start, nb, device=dev)[:, None] * bs + torch.arange(bs, device=dev)  # (nqb, bs)
        wpos = (torch.arange(qb_start, nb, device=dev)[:, None] - w) * bs + torch.arange(ww, device=dev)  # (nqb, ww)
        keep = torch.ones(1, lk, dtype=torch.bool, device=dev) if mask is None else mask
        keep = torch.nn.functional.pad(keep, (0, 1), value=False)  # index lk = outside the sequence
        wok = keep[:, torch.where((wpos >= 0) & (wpos < lk), wpos, lk)][:, :, None, :]  # (1|B, nqb, 1, ww)
        if causal:
            wok = wok & (wpos[:, None, :] <= qpos[:, :, None])  # (1|B, nqb, bs, ww)
        # global + random blocks outside the window, gathered
        eff = None if causal else self._effective_blocks(mask, b, lk)
        if eff is not None and len(set(eff)) == 1:
            eff = eff[:1]  # one table serves every batch row
        far = self._far_table(range(qb_start, nb), eff, dev)  # (1|B, nqb, F)
        nf = far.shape[-1]
        fpos = (far.clamp_min(0)[..., None] * bs + torch.arange(bs, device=dev)).reshape(far.shape[0], nqb, nf * bs)
        fvalid = (far >= 0)[..., None].expand(*far.shape, bs).reshape(far.shape[0], nqb, nf * bs)
        fpos = torch.where(fvalid & (fpos < lk), fpos, lk)
        bsel = torch.arange(keep.shape[0], device=dev)[:, None, None]
        fok = keep[bsel, fpos][:, :, None, :]  # (1|B, nqb, 1, F * bs)
        fpos = fpos.clamp_max(lk - 1)
        low = torch.finfo(q.dtype).min
        wbias = torch.zeros(wok.shape, dtype=q.dtype, device=dev).masked_fill_(~wok, low)
        fbias = torch.zeros(fok.shape, dtype=q.dtype, device=dev).masked_fill_(~fok, low)
        has = wok.any(-1) | fok.any(-1)  # (1|B, nqb, bs|1): rows without any key give 0
        step = max(1, _CHUNK_ELEMENTS // max(1, b * h * bs * (ww + nf * bs)))
        outs = []
        for c0 in range(0, nqb, step):
            c1 = min(nqb, c0 + step)
            nc = c1 - c0
            qc = qp[:, :, c0:c1]
            s1 = torch.matmul(qc, kwin[:, :, c0:c1].transpose(-1, -2)).view(b, hkv, nc, groups, bs, ww)
            s1 = s1.add_(wbias[:, None, c0:c1, None])
            idx = fpos[:, c0:c1]
            if far.shape[0] == 1:
                kf, vf = k[:, :, idx[0]], v[:, :, idx[0]]  # (B, Hkv, nc, F * bs, D)
            else:
                kf = torch.stack([k[i][:, idx[i]] for i in range(b)])
                vf = torch.stack([v[i][:, idx[i]] for i in range(b)])
            s2 = torch.matmul(qc, kf.transpose(-1, -2)).view(b, hkv, nc, groups, bs, nf * bs)
            s2 = s2.add_(fbias[:, None, c0:c1, None])
            top = torch.maximum(s1.amax(-1, keepdim=True), s2.amax(-1, keepdim=True)).detach()
            p1 = s1.sub_(top).exp_()
            p2 = s2.sub_(top).exp_()
            den = p1.sum(-1, keepdim=True) + p2.sum(-1, keepdim=True)
            num = (torch.matmul(p1.view(b, hkv, nc, groups * bs, ww), vwin[:, :, c0:c1])
                   + torch.matmul(p2.view(b, hkv, nc, groups * bs, nf * bs), vf))
            out = num.view(b, hkv, nc, groups, bs, d) / den
            hc = has[:, c0:c1]
            if not bool(hc.all()):
                out = out * hc[:, None, :, None, :, None].to(out.dtype)
            outs.append(out)
        out = torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]
        out = out.permute(0, 1, 3, 2, 4, 5).reshape(b, h, nqb * bs, d)
        return out[:, :, front: front + n]


def bigbird_reference(module: BigBirdAttention, q, k, v, *, causal: bool, scaling: float | None = None,
                      key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Naive BigBird: the dense (Lq, Lk) mask of the definition (module docstring), one masked softmax."""
    b, h, lq, d = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(d) if scaling is None else float(scaling)
    bs, g = module.block, module.global_blocks
    nb = math.ceil(lk / bs)
    keep = torch.ones(b, lk, dtype=torch.bool) if key_padding_mask is None else key_padding_mask.cpu()
    allowed = torch.zeros(b, lq, lk, dtype=torch.bool)
    for bi in range(b):
        valid = [j for j in range(lk) if keep[bi, j]]
        num_blocks = None if causal else max(1, math.ceil((max(valid) + 1 if valid else 0) / bs))
        for i in range(lq):
            p = lk - lq + i
            qb = p // bs
            if qb < g:
                blocks = set(range(nb))  # a global query reads every key (causal: every earlier key)
            else:
                w = module.window_blocks // 2
                blocks = set(range(g)) | set(range(qb - w, qb + (0 if causal else w) + 1))
                blocks |= set(module.random_key_blocks(qb, num_blocks))
            for j in range(lk):
                if j // bs in blocks and keep[bi, j] and (not causal or j <= p):
                    allowed[bi, i, j] = True
    allowed = allowed.to(q.device)
    kk = k.repeat_interleave(h // hkv, dim=1)
    vv = v.repeat_interleave(h // hkv, dim=1)
    scores = (q @ kk.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    top = scores.amax(dim=-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    p = torch.exp(scores - top)
    den = p.sum(dim=-1, keepdim=True)
    return torch.where(den > 0, (p @ vv) / torch.where(den > 0, den, torch.ones_like(den)), torch.zeros_like(q))


def _validate(config) -> None:
    wb = config.options["window_blocks"]
    if wb % 2 == 0:
        raise ValueError(f"window_blocks must be odd (the own block and as many on each side: 1, 3, 5, ...), got {wb}")


def _label(config) -> str:
    o = config.options
    return f"block={o['block']}, window={o['window_blocks']}, global={o['global_blocks']}, random={o['random_blocks']}"


register_kind(KindSpec(
    name="bigbird",
    module=BigBirdAttention,
    title="BigBird block-sparse attention (Zaheer et al. 2020, arXiv:2007.14062)",
    reference=bigbird_reference,
    causal=True,
    bidirectional=True,
    linear_time=True,
    fields=("seed",),
    options={
        "block": Option(64, "tokens per block (keys and queries are cut into blocks at absolute positions)",
                        minimum=1, maximum=1 << 16),
        "window_blocks": Option(3, "sliding-window blocks, odd: the own block and (window_blocks - 1) / 2 on each "
                                   "side (causal: the own block and the earlier ones)", minimum=1, maximum=1 << 12),
        "global_blocks": Option(1, "first blocks whose tokens attend to every key and are read by every query",
                                minimum=0, maximum=1 << 12),
        "random_blocks": Option(3, "random key blocks per query block (causal: earlier blocks only), drawn from "
                                   "the seed", minimum=0, maximum=1 << 12),
    },
    validate=_validate,
    label=_label,
    memory="Generation keeps every key and value, like a softmax KV cache; each new token reads "
           "(global + window + random) blocks of them.",
    cross_attention=False,  # defined within one sequence
    bench={"bigbird-64": {"kind": "bigbird", "options": {"block": 64}}},
))
