"""A sliding window's exact part through PyTorch's FlexAttention, and which layers run on backend 'fla'.

backend 'fla' runs a kernel layer on kernels that others keep fast: the kernel part's causal product on fla-core's
chunk kernels (``backend.lt_multiply_fla``: ``chunk_linear_attn``, or ``chunk_simple_gla`` for a decayed product)
and a sliding window's exact softmax part on FlexAttention (``flex_window``), the two under the layer's one
normaliser (``LocalExactMixin._windowed``, as on every backend):

    out_i = (e^{L_i - m_i} [o_i, 1] + sum_u e^{x_iu - m_i} [v_u, 1] + s_i far_i) / (the same sums' last column)

with o_i, L_i FlexAttention's output and log-sum-exp over the window W(i), x_iu the scores of the sink and learned
slots (a few per row, ``ops.window.Sinks``, scored here by a small matmul: a re-rotated query scores the sinks,
which a score_mod cannot express without a gradient through captured tensors), far_i = phi(q_i) sum_j phi(k_j)^T
[v_j, 1] the kernel part (its own denominator in the column of ones) and s_i = e^{-m_i} (times window_mix), m_i =
max(L_i, x_iu, 0) detached. The library's other backends take m_i = the row's largest score (clamped at 0): the
ratio does not depend on m_i, and every exponent here is <= 0 as there.

The window's block mask is built from its band structure (``window_blocks``: O(n / 128) blocks, where
``create_block_mask`` evaluates the mask on all n^2 pairs); the mask_mod adds causality, the window's distance and
the key padding (the sinks leave the window as padding, ``Sinks.rest``). On CUDA FlexAttention runs compiled
(``torch.compile(flex_attention)``: without it FlexAttention materialises the n x n scores); elsewhere eagerly,
which PyTorch 2.13 allows on the CPU in forward only (tests).

``layer_backend``: a layer runs on 'fla' where its config or the environment variable asks for it: the linear and
performer kinds with identity features (up to 256), no exact diagonal blocks and a window, if any, with softmax
weights; other layers are refused by name, and so is a decayed layer where fla-core refuses its gated backward
(``backend.fla_gated_refusal``: Hopper, Triton 3.4.0 - 3.7.0, no tilelang; seen on an H200 with Triton 3.6.0).
'auto' does not take 'fla': on one H100 (bf16, n = 32k, H = 16, d = 64, forward + backward, one process;
recipes/results/SECTION_gpu_h100_auto.md) a linear elu + 1 layer took 10.1 ms on 'fla' against 5.5 ms on 'triton'
(fla-core's kernel alone: 3.7 ms; the layer's float32 feature maps, their recomputation and the layout copies
around the kernel cost the rest).
"""

from __future__ import annotations

import functools
import os

import torch

from ..config import BACKENDS
from .backend import ENV_VAR, fla_gated_refusal, resolve_backend
from .common import soft_cap, to_work
from .window import Sinks, slot_scores

__all__ = ["FLEX_BLOCK", "flex_window", "layer_backend", "window_blocks"]

# FlexAttention's sparse block (its default): the window's block mask lists, per block of 128 queries, the blocks of
# 128 keys its window reaches (2 for a causal 128-token window)
FLEX_BLOCK = 128


def layer_backend(config, device: torch.device, dtype: torch.dtype) -> str:
    """The backend a kernel layer's products and exact window run on: 'fla' where ``config.backend`` or the
    environment variable asks for it (refused by name where it cannot run: module doc), else ``config.backend`` as it
    is (resolved later, by ``backend.resolve_backend``); 'auto' never takes 'fla' (module doc)."""
    requested = config.backend
    env = os.environ.get(ENV_VAR, "").strip()
    if requested == "auto" and env in BACKENDS:  # an invalid value is refused by name in resolve_backend
        requested = env
    if requested == "fla":
        resolve_backend("fla", device, dtype)  # fla-core, CUDA, not float64: refused by name otherwise
        why = fla_gated_refusal(device) if config.decay != "none" else None
        if why:
            raise ValueError(f"backend='fla' with decay={config.decay!r}: {why}; or use backend='triton'")
    return requested


@functools.lru_cache(maxsize=8)  # (1, 1, nb, nb) int32 each: 4 MiB at 128k keys
def window_blocks(n: int, window: int, causal: bool, block: int, device: torch.device):
    """(kv_num_blocks (1, 1, nb), kv_indices (1, 1, nb, nb)) int32 of FlexAttention's block mask for a sliding
    window over n keys (nb = ceil(n / block)): query block i reaches key blocks from (i b - w + 1) // b to i (causal;
    bidirectional: to ((i + 1) b - 1 + w - 1) // b), the first kv_num_blocks entries of its row."""
    nb = -(-n // block)
    i = torch.arange(nb, device=device)
    first = (i * block - (window - 1)).clamp_min(0) // block
    if causal:
        last = i
    else:
        last = (((i + 1) * block - 1).clamp(max=n - 1) + window - 1).clamp(max=n - 1) // block
    idx = (first[:, None] + torch.arange(nb, device=device)).clamp(max=nb - 1)
    return (last - first + 1).to(torch.int32).view(1, 1, nb), idx.to(torch.int32).view(1, 1, nb, nb)


_COMPILED: dict[str, object] = {}


def _flex_function(device: torch.device):
    """flex_attention as it runs on ``device``: compiled on CUDA (once per process), eager elsewhere."""
    from torch.nn.attention.flex_attention import flex_attention

    if device.type != "cuda":
        return flex_attention
    if "cuda" not in _COMPILED:
        _COMPILED["cuda"] = torch.compile(flex_attention)
    return _COMPILED["cuda"]


def _window_attention(q, k, v, rest, causal: bool, scale: float, window: int, softcap: float | None = None):
    """(output (B, Hq, n, d), log-sum-exp (B, Hq, n), -inf for a row without keys) of softmax attention over each
    query's window (0 <= i - j < w causal, |i - j| < w bidirectional) and the keys ``rest`` (B, n) keeps; with
    ``softcap`` c the scores are c tanh(x / c) (a score_mod: FlexAttention hands it the scaled score)."""
    from torch.nn.attention import flex_attention as fa

    n = q.shape[-2]

    def mask_mod(b, h, q_idx, kv_idx):
        dist = q_idx - kv_idx
        inside = (dist >= 0) & (dist < window) if causal else (dist < window) & (dist > -window)
        return inside if rest is None else inside & rest[b, kv_idx]

    num, idx = window_blocks(n, window, causal, FLEX_BLOCK, q.device)
    mask = fa.BlockMask.from_kv_blocks(num, idx, BLOCK_SIZE=FLEX_BLOCK, mask_mod=mask_mod, seq_lengths=(n, n))
    # return_aux (torch >= 2.9; return_lse before it, deprecated since): the GPU machines may run an older torch
    aux = {"return_aux": fa.AuxRequest(lse=True)} if hasattr(fa, "AuxRequest") else {"return_lse": True}
    capped = {} if softcap is None else {"score_mod": lambda score, b, h, q_idx, kv_idx: soft_cap(score, softcap)}
    out, stats = _flex_function(q.device)(q, k, v, block_mask=mask, scale=scale,
                                          enable_gqa=q.shape[1] != k.shape[1], **aux, **capped)
    return out, stats.lse if "return_aux" in aux else stats


def flex_window(qs: torch.Tensor, ks: torch.Tensor, vext: torch.Tensor, rest: torch.Tensor | None, causal: bool,
                scale: float, window: int, sinks: Sinks | None = None,
                softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(loc, log_far) of a sliding window's exact softmax part (and its ``sinks``), as ``_window_exact`` gives them:
    loc (B, Hkv, G, n, e + 1) = the window's and the slots' weights e^{x - m} times [v, 1], log_far = -m (B, Hkv, G,
    n, 1) (module doc). qs (B, Hkv, G, n, d) the queries (rows aligned with the keys), ks (B, Hkv, 1, n, d), vext
    (B, Hkv, 1, n, e + 1) = [v, 1], ``rest`` (B or 1, n) bool or None: the keys the window may read. The window runs
    in the inputs' common dtype (a half model's stays half), the rest in float32. ``softcap``: the layer's logit
    soft-cap, applied to the window's and the slots' scores."""
    b, hkv, g, n, d = qs.shape
    dtype = torch.promote_types(torch.promote_types(qs.dtype, ks.dtype), vext.dtype)
    q = qs.to(dtype).reshape(b, hkv * g, n, d)
    k, v = ks.to(dtype).squeeze(2), vext[..., :-1].to(dtype).squeeze(2)
    if rest is not None:
        rest = rest.expand(b, n)
    out, lse = _window_attention(q, k, v, rest, causal, scale, window, softcap)
    (out, lse) = to_work(out.view(b, hkv, g, n, -1), lse.view(b, hkv, g, n, 1))
    found = torch.isfinite(lse)  # -inf: no key in the row's window
    top = lse
    if sinks is not None:
        qw, sk, sv = to_work(qs, sinks.k, sinks.v)
        sq = None if sinks.q is None else to_work(sinks.q)[0] * scale
        x = soft_cap(slot_scores(qw * scale, sk, sq, sinks.learned), softcap)  # (B, Hkv, G, n, E)
        x = x.masked_fill(~sinks.visible(torch.arange(n, device=qs.device)), float("-inf"))
        top = torch.maximum(lse, x.amax(-1, keepdim=True))
    m = top.clamp_min(0.0).detach()
    # the where keeps a row without keys out of the gradient (exp(-inf - m) = 0 forward, and no NaN backward)
    weight = torch.where(found, torch.exp(torch.where(found, lse, m) - m), 0.0)
    loc = torch.cat([out * weight, weight], dim=-1)
    if sinks is not None:
        loc = loc + torch.matmul(torch.exp(x - m), sv)
    return loc, -m
