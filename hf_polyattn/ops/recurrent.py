"""Recurrent decoding of the kernel kinds: one token against a state (``_decode_step``,
``_decode_window``) and the state after a chunk (``_next_state``)."""

from __future__ import annotations

import torch

from .common import _with_normaliser, read_state
from .local import far_scale
from .sketches import symmetric_square
from .state import RecurrentState
from .window import keep_sinks, sink_flags, slot_scores

__all__ = ["RecurrentMixin"]


class RecurrentMixin:
    """Methods of ``PolyAttention`` for generation with a ``RecurrentState``."""

    def _decode_step(self, q5, k5, v5, mask, scale, state, key, value, raw, sink_q=None):
        """One new token with a recurrent state: O(F d) work, no block machinery.

        q5 is the new query, k5/v5 the unfolded keys (the current block's buffer when local_exact, else just the new
        key) followed by the new one; ``sink_q`` the query re-rotated for the sinks (``Sinks.q``) or None. The
        generic chunk path gives the same numbers (tested) but costs ~5 ms per layer for a single token in small-op
        overheads; this path is a handful of matmuls.
        """
        cfg = self.config
        vext = _with_normaliser(v5, mask)
        logs = self.log_decays(v5, mask)  # from the state's reference key
        q_in, k_in = self._feature_inputs(q5, scale), self._feature_inputs(k5, scale)
        q_log_scale = None
        if self.feature_map.log_scaled:
            fq, q_log_scale = self.feature_map.forward_with_log_scale(q_in, True)
        else:
            fq = self.feature_map(q_in, True)
        local = cfg.resolved_local_kernel
        total = state.length + 1
        if cfg.window:
            return self._decode_window(raw[0], raw[1], k_in, vext, fq, q_log_scale, mask, scale, state, key, value,
                                       total, logs, sink_q)
        if local is None:
            kv = self._fold(state.kv, self.feature_map(k_in, False), vext, logs, k5.shape[3])
            num = torch.matmul(fq, kv)
            return self._normalise(num), RecurrentState(kv, None, None, None, total)
        # exact kernel over the current block (all unfolded keys precede or equal the query)
        x = torch.matmul(q5 * scale, k5.transpose(-1, -2))  # (B, Hkv, G, 1, L)
        allowed = None if mask is None else mask[:, None, None, None, :]
        w, log_far = self.exact_weights(x, allowed, local)
        num = torch.matmul(w, vext)
        if state.kv is not None:
            far = read_state(fq, state.kv, logs)
            scale_far = far_scale(log_far, q_log_scale)
            num = num + (far if scale_far is None else scale_far * far)
        if total % cfg.block_size == 0:  # the block is complete: fold it into the state
            kv = self._fold(state.kv, self.feature_map(k_in, False), vext, logs, k5.shape[3])
            return self._normalise(num), RecurrentState(kv, None, None, None, total)
        raw_k = key if state.k is None else torch.cat([state.k, key], dim=2)
        raw_v = value if state.v is None else torch.cat([state.v, value], dim=2)
        return self._normalise(num), RecurrentState(state.kv, raw_k, raw_v, mask, total)

    def _decode_window(self, q5, k5, k_in, vext, fq, q_log_scale, mask, scale, state, key, value, total, logs=None,
                       sink_q=None):
        """One token with a sliding window: fold the key that leaves the window, exact on the rest.

        The state keeps the last ``window`` raw keys/values (constant size) and the kernel
        state of every key before them; with ``sinks`` the leaving key goes to the state's sink slots
        instead of the kernel state when it is one of its row's first ``sinks`` real keys, and the
        query attends exactly to the sink slots (scored by ``sink_q`` when given: ``Sinks.q``) and the learned slots
        too, under the same normaliser.
        With decay (``logs``: G of the window's keys and the new one, from the state's reference) the state moves
        its reference to the folded key and the query reads it times exp(G_i - G_fold): the product of the gates
        of the keys in its window, recomputed from the values the state keeps (nothing else is stored).
        """
        cfg = self.config
        w = cfg.window
        fold = max(0, k5.shape[3] - w)  # 0 or 1: the key now w positions behind the query
        kv = state.kv
        sink_k, sink_v, sink_mask = state.sink_k, state.sink_v, state.sink_mask
        if fold and cfg.sinks:
            filled = 0 if sink_mask is None else sink_mask.sum(-1)
            leaving = sink_flags(None if mask is None else mask[:, :fold], fold, cfg.sinks - filled, k5.device)
            sink_k, sink_v, sink_mask = keep_sinks(sink_k, sink_v, sink_mask, state.k[:, :, :fold],
                                                   state.v[:, :, :fold], leaving, cfg.sinks)
            # the leaving sink is attended through its slot from now on: its kernel weight is not folded
            kernel_part = (~leaving).to(vext.dtype)[:, None, None, :, None]
            vext = torch.cat([vext[..., :fold, :] * kernel_part, vext[..., fold:, :]], dim=3)
        if fold:
            kv = self._fold(kv, self.feature_map(k_in[..., :fold, :], False), vext, logs, fold)
            if logs is not None:
                logs = logs - logs[..., fold - 1 : fold]  # from the new reference
        kw, vw = k5[..., fold:, :], vext[..., fold:, :]
        x = torch.matmul(q5 * scale, kw.transpose(-1, -2))  # (B, Hkv, G, 1, <= w)
        allowed = None if mask is None else mask[:, None, None, None, fold:]
        # the learned slots and the sinks that left the window (a sink still inside it is one of its keys)
        sinks = self._window_sinks(k5, vext[..., :-1], mask, None if sink_k is None else (sink_k, sink_v, sink_mask),
                                   in_sequence=False, sink_q=sink_q)
        if sinks is not None:
            x = torch.cat([x, slot_scores(q5 * scale, sinks.k, None if sinks.q is None else sinks.q * scale,
                                          sinks.learned)], dim=-1)
            if allowed is None:
                allowed = torch.ones(1, 1, 1, 1, kw.shape[3], dtype=torch.bool, device=x.device)
            seen = sinks.visible(torch.full((1,), k5.shape[3] - 1, device=x.device))  # (B, 1, 1, 1, E)
            allowed = torch.cat([allowed.expand(seen.shape[0], -1, -1, -1, -1), seen], dim=-1)
        wts, log_far = self.exact_weights(x, allowed, cfg.resolved_local_kernel)
        num = torch.matmul(wts[..., : kw.shape[3]], vw)
        if sinks is not None:
            num = num + torch.matmul(wts[..., kw.shape[3] :], sinks.v)
        if kv is not None:
            far = read_state(fq, kv, logs)
            scale_far = far_scale(log_far, q_log_scale)
            if scale_far is not None:
                far = scale_far * far
            if cfg.window_mix:
                far = self.window_mix.abs().to(far.dtype) * far
            num = num + far
        raw_k = key if state.k is None else torch.cat([state.k, key], dim=2)
        raw_v = value if state.v is None else torch.cat([state.v, value], dim=2)
        new_mask = None if mask is None else mask[:, fold:]
        return self._normalise(num), RecurrentState(kv, raw_k[:, :, fold:], raw_v[:, :, fold:], new_mask, total,
                                                    sink_k, sink_v, sink_mask)

    @staticmethod
    def _fold(kv, feats, vext, logs, fold: int):
        """The state ``kv`` (None: empty) after the first ``fold`` keys, features ``feats`` (..., >= fold, F) and
        values [v 1] ``vext``, are added to it: kv + sum_j phi(k_j)^T [v_j 1]. With decay (``logs``: G of these keys
        from kv's reference key) the result is referenced at key fold - 1: kv exp(G_{fold-1}) + sum_j
        exp(G_{fold-1} - G_j) phi(k_j)^T [v_j 1], every exponent <= 0."""
        vals = vext[..., :fold, :]
        if logs is not None:
            ref = logs[..., fold - 1 : fold]
            vals = vals * torch.exp(ref - logs[..., :fold]).unsqueeze(-1)
            kv = None if kv is None else kv * torch.exp(ref).unsqueeze(-1)
        add = torch.matmul(feats[..., :fold, :].transpose(-1, -2), vals)
        return add if kv is None else kv + add

    def _next_state(self, state, key, value, key_mask, k5, v5, mask, fk, vext, path, flags=None) -> RecurrentState:
        """The state after a chunk: keys k5 (the state's kept keys, then the chunk's) and their [v, 1] ``vext`` as
        the kernel part read them; ``flags`` (B or 1, len) the sinks among those keys (``Sinks.flags``)."""
        total = state.length + key.shape[2]
        if path == "quadratic":
            keep = k5.shape[3]
        elif self.config.window:
            keep = min(self.config.window, total)  # the window's raw keys; everything older is folded
        elif self.config.resolved_local_kernel is not None:
            keep = total % self.config.block_size
        else:
            keep = 0
        fold = fk[0].shape[3] - keep if fk is not None else 0
        kv = state.kv
        if fold > 0:
            feats = fk[0][..., :fold, :]
            if len(fk) > 2 and fk[2]:  # the kernels applied the feature map on load: fk[0] is its input (_linear)
                feats = self.feature_map(feats, False)
            feats = symmetric_square(feats) if fk[1] else feats
            kv = self._fold(kv, feats, vext, self.log_decays(v5, mask), fold)
        if keep == 0:
            return RecurrentState(kv, None, None, None, total)
        # Store raw keys/values: the forward re-applies the LayerNorm to the buffer.
        raw_k = torch.cat([state.k, key], dim=2) if state.k is not None else key
        raw_v = torch.cat([state.v, value], dim=2) if state.v is not None else value
        new_mask = None
        if mask is not None:
            new_mask = mask[:, -keep:]
        sinks = state.sink_k, state.sink_v, state.sink_mask
        drop = raw_k.shape[2] - keep  # the keys leaving the window: the sinks among them are kept apart
        if flags is not None and drop > 0:
            sinks = keep_sinks(*sinks, raw_k[:, :, :drop], raw_v[:, :, :drop], flags[:, :drop], self.config.sinks)
        return RecurrentState(kv, raw_k[:, :, -keep:], raw_v[:, :, -keep:], new_mask, total, *sinks)
