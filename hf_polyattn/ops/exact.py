"""Exact polynomial attention (kind 'polynomial'): the quadratic path and the tensor-feature path.

``exact_path`` picks one per call ('auto' by flop count and feature budget); both are exact.
"""

from __future__ import annotations

import math

import torch
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from .attention import PolyAttention
from .backend import lt_product
from .common import _int_power, _with_normaliser, soft_cap
from .feature_maps import FeatureMap, PolynomialFeatureMap

__all__ = ["ExactPolynomialAttention"]

_QUADRATIC_CHUNK = 1024  # query rows per rematerialised chunk of the quadratic path
_TENSOR_CHUNK_ELEMENTS = 2**20  # feature elements per row of heads in one chunk of the exact tensor path


class ExactPolynomialAttention(PolyAttention):
    """(s q.k)^p (or ((s q.k + alpha)/beta)^p, or (sum_i a_i (s q.k)^i)^2) attention, exactly."""

    exact_everywhere = True

    def build_feature_map(self, dim: int, seed: int) -> FeatureMap:
        cfg = self.config
        return PolynomialFeatureMap(
            dim, cfg.degree, cfg.alpha, cfg.beta,
            coefficients=(lambda: self.coefficients) if cfg.poly_coefficients is not None else None,
            num_coefficients=len(cfg.poly_coefficients or ()),
        )

    @classmethod
    def scoreless_part(cls, config) -> bool:
        # the tensor path's features phi(q).phi(k) = (q.k)^p form no score; the quadratic path forms every one
        return config.exact_path == "tensor"

    @classmethod
    def softcap_refusal(cls, config, layer_idx: int, num_kv_heads: int, exact_elsewhere: bool = False) -> str | None:
        if config.exact_path == "tensor":
            return ("kind='polynomial' with exact_path='tensor' computes (s q.k)^p through tensor-power features, "
                    "which form no score to soft-cap, so the model's attention logit soft-capping c tanh(score / c) "
                    "cannot be applied: use exact_path='quadratic' or 'auto' (which takes the quadratic path on a "
                    "capped layer)")
        return None

    def choose_path(self, q_len: int, kv_len: int, causal: bool) -> str:
        return self.exact_path(q_len, kv_len, causal)

    def exact_path(self, q_len: int, kv_len: int, causal: bool) -> str:
        """Which exact path the polynomial kind takes ('tensor' or 'quadratic').

        Rule for 'auto': the tensor path (phi = symmetric tensor power, C(d+p-1, p)
        features F) when F <= max_tensor_features and its flop count
        4 (Lq + Lk) F (d + 1) (+ 2 Lq b F for the causal diagonal blocks) is below the
        quadratic one, 4 Lq Lk d (halved when causal). E.g. d=16, p=2: F=136, tensor from
        about Lk=350 on; d=64, p=4: F=766,480, always quadratic.
        """
        cfg = self.config
        if cfg.exact_path != "auto":
            return cfg.exact_path
        if self.softcap is not None:  # c tanh(s q.k / c) needs the scores: only the quadratic path forms them
            return "quadratic"
        feats = self.num_features
        if feats > cfg.max_tensor_features:
            return "quadratic"
        d = self.kernel_dim
        quad = 4 * q_len * kv_len * d * (0.5 if causal else 1.0)
        tensor = 4 * (q_len + kv_len) * feats * (d + 1) + (2 * q_len * cfg.block_size * feats if causal else 0)
        return "tensor" if tensor < quad else "quadratic"

    def _recurrent_path(self) -> str:
        cfg = self.config
        if cfg.exact_path == "quadratic" or (cfg.exact_path == "auto" and (
                self.num_features > cfg.max_tensor_features or self.softcap is not None)):
            return "quadratic"
        return "tensor"

    def decodes_by_step(self, path: str) -> bool:
        return path == "tensor"

    def path_inputs(self, path, q5, k5, v5):
        if path == "tensor" and q5.dtype == torch.float32:
            # Exact tensor-power features cancel: (q.k)^p is a sum of C(d+p-1, p) products of
            # mixed sign, each up to (|q||k|)^p. In float32 that lost 1.2e-4 against a float64
            # reference where the quadratic path loses 6.5e-7, enough to change greedy tokens
            # between cache (this path) and no cache (quadratic). F <= max_tensor_features
            # bounds the float64 cost; the state is float64 too.
            return q5.double(), k5.double(), v5.double()
        return q5, k5, v5

    def run_path(self, path, q5, k5, v5, mask, causal, scale, kv0, raw, tf32=None):
        if path == "quadratic":
            return self._quadratic(q5, k5, v5, mask, causal, scale), None, None, None
        out, kv_end = self._tensor(q5, k5, v5, mask, causal, scale, kv0)
        return out, None, None, kv_end

    def _quadratic(self, q5, k5, v5, mask, causal, scale):
        """Exact polynomial attention in O(Lq Lk) time, query chunks rematerialised in backward.

        Each row's bases are divided by their largest allowed magnitude m before the power
        (weights (b/m)^p <= 1; the factor m^p cancels in the ratio, the denominator offset
        becomes offset / m^p). Without it, degree 16 at q, k entries of 0.01 underflowed every
        weight to 0 in float32 and the safe division returned all-zero rows (40 of 40 in a
        test), a silent wrong answer; degree 8 at 0.003 lost 5% to subnormals.
        """
        lq, lk = q5.shape[3], k5.shape[3]
        vext = _with_normaliser(v5, mask)

        def chunk(qc, start):
            base, p = self._exact_base(soft_cap(torch.matmul(qc * scale, k5.transpose(-1, -2)), self.softcap))
            allowed = torch.ones(base.shape[-2:], dtype=torch.bool, device=qc.device)
            if causal:
                rows = torch.arange(start, start + qc.shape[3], device=qc.device) + (lk - lq)
                allowed = torch.arange(lk, device=qc.device)[None, :] <= rows[:, None]
            if mask is not None:
                allowed = allowed & mask[:, None, None, None, :]
            base = base.masked_fill(~allowed, 0.0)
            # the ratio does not depend on m: detached, as softmax's row max
            m = base.detach().abs().amax(dim=-1, keepdim=True)
            m = torch.where(m > 0, m, torch.ones_like(m))  # a row with no key (or only zero bases)
            return torch.matmul(_int_power(base / m, p), vext), m

        outs, scales = [], []
        for s in range(0, lq, _QUADRATIC_CHUNK):
            qc = q5[..., s : s + _QUADRATIC_CHUNK, :]
            if torch.is_grad_enabled() and (qc.requires_grad or k5.requires_grad or vext.requires_grad
                                            or any(t.requires_grad for t in self.parameters())):
                num, m = checkpoint(chunk, qc, s, use_reentrant=False)
            else:
                num, m = chunk(qc, s)
            outs.append(num)
            scales.append(m)
        num = torch.cat(outs, dim=3)
        offset = self.config.denominator_offset
        if not offset:
            return self._normalise(num)
        m = torch.cat(scales, dim=3)
        # offset / m^p in log space; inf where m^p underflows: then the weights are negligible
        # against the offset and the output is 0, the true value to float precision
        return self._normalise(num, offset * torch.exp(-self._exact_power * torch.log(m)))

    def tensor_chunk(self) -> int:
        """Keys (and queries) per chunk of the exact tensor path: ``_TENSOR_CHUNK_ELEMENTS``
        features per row of heads at most, a multiple of ``block_size``."""
        block = self.config.block_size
        rows = max(1, _TENSOR_CHUNK_ELEMENTS // self.num_features)
        return max(block, rows // block * block)

    def _tensor(self, q5, k5, v5, mask, causal, scale, kv0):
        """Exact polynomial attention in linear time with tensor-power features, chunk by chunk.

        Never more than ``tensor_chunk()`` rows of features at once: forward peak
        ~ (B H chunk F + B Hkv F (D+1)) elements besides inputs and outputs, and each chunk
        is rematerialised in backward, which stores only the per-chunk (F x (D+1)) prefix
        states. All at once the n x F features peaked at 33.8 GB for d=64, p=2 (F=2,080),
        n=32k, H=16 on an H100; at chunk 768 they are 0.8 GB in float64.
        Returns the normalised output and the state after the last key (for the cache).
        """
        lq, lk = q5.shape[3], k5.shape[3]
        vext = _with_normaliser(v5, mask)
        fm, block = self.feature_map, self.config.block_size
        root = math.sqrt(scale)
        size = self.tensor_chunk()
        grad = torch.is_grad_enabled() and (
            any(t.requires_grad for t in (q5, k5, vext)) or any(p.requires_grad for p in self.parameters()))

        def run(fn, *args):
            return checkpoint(fn, *args, use_reentrant=False) if grad else fn(*args)

        def keys(kc, vc):
            return torch.matmul(fm(kc * root, False).transpose(-1, -2), vc)

        if not causal:
            kv = kv0
            for s in range(0, lk, size):
                add = run(keys, k5[..., s : s + size, :], vext[..., s : s + size, :])
                kv = add if kv is None else kv + add

            def read(qc, kv):
                return torch.matmul(fm(qc * root, True), kv)

            num = torch.cat([run(read, q5[..., s : s + size, :], kv) for s in range(0, lq, size)], dim=3)
            return self._normalise(num), kv

        qs = F.pad(q5, (0, 0, lk - lq, 0)) if lq < lk else q5  # bottom-right aligned rows
        backend = self.config.backend

        def causal_chunk(qc, kc, vc, kv):
            fq, fk = fm(qc * root, True), fm(kc * root, False)
            num = lt_product(fq, fk, vc, block, True, False, backend)
            if kv is not None:
                num = num + torch.matmul(fq, kv)
            add = torch.matmul(fk.transpose(-1, -2), vc)
            return num, add if kv is None else kv + add

        kv, outs = kv0, []
        for s in range(0, lk, size):
            num, kv = run(causal_chunk, qs[..., s : s + size, :], k5[..., s : s + size, :],
                          vext[..., s : s + size, :], kv)
            outs.append(num)
        num = torch.cat(outs, dim=3)[..., lk - lq :, :]
        return self._normalise(num), kv
