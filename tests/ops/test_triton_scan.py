"""The Triton running sums over state slots (``ops.triton.causal.running_sums_``) against a float64 loop and the
PyTorch paths they replaced (``cumsum_``, ``ops.causal.decayed_running_sums``), and the causal product with the scan
against the same product with those PyTorch paths (``SCAN_KERNEL = False``).

Without a GPU the kernels run in Triton's interpreter (tests/ops/triton_setup.py); with one, compiled on CUDA.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from hf_polyattn.ops.triton import lt_multiply_triton
from tests.ops.triton_setup import DEVICE  # sets TRITON_INTERPRET before the kernels load

# imported after the interpreter switch above (it loads the kernels)
causal = importlib.import_module("hf_polyattn.ops.triton.causal")


def _naive(x: torch.Tensor, logs: torch.Tensor | None) -> torch.Tensor:
    """y_t = sum_{t' <= t} exp(logs_t - logs_t') x_t', one slot at a time in float64."""
    x = x.double()
    y = torch.empty_like(x)
    acc = torch.zeros_like(x[:, 0])
    for t in range(x.shape[1]):
        if logs is not None and t:
            acc = acc * torch.exp(logs[:, t].double() - logs[:, t - 1].double()).view(-1, *[1] * (x.dim() - 2))
        acc = acc + x[:, t]
        y[:, t] = acc
    return y


def _logs(h: int, s: int, gen: torch.Generator) -> torch.Tensor:
    """Non-increasing fp32 log-decays with small steps and a few large ones (factors that underflow to 0)."""
    steps = torch.rand(h, s, generator=gen) * 0.3
    steps[:, s // 3] += 120.0  # exp(-120) = 1e-52: below fp32's smallest number
    return (-steps.cumsum(-1)).float()


@pytest.mark.parametrize("slots", [1, 2, 31, 32, 33, 100])
@pytest.mark.parametrize("shape", [(1,), (7,), (64, 64), (5, 120)])
@pytest.mark.parametrize("decayed", [False, True])
def test_running_sums_match_a_float64_loop(slots, shape, decayed):
    gen = torch.Generator().manual_seed(slots * 31 + len(shape))
    h = 3
    x = torch.randn(h, slots, *shape, generator=gen)
    logs = _logs(h, slots, gen) if decayed else None
    want = _naive(x, logs)
    got = x.to(DEVICE).contiguous()
    out = causal.running_sums_(got, None if logs is None else logs.to(DEVICE))
    assert out.data_ptr() == got.data_ptr(), "running_sums_ works in place"
    assert torch.isfinite(out).all()
    # fp32 sums of at most 100 terms of size ~1: a few ulps of the running total
    torch.testing.assert_close(out.cpu().double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("decayed", [False, True])
def test_running_sums_match_the_pytorch_paths_they_replaced(decayed, monkeypatch):
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(2, 70, 64, 24, generator=gen)
    logs = _logs(2, 70, gen) if decayed else None
    dev_logs = None if logs is None else logs.to(DEVICE)
    fast = causal.running_sums_(x.to(DEVICE).contiguous(), dev_logs)
    monkeypatch.setattr(causal, "SCAN_KERNEL", False)
    before = causal.running_sums_(x.to(DEVICE).contiguous(), dev_logs)
    torch.testing.assert_close(fast, before, rtol=1e-5, atol=1e-5)


def test_segments_are_joined_in_order():
    """A slot count that is several segments plus one: a carry taken from the wrong segment, or added twice, moves
    every slot after the first segment (ones make the expected sums exact integers)."""
    s = 3 * causal.SCAN_SEGMENT + 1
    x = torch.ones(2, s, 9, device=DEVICE)
    out = causal.running_sums_(x)
    want = torch.arange(1, s + 1, dtype=torch.float32).view(1, s, 1).expand(2, s, 9)
    assert torch.equal(out.cpu(), want)


@pytest.mark.parametrize("decayed", [False, True])
def test_product_with_the_scan_equals_the_product_without(decayed, monkeypatch):
    """The causal product (forward and gradients, 2 kv heads x 2 query groups, n = 300 at block 64: 4 state slots,
    SCAN_SEGMENT = 2 so that segments are joined) with the scan and with the PyTorch running sums."""
    gen = torch.Generator().manual_seed(3)
    n, r, e = 300, 16, 17
    a = torch.randn(2, 2, n, r, generator=gen) / 4
    b = torch.randn(2, 1, n, r, generator=gen) / 4
    c = torch.randn(2, 1, n, e, generator=gen)
    decay = None
    if decayed:
        klog = _logs(2, n, gen).view(2, 1, n) / 10
        decay = (klog.expand(2, 2, n), klog)
    g = torch.randn(2, 2, n, e, generator=gen)

    def run():
        xs = [t.to(DEVICE).requires_grad_() for t in (a, b, c)]
        dec = None if decay is None else tuple(t.to(DEVICE) for t in decay)
        out = lt_multiply_triton(*xs, block_size=64, activation="elu", decay=dec)
        return (out, *torch.autograd.grad((out * g.to(DEVICE)).sum(), xs))

    monkeypatch.setattr(causal, "SCAN_SEGMENT", 2)
    fast = run()
    monkeypatch.setattr(causal, "SCAN_KERNEL", False)
    before = run()
    for name, x, y in zip(("out", "dA", "dB", "dC"), fast, before):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4, msg=lambda m, name=name: f"{name}: {m}")
