"""The window of an inference call on the CPU through the fused flash kernel (ops/window_flash.py) against the
rematerialised tiles that training uses (``LocalExactMixin._window_exact``) and the O(n^2) reference."""

from __future__ import annotations

import pytest
import torch

from hf_polyattn import PolyAttnConfig
from hf_polyattn.ops import build_attention
from hf_polyattn.ops import window_flash as wf
from hf_polyattn.ops.rotary import RopeRotation

D = 16

CASES = {
    "window": (dict(window=8), 40, 0),
    "sinks-gate-mix": (dict(window=8, sinks=2, decay="gate", window_mix=True), 45, 0),
    "sink-positions-left-padded": (dict(window=8, sinks=2, sink_position="window", decay="gate"), 45, 5),
    "learned-sinks-padded": (dict(window=16, sinks=4, learned_sinks=2), 70, 11),
    "short": (dict(window=16, sinks=2), 9, 0),
    "padded-past-the-window": (dict(window=4, sinks=0), 33, 13),
    "softmax-heads": (dict(window=8, sinks=2, decay="gate", softmax_heads=[(0, 1)]), 41, 3),
}


def _module(opts):
    m = build_attention(PolyAttnConfig(kind="linear", **opts), 6, D, 2)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.1 * torch.randn_like(p))
    if opts.get("sink_position") == "window":
        m.rope = RopeRotation(1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float64) / D)), D)
    return m


@pytest.mark.parametrize("name", list(CASES))
def test_inference_window_equals_the_training_path(monkeypatch, name):
    opts, n, pad = CASES[name]
    m = _module(opts)
    gen = torch.Generator().manual_seed(n)
    q, k, v = (torch.randn(2, h, n, D, generator=gen) for h in (6, 2, 2))
    mask = None
    if pad:
        mask = torch.ones(2, n, dtype=torch.bool)
        mask[0, :pad] = False
    calls = []
    flash = wf._FLASH

    def counted(*args, **kwargs):
        calls.append(1)
        return flash(*args, **kwargs)

    monkeypatch.setattr(wf, "_FLASH", counted)
    with torch.no_grad():
        fast = m(q, k, v, causal=True, key_padding_mask=mask)
    assert calls  # the fused kernel served the call
    calls.clear()
    slow = m(q, k, v, causal=True, key_padding_mask=mask).detach()  # a recorded gradient: the rematerialised tiles
    assert not calls
    torch.testing.assert_close(fast, slow, rtol=2e-5, atol=2e-6)
    if mask is not None:  # the padded row's real part equals the row alone
        with torch.no_grad():
            alone = m(q[:1, :, pad:], k[:1, :, pad:], v[:1, :, pad:], causal=True)
        torch.testing.assert_close(fast[:1, :, pad:], alone, rtol=2e-5, atol=2e-6)


def test_inference_window_is_causal():
    m = _module(dict(window=8, sinks=2, decay="gate"))
    q, k, v = (torch.randn(1, h, 37, D) for h in (6, 2, 2))
    with torch.no_grad():
        full = m(q, k, v, causal=True)
        k2, v2 = k.clone(), v.clone()
        k2[:, :, 20:] += 3.0
        v2[:, :, 20:] -= 2.0
        assert torch.equal(m(q, k2, v2, causal=True)[:, :, :20], full[:, :, :20])


def test_other_dtypes_and_gradients_keep_the_rematerialised_tiles(monkeypatch):
    monkeypatch.setattr(wf, "_FLASH", None)  # any call through the fused kernel would fail
    m = _module(dict(window=8, sinks=2)).double()
    q, k, v = (torch.randn(1, h, 30, D, dtype=torch.float64) for h in (6, 2, 2))
    with torch.no_grad():
        m(q, k, v, causal=True)  # float64: not served by the fused kernel
    assert not wf.flash_window_available(q.float())


def test_clean_tiles_as_views_or_selected(monkeypatch):
    """The tiles without a left-out key run as one view when consecutive (left padding: every tile after the
    padding) and are selected when a padded key sits between them: both equal the rematerialised tiles."""
    m = _module(dict(window=4, sinks=0))
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 33, D, generator=gen) for h in (6, 2, 2))
    ranges = []
    real_range = wf._range
    monkeypatch.setattr(wf, "_range", lambda idx: ranges.append(real_range(idx)) or ranges[-1])
    for hole in (slice(0, 6), slice(14, 17)):
        mask = torch.ones(2, 33, dtype=torch.bool)
        mask[0, hole] = False
        with torch.no_grad():
            fast = m(q, k, v, causal=True, key_padding_mask=mask)
        slow = m(q, k, v, causal=True, key_padding_mask=mask).detach()
        torch.testing.assert_close(fast, slow, rtol=2e-5, atol=2e-6)
    assert ranges[0] is not None and ranges[-1] is None  # a view, then index selects around the hole
