"""Stand-ins with the documented contracts of the two kernels backend 'fla' calls, for the CPU.

* ``dense_flex``: FlexAttention (``torch.nn.attention.flex_attention``), which PyTorch 2.13 runs on the CPU in forward
  only ("FlexAttention does not support backward on CPU"): softmax over the pairs its block mask allows (the listed
  blocks, and in them the mask_mod), output in the inputs' dtype, log-sum-exp in float32 (-inf and output 0 for a
  row without keys). Tested against the real one's forward (tests/ops/test_flex_fla.py).
* ``chunk_simple_gla``: fla-core 0.6.0's ``fla.ops.simple_gla.chunk_simple_gla``, whose Triton kernels run on CUDA
  only (they do not run under Triton's interpreter): (B, T, H, K) q, k, (B, T, H, V) v, g (B, T, H) log-gates,
  o_t = scale sum_{s <= t} exp(g_{s+1} + ... + g_t) (q_t . k_s) v_s. Tested against fla-core's own naive recurrent
  form where fla-core is installed.
"""

from __future__ import annotations

import sys
import types

import torch


def dense_flex(query, key, value, score_mod=None, block_mask=None, scale=None, enable_gqa=False, return_lse=False,
               kernel_options=None, *, return_aux=None, calls=None):
    from torch.nn.attention.flex_attention import AuxOutput, create_mask

    assert block_mask is not None and return_aux is not None and return_aux.lse
    b, hq, n, d = query.shape
    groups = hq // key.shape[1]
    assert groups == 1 or enable_gqa, "FlexAttention needs enable_gqa for grouped keys"
    if calls is not None:
        calls.append(dict(shape=tuple(query.shape), kv_shape=tuple(key.shape), dtype=query.dtype))
    work = torch.float64 if query.dtype == torch.float64 else torch.float32
    q, k, v = (x.to(work) for x in (query, key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)))
    qb, kb = block_mask.BLOCK_SIZE
    blocks = block_mask.to_dense().bool()  # (B or 1, H or 1, query blocks, key blocks): the listed blocks
    rows, cols = torch.arange(n) // qb, torch.arange(n) // kb
    listed = blocks[:, :, rows][..., cols]
    allowed = listed & create_mask(block_mask.mask_mod, b, 1, n, n, device=query.device)
    x = torch.matmul(q, k.transpose(-1, -2)) * (d**-0.5 if scale is None else scale)
    if score_mod is not None:  # FlexAttention's contract: the scaled score and its (batch, head, query, key) indices
        idx = torch.arange(n)
        x = score_mod(x, torch.arange(b)[:, None, None, None], torch.arange(hq)[None, :, None, None],
                      idx[None, None, :, None], idx[None, None, None, :])
    x = x.masked_fill(~allowed, float("-inf"))
    any_key = allowed.any(-1, keepdim=True)
    top = torch.where(any_key, x.amax(-1, keepdim=True), 0.0).detach()
    p = torch.exp(x - top)
    den = p.sum(-1, keepdim=True)
    out = torch.matmul(p, v) / torch.where(any_key, den, 1.0)
    lse = torch.where(any_key, torch.log(torch.where(any_key, den, 1.0)) + top, float("-inf")).squeeze(-1)
    return out.to(query.dtype), AuxOutput(lse=lse.float())


def chunk_simple_gla(q, k, v, g=None, g_gamma=None, scale=None, initial_state=None, output_final_state=False,
                     calls=None, **kwargs):
    assert g is not None and g_gamma is None and initial_state is None and not output_final_state
    assert q.dim() == k.dim() == v.dim() == 4 and q.shape == k.shape and q.shape[:3] == v.shape[:3] == g.shape, \
        "fla-core takes (B, T, H, K) q, k, (B, T, H, V) v and (B, T, H) g"
    assert q.dtype == k.dtype == v.dtype, "fla-core takes one dtype for q, k, v"
    assert all(x.is_contiguous() for x in (q, k, v, g))
    if calls is not None:
        calls.append(dict(shape=tuple(q.shape), v_shape=tuple(v.shape), dtype=q.dtype, g_dtype=g.dtype, scale=scale))
    cum = g.float().cumsum(1)  # (B, T, H)
    t = torch.arange(q.shape[1])
    past = t[None, :] <= t[:, None]
    expo = (cum.transpose(1, 2)[..., :, None] - cum.transpose(1, 2)[..., None, :]).masked_fill(~past, float("-inf"))
    s = torch.einsum("bihk,bjhk->bhij", q.float(), k.float()) * (q.shape[-1] ** -0.5 if scale is None else scale)
    o = torch.einsum("bhij,bjhv->bihv", s * torch.exp(expo), v.float())
    return o.to(q.dtype), None


def simple_gla_modules(calls: list | None = None, base: dict | None = None) -> dict:
    """``fla.ops.simple_gla`` holding the ``chunk_simple_gla`` stand-in, added to the module tree ``base`` (name ->
    module, e.g. test_fla_backend's ``fla.ops.linear_attn`` stand-in) or to a new one."""
    mods = dict(base or {})
    fla = mods.setdefault("fla", types.ModuleType("fla"))
    ops = mods.setdefault("fla.ops", types.ModuleType("fla.ops"))
    fla.ops = ops
    simple_gla = types.ModuleType("fla.ops.simple_gla")
    simple_gla.chunk_simple_gla = lambda *a, **kw: chunk_simple_gla(*a, calls=calls, **kw)
    ops.simple_gla = simple_gla
    mods["fla.ops.simple_gla"] = simple_gla
    return mods


def hide_fla(monkeypatch) -> None:
    """``import fla...`` raises ImportError for the test: fla and every fla.* module already imported (a real
    fla-core's or a stand-in's) map to None."""
    for name in ["fla", "fla.ops", "fla.ops.linear_attn", "fla.ops.simple_gla",
                 *(n for n in sys.modules if n.startswith("fla."))]:
        monkeypatch.setitem(sys.modules, name, None)
