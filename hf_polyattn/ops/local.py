"""The exact local part of the kernel kinds: diagonal blocks (``local_exact``) and the sliding window.

One weight rule for all four places it is used (blocks, window, and their two decode steps):
``exact_weights`` gives softmax weights exp(x - m) with the row stabiliser m >= 0 (the kernel
part is then multiplied by exp(-m)), or this config's polynomial; ``far_scale`` combines that
factor with FAVOR+'s per-query feature scale.
"""

from __future__ import annotations

import warnings
from dataclasses import replace

import torch
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from .backend import _is_auto, resolve_backend
from .common import _with_normaliser, normalised_sum, read_state, soft_cap, to_work
from .flex import flex_window
from .sketches import symmetric_square
from .window import OUTSIDE, Sinks, first_true, gather_keys, shifted_lt, sink_flags, window_scores, window_tiles
from .window_flash import flash_window_available, window_flash

__all__ = ["LocalExactMixin", "far_scale"]

# Diagonal blocks per rematerialised group of the exact local part. CPU: 8 (measured, see
# _local_exact). Accelerators: 64, so 32k tokens at b=256 take 2 groups (~40 launches each way)
# instead of 16; a group's transient scores are 64 b^2 floats per head (16 MiB at b=256).
# Chosen to cut launches, not yet measured on a GPU (recipes/results/PENDING.md).
_LOCAL_GROUP = {"cpu": 8}
_LOCAL_GROUP_ACCELERATOR = 64


_WARNED_LEFT_PADDING = False


def _warn_if_misaligned_left_padding(mask: torch.Tensor, block: int) -> None:
    """local_exact blocks sit at absolute positions: say so once when left padding shifts them."""
    global _WARNED_LEFT_PADDING
    if _WARNED_LEFT_PADDING:
        return
    pads = (~mask).cumprod(dim=1).sum(dim=1)  # leading padded keys per row
    if bool(((pads % block) != 0).any()):
        _WARNED_LEFT_PADDING = True
        warnings.warn(
            "local_exact with left padding that is not a multiple of block_size: the exact diagonal blocks are "
            "aligned to absolute positions, so a left-padded row is computed with shifted block boundaries and "
            "differs from the same row unpadded. Pad on the right (or by a multiple of block_size) for "
            "padding-invariant outputs.",
            stacklevel=3,
        )


def _aligned(q_sinks: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    """``Sinks.q`` (the call's Lq queries) with the rows of ``qs`` (causal rows bottom-right aligned: Lk rows when a
    call has fewer queries than keys, the first Lk - Lq zero like qs's)."""
    pad = qs.shape[-2] - q_sinks.shape[-2]
    return F.pad(q_sinks, (0, 0, pad, 0)) if pad else q_sinks


def far_scale(log_far: torch.Tensor | None, q_log_scale: torch.Tensor | None) -> torch.Tensor | None:
    """exp(log_far + q_log_scale): the factor on the kernel part that puts it on the exact weights' scale
    (None: 1). FAVOR+ query features come divided by exp(c) (q_log_scale = c)."""
    if q_log_scale is not None:
        log_far = q_log_scale if log_far is None else log_far + q_log_scale
    return None if log_far is None else torch.exp(log_far)


class LocalExactMixin:
    """Methods of ``PolyAttention`` for the exact local part (blocks and window)."""

    def _fused_exact(self, q: torch.Tensor) -> bool:
        """Whether this call's exact softmax part may go through PyTorch's fused CPU kernel (ops/window_flash.py):
        inference (no gradient recorded), float32 on the CPU, a softmax exact part and no soft-cap (the kernel takes
        no score_mod: a capped layer's scores keep their tensors)."""
        return (not torch.is_grad_enabled() and flash_window_available(q)
                and self.config.resolved_local_kernel == "softmax" and self.softcap is None)

    def exact_weights(self, x: torch.Tensor, allowed: torch.Tensor | None, kernel: str):
        """(weights, log_far) of the exact local part from scores x = s q.k, ``allowed`` a bool mask
        broadcastable to x (None: all). softmax: exp(x - m) with m = the row max clamped at 0, detached
        (the ratio does not depend on m; a row with no visible key gets m = 0, exp(-m) = 1, no NaN), and
        log_far = -m; polynomial: this config's polynomial, masked to 0, and log_far None. Scores are soft-capped
        first when the layer has a cap (``softcap``): every exact part's scores pass here."""
        x = soft_cap(x, self.softcap)  # the model's logit soft-capping, before the mask and the weights
        if kernel == "softmax":
            if allowed is not None:
                x = x.masked_fill(~allowed, float("-inf"))
            m = x.amax(dim=-1, keepdim=True).clamp_min(0.0).detach()
            return torch.exp(x - m), -m
        w = self._exact_kernel(x, "polynomial")
        return (w if allowed is None else w.masked_fill(~allowed, 0.0)), None


    def _windowed(self, q5, k5, fq, fk, vext, mask, causal, scale, kv0, q_log_scale, square, tf32=None, sinks=None,
                  logs=None):
        """Sliding-window hybrid (ops/window.py): exact on the previous ``window`` keys, kernel before.

        q5, k5 are the model's own q, k (no projection, no qk LayerNorm): the exact part is the
        model's softmax (or polynomial) on its own scores, as in LoLCATs; fq, fk the features.
        ``sinks``: what the window part attends exactly besides (``ops.window.Sinks``); ``mask`` and ``vext``
        then leave the sinks out (``Sinks.rest``).
        ``logs``: the keys' cumulative log-decays G (causal only), the kernel part's term (i, j) times
        exp(G_i - G_j); the window is exact and undecayed.
        """
        cfg = self.config
        w, block, backend = cfg.window, cfg.block_size, self._layer_backend(q5.device, q5.dtype)
        lq, lk = q5.shape[3], k5.shape[3]
        if causal:
            pad = lk - lq  # bottom-right aligned rows: queries sit at the last lq key positions
            qs, fqs = (F.pad(q5, (0, 0, pad, 0)), F.pad(fq, (0, 0, pad, 0))) if pad else (q5, fq)
            if q_log_scale is not None and pad:
                q_log_scale = F.pad(q_log_scale, (0, 0, pad, 0))
            far = shifted_lt(fqs, fk, vext, w, block, square, backend, tf32, logs)
            if kv0 is not None:
                far = far + read_state(symmetric_square(fqs) if square else fqs, kv0, logs)
        else:
            if lq != lk:
                raise ValueError(f"window={w} with bidirectional attention needs q_len == kv_len (self-attention), "
                                 f"got {lq} and {lk}")
            qs = q5

            def flip(t):
                return t.flip(-2)

            far = shifted_lt(fq, fk, vext, w, block, square, backend, tf32) + flip(
                shifted_lt(flip(fq), flip(fk), flip(vext), w, block, square, backend, tf32))
        loc, far_scale = self._window_local(qs, k5, vext, mask, causal, scale, q_log_scale, tf32, sinks)
        if self.config.window_mix:
            mix = self.window_mix.abs().to(loc.dtype)  # |m|: the kernel part never turns negative
            far_scale = mix if far_scale is None else far_scale * mix
        if far_scale is not None and far_scale.shape[-2] > 1:  # per row (not window_mix alone): the query rows
            far_scale = far_scale[..., lk - lq :, :]
        return normalised_sum(far[..., lk - lq :, :], loc[..., lk - lq :, :], far_scale, self.config.denominator_offset,
                              vext.dtype)

    def _window_local(self, qs, ks, vext, mask, causal, scale, q_log_scale=None, tf32=None, sinks=None):
        """(loc, far scale) of the exact window part (and its ``sinks``, ``mask`` leaving them out): the Triton
        kernels on the 'triton' backend (weights recomputed in their backward), else ``_window_exact``
        rematerialised in backward (the n x 2w scores and weights are not kept); on the 'fla' backend
        FlexAttention (``flex.flex_window``)."""
        if self._layer_backend(qs.device, qs.dtype) == "fla":
            kernel = self.config.resolved_local_kernel
            if kernel != "softmax":
                raise ValueError(f"backend='fla' runs a sliding window through FlexAttention with softmax weights; "
                                 f"local_kernel={kernel!r} needs backend 'triton', 'batched' or 'loop' (or 'auto')")
            if sinks is not None and sinks.q is not None:
                sinks = replace(sinks, q=_aligned(sinks.q, qs))
            loc, log_far = flex_window(qs, ks, vext, mask, causal, scale, self.config.window, sinks, self.softcap)
            return loc, far_scale(log_far, q_log_scale)
        triton = self._local_triton(qs, ks, vext, mask, causal, scale, self.config.resolved_local_kernel,
                                    q_log_scale, tf32, window=self.config.window, sinks=sinks)
        if triton is not None:
            return triton
        qs, ks, vext = to_work(qs, ks, vext)  # half inputs (the Triton path's) compute in fp32 here
        if causal and q_log_scale is None and self._fused_exact(qs):
            # inference on the CPU: the fused kernel on the window's tiles (ops/window_flash.py)
            sink_q = None if sinks is None or sinks.q is None else to_work(_aligned(sinks.q, qs))[0]
            if sinks is not None:
                sinks = replace(sinks, k=to_work(sinks.k)[0], v=to_work(sinks.v)[0])
            loc, log_far = window_flash(qs, ks, vext, mask, self.config.window, scale, sinks, sink_q)
            return loc, torch.exp(log_far)
        sink_k = sink_v = sink_pos = sink_q = None
        if sinks is not None:
            sink_k, sink_v, sink_pos = *to_work(sinks.k, sinks.v), sinks.pos
            if sinks.q is not None:
                (sink_q,) = to_work(_aligned(sinks.q, qs))
        grad = torch.is_grad_enabled() and (
            any(t is not None and t.requires_grad for t in (qs, ks, vext, q_log_scale, sink_k, sink_v, sink_q))
            or any(p.requires_grad for p in self.parameters()))
        args = (qs, ks, vext, mask, causal, scale, q_log_scale, sink_k, sink_v, sink_pos)
        if sink_q is not None:  # a call without re-rotated queries keeps its arguments
            args += (sink_q, sinks.learned)
        return checkpoint(self._window_exact, *args, use_reentrant=False) if grad else self._window_exact(*args)

    def _window_exact(self, qs, ks, vext, mask, causal, scale, q_log_scale, sink_k=None, sink_v=None, sink_pos=None,
                      sink_q=None, learned=0):
        """Exact weights on each query's window (and on the ``Sinks`` given as sink_k, sink_v, sink_pos, scored by
        sink_q from slot ``learned`` on when given) and the factor that puts the far part on their scale (before
        ``window_mix``)."""
        w = self.config.window
        n = qs.shape[3]
        sinks = None if sink_k is None else Sinks(sink_k, sink_v, sink_pos, q=sink_q, learned=learned)
        scores, allowed = window_scores(qs, ks, w, causal, scale, mask, sinks)  # (B, Hkv, G, tiles, w, span [+ E])
        values = window_tiles(vext, w, causal)
        weights, log_far = self.exact_weights(scores, allowed, self.config.resolved_local_kernel)
        span = values.shape[-2]
        loc = torch.matmul(weights[..., :span], values)
        if sinks is not None:  # the slots' weights times their values: (.., tiles, w, E) x (.., 1, E, e + 1)
            loc = loc + torch.matmul(weights[..., span:], sink_v.unsqueeze(3))
        loc = loc.flatten(3, 4)[..., :n, :]
        return loc, far_scale(None if log_far is None else log_far.flatten(3, 4)[..., :n, :], q_log_scale)

    def _window_sinks(self, k5, v5, mask, kept=None, in_sequence=True, sink_q=None) -> Sinks | None:
        """The ``Sinks`` of a windowed call on keys k5, v5 (B, Hkv, 1, L, d: the model's own, after the state's
        window keys), or None without any: the learned slots, the sinks a state kept (``kept`` = its ``sinks``:
        they left the window, every query sees them), and (``in_sequence``) the first real keys of k5 the row
        still lacks as sinks. ``sink_q``: the call's queries re-rotated for the sinks (``Sinks.q``)."""
        cfg = self.config
        b, device = k5.shape[0], k5.device
        parts = []  # (k, [v, 1], pos) of each group of slots
        if cfg.learned_sinks:
            parts.append((self.sink_k.to(k5.dtype).unsqueeze(0), _with_normaliser(self.sink_v.to(v5.dtype)[None], None),
                          torch.full((1, cfg.learned_sinks), -OUTSIDE, device=device)))
        flags = None
        if cfg.sinks:
            filled = 0
            if kept is not None:
                kept_k, kept_v, kept_mask = kept
                parts.append((kept_k.to(k5.dtype).unsqueeze(2), _with_normaliser(kept_v.to(v5.dtype).unsqueeze(2),
                                                                                 kept_mask),
                              torch.where(kept_mask, -OUTSIDE, OUTSIDE)))
                filled = kept_mask.sum(-1)
            if in_sequence:
                flags = sink_flags(mask, k5.shape[3], cfg.sinks - filled, device)
                idx, found = first_true(flags.expand(b, -1), cfg.sinks)
                parts.append((gather_keys(k5, idx, 3), _with_normaliser(gather_keys(v5, idx, 3), found),
                              torch.where(found, idx, OUTSIDE)))
        if not parts:
            return None
        ks, vs, pos = zip(*parts)
        return Sinks(torch.cat([t.expand(b, *t.shape[1:]) for t in ks], dim=3),
                     torch.cat([t.expand(b, *t.shape[1:]) for t in vs], dim=3),
                     torch.cat([t.expand(b, -1) for t in pos], dim=1), flags,
                     q=sink_q, learned=cfg.learned_sinks)

    def _local_exact(self, qs, ks, vext, mask, causal, scale, kernel, q_log_scale=None, tf32=None):
        """The exact diagonal blocks, a group of blocks at a time (``_LOCAL_GROUP``), each group rematerialised.

        Blocks do not interact, so groups are independent. All at once, the (n x b) scores,
        their powers and weights (and their gradients) made a transient peak of ~2000 floats
        per token and head: 481 MiB at n=16k, H=4, b=256 (SDPA: 208 MiB in the same run).
        Per group and recomputed in backward, only the inputs and outputs stay alive.

        On the 'triton' backend (``backend.resolve_backend``: 'auto' on CUDA with triton, or forced)
        one Triton call does every block (``ops.triton.local_blocks_triton``: weights recomputed in
        its backward, nothing b x b stored), except for squared coefficient polynomials
        (``poly_coefficients``) and, under 'auto', head dims beyond the kernels' tiles: those stay here.
        """
        triton = self._local_triton(qs, ks, vext, mask, causal, scale, kernel, q_log_scale, tf32)
        if triton is not None:
            return triton
        qs, ks, vext = to_work(qs, ks, vext)  # half inputs (the Triton path's) compute in fp32 here
        span = _LOCAL_GROUP.get(ks.device.type, _LOCAL_GROUP_ACCELERATOR) * self.config.block_size
        n = ks.shape[3]
        grad = torch.is_grad_enabled() and (
            any(t is not None and t.requires_grad for t in (qs, ks, vext, q_log_scale))
            or any(p.requires_grad for p in self.parameters()))
        locs, scales = [], []
        # one split per input, not a slice per group: a slice's backward writes its gradient into a zero-filled
        # tensor of the whole input's size, 6 such a group (n = 32k, 8 groups: 48 fills of 32 MiB and their sums,
        # ~19% of polysketch-local's forward+backward on 2 cores); a split's backward is one concatenation
        absent = [None] * -(-n // span)
        groups = [absent if t is None else t.split(span, dim=-2) for t in (qs, ks, vext, q_log_scale)]
        groups.append(absent if mask is None else mask.split(span, dim=1))
        for q_g, k_g, v_g, ls_g, m_g in zip(*groups):
            args = (q_g, k_g, v_g, m_g, causal, scale, kernel, ls_g)
            loc, scale_far = checkpoint(self._local_blocks, *args, use_reentrant=False) if grad else \
                self._local_blocks(*args)
            locs.append(loc)
            scales.append(scale_far)
        loc = locs[0] if len(locs) == 1 else torch.cat(locs, dim=3)
        if scales[0] is None:
            return loc, None
        return loc, scales[0] if len(scales) == 1 else torch.cat(scales, dim=3)

    def _local_uses_triton(self, kernel: str, head_dim: int, device: torch.device, dtype: torch.dtype) -> bool:
        """Whether ``_local_triton`` runs the exact local part with ``kernel`` on ``head_dim``-wide q/k and values."""
        cfg = self.config
        if resolve_backend(cfg.backend, device, dtype) != "triton" or (
                kernel != "softmax" and cfg.poly_coefficients is not None):
            return False
        if self.softcap is not None:
            # the Triton kernels form their scores on chip without a cap: a capped layer's exact part runs in
            # PyTorch (exact_weights), the same weights, the kernel part stays on Triton
            return False
        # imported only on the Triton backend: importing triton took ~5 s, paid by a CPU model's first windowed call
        from .triton import LOCAL_MAX_HEAD_DIM

        return head_dim <= LOCAL_MAX_HEAD_DIM or not _is_auto(cfg.backend)

    def _local_triton(self, qs, ks, vext, mask, causal, scale, kernel, q_log_scale, tf32, window=0, sinks=None):
        """(loc, far scale) of the diagonal blocks (``window`` 0) or the sliding window (and its ``sinks``) from the
        Triton kernels (``ops.triton.local_blocks_triton``), or None where they do not apply: another backend,
        squared coefficient polynomials (``poly_coefficients``), or under 'auto' head dims beyond their tiles."""
        cfg = self.config
        if not self._local_uses_triton(kernel, max(qs.shape[-1], vext.shape[-1] - 1), ks.device, ks.dtype):
            return None
        from .triton import local_blocks_triton

        extra = {} if sinks is None else {"sinks": (sinks.k, sinks.v, sinks.pos)}
        if sinks is not None and sinks.q is not None:  # a call without re-rotated queries keeps its arguments
            extra.update(sink_q=_aligned(sinks.q, qs), learned=sinks.learned)
        loc, log_far = local_blocks_triton(qs, ks, vext, cfg.block_size, causal, scale, kernel, mask,
                                           self._exact_power, cfg.alpha, cfg.beta, tf32, window, **extra)
        return loc, far_scale(log_far, q_log_scale)

    def _local_blocks(self, qs, ks, vext, mask, causal, scale, kernel, q_log_scale=None):
        """Exact kernel on the b x b diagonal blocks (query and key rows aligned)."""
        block = self.config.block_size
        n = ks.shape[3]
        n_pad = -(-n // block) * block
        nb = n_pad // block
        qb = F.pad(qs, (0, 0, 0, n_pad - n)).unflatten(3, (nb, block))
        kb = F.pad(ks, (0, 0, 0, n_pad - n)).unflatten(3, (nb, block))
        vb = F.pad(vext, (0, 0, 0, n_pad - n)).unflatten(3, (nb, block))
        x = torch.matmul(qb * scale, kb.transpose(-1, -2))  # (B, Hkv, G, nb, b, b)
        valid = torch.arange(n_pad, device=qs.device) < n
        allowed = valid.view(nb, 1, block)
        if mask is not None:
            allowed = allowed & F.pad(mask, (0, n_pad - n)).view(mask.shape[0], 1, 1, nb, 1, block)
        if causal:
            allowed = allowed & torch.ones(block, block, dtype=torch.bool, device=qs.device).tril()
        w, log_far = self.exact_weights(x, allowed, kernel)
        loc = torch.matmul(w, vb).flatten(3, 4)[..., :n, :]
        return loc, far_scale(None if log_far is None else log_far.flatten(3, 4)[..., :n, :], q_log_scale)
