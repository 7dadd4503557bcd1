"""Tensors the ops cache for later calls (index tables, head indices, RoPE factors) are made outside inference mode:
a first call under ``torch.inference_mode()`` (an evaluation, ``hf_polyattn.decode_memory``'s checks) must not leave
inference tensors that a later call recording gradients would have to save for backward."""

from __future__ import annotations

import torch

from hf_polyattn import PolyAttnConfig
from hf_polyattn.ops import build_attention
from hf_polyattn.ops.rotary import RopeRotation
from hf_polyattn.ops.sketches import symmetric_square


def test_symmetric_square_after_inference_mode():
    with torch.inference_mode():
        symmetric_square(torch.randn(3, 13))  # 13: a width no other test caches first
    z = torch.randn(3, 13, requires_grad=True)
    symmetric_square(z).sum().backward()
    assert z.grad is not None


def test_hybrid_heads_after_inference_mode():
    m = build_attention(PolyAttnConfig(kind="linear", softmax_heads=[(0, 1)]), 4, 8, 2)
    q, k, v = torch.randn(1, 4, 6, 8), torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
    with torch.inference_mode():
        m(q, k, v, causal=True)
    q.requires_grad_()
    m(q, k, v, causal=True).sum().backward()
    assert q.grad is not None


def test_rope_factors_after_inference_mode():
    rot = RopeRotation(1.0 / (10000 ** (torch.arange(0, 8, 2, dtype=torch.float64) / 8)), 8)
    x = torch.randn(2, 8)
    with torch.inference_mode():
        rot.rotate_by(x, -3)
        rot.rotate(x, torch.tensor(-3))
    x.requires_grad_()
    (rot.rotate_by(x, -3).sum() + rot.rotate(x, torch.tensor(-3)).sum()).backward()
    assert x.grad is not None
