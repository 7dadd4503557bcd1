"""Triton sliding window (``local_blocks_triton(..., window=w)``) against the PyTorch ``_window_exact`` and the
O(n^2) reference, alone and through the attention module (polysketch/linear/performer with ``window``, kind
'sliding_window').

Without a GPU the kernels run in Triton's interpreter (tests/ops/triton_setup.py); with one, compiled on CUDA.
"""

from __future__ import annotations

import pytest
import torch

from hf_polyattn import PolyAttnConfig
from hf_polyattn.ops import PolyAttention
from hf_polyattn.ops.backend import ENV_VAR
from hf_polyattn.ops.common import _with_normaliser
from hf_polyattn.ops.reference import reference_attention
from hf_polyattn.ops.triton import local_blocks_triton
from hf_polyattn.ops.window import Sinks
from tests.ops.test_triton_local import FP32_REL, HALF_REL, _close, _inputs, _mask, _normwise
from tests.ops.triton_setup import DEVICE  # sets TRITON_INTERPRET before the kernels load

N = 37
B, HKV, G, D = 2, 2, 2, 8


def _module(kernel: str, degree: int, window: int, **extra) -> PolyAttention:
    cfg = PolyAttnConfig(kind="polysketch", sketch_size=4, degree=degree, window=window, local_kernel=kernel,
                         block_size=16, **extra)
    mod = PolyAttention(cfg, HKV * G, D, HKV).to(DEVICE)
    if cfg.learned_sinks:
        with torch.no_grad():  # off their zero start, so that the slots' weights and values matter
            gen = torch.Generator().manual_seed(5)
            mod.sink_k.copy_(torch.randn(mod.sink_k.shape, generator=gen))
            mod.sink_v.copy_(torch.randn(mod.sink_v.shape, generator=gen))
    return mod


def _grads(loc, far, xs, seed=1):
    gen = torch.Generator().manual_seed(seed)
    loss = (loc.double() * torch.randn(loc.shape, generator=gen).to(loc.device)).sum()
    if far is not None:
        loss = loss + (far.double() * torch.randn(far.shape, generator=gen).to(far.device)).sum()
    return torch.autograd.grad(loss, [x for x in xs if x is not None])


def _compare(kernel, degree, window, causal, mask_kind, monkeypatch, log_scale=False, n=N, q_scale=1.0, **extra):
    """The Triton window against the PyTorch one: values, far scale and gradients. ``extra``: config fields, such as
    ``sinks`` and ``learned_sinks`` (their slots then join both as inputs of their own, the window's mask leaving
    the sinks to them)."""
    mod = _module(kernel, degree, window, **extra)
    mask = _mask(mask_kind, n)
    q, k, v, c = _inputs(n, q_scale=q_scale, log_scale=log_scale)
    inputs, slots = [q, k, v, c], ()
    found = mod._window_sinks(k, v, mask)
    if found is not None:
        # the slots' keys and [v, 1] as leaves: the kernels' gradients of every column (the gathered sinks' way back
        # into k and the learned slots' into their parameters are PyTorch's, tested through the module)
        slots = tuple(x.detach().requires_grad_() for x in (found.k, found.v))
        inputs += slots
        mask = found.rest(mask)
        slots += (found.pos,)

    def args():  # [v, 1] made anew per run: its graph is freed by the first run's gradients
        return q, k, _with_normaliser(v, mask), mask, causal, D ** -0.5, c

    ref, ref_far = mod._window_exact(*args(), *slots)
    ref_grads = _grads(ref, ref_far, inputs)
    with monkeypatch.context() as m:
        m.setenv(ENV_VAR, "triton")
        m.setattr(mod, "_window_exact", lambda *a, **kw: (_ for _ in ()).throw(AssertionError("PyTorch window")))
        loc, far = mod._window_local(*args(), None, None if found is None else Sinks(*slots))
    assert loc.shape == ref.shape and loc.dtype == torch.float32
    _close(loc, ref, FP32_REL, "loc")
    if ref_far is None:
        assert far is None
    else:
        _close(far, ref_far, FP32_REL, "far_scale")
    names = [name for name, x in zip(["q", "k", "v", "c", "slot k", "slot [v, 1]"], inputs) if x is not None]
    for name, a, b in zip(names, _grads(loc, far, inputs), ref_grads, strict=True):
        _close(a, b, FP32_REL, f"d{name}")


@pytest.mark.parametrize("mask_kind", [None, "right", "left"], ids=["nomask", "right", "left"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
@pytest.mark.parametrize("kernel,degree", [("softmax", 2), ("polynomial", 2), ("polynomial", 4)],
                         ids=["softmax", "poly2", "poly4"])
def test_matches_pytorch_window(kernel, degree, causal, mask_kind, monkeypatch):
    """w = 5 at n = 37 (query tiles of 64 rows see a band of the tile), GQA (H = 4, Hkv = 2), padding."""
    _compare(kernel, degree, 5, causal, mask_kind, monkeypatch)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
@pytest.mark.parametrize("window,n", [(1, N), (2, 150), (64, N), (66, 150), (100, N)],
                         ids=["w1-self-only", "w2", "w64-one-tile", "w66", "w100-beyond-n"])
def test_window_sizes(window, n, causal, monkeypatch):
    """w = 1 (each query sees itself), one row tile wide, wider than the sequence (every key, like dense).
    w = 2 and 66 at n = 150 (64-row tiles): a tile's key (query) range then ends 1 row into the next tile,
    so a range one row short loses a whole tile's loop step there."""
    _compare("softmax", 2, window, causal, "left", monkeypatch, n=n)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
def test_several_tiles_large_scores_and_log_scale(causal, monkeypatch):
    """n = 170 (3 row tiles), w = 70 (keys from the tile before): scores ~ +-60 with FAVOR+'s q_log_scale."""
    _compare("softmax", 2, 70, causal, "right", monkeypatch, log_scale=True, n=170, q_scale=8.0)
    _compare("polynomial", 4, 70, causal, None, monkeypatch, n=170, q_scale=0.5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_inputs(dtype):
    """Half inputs: fp32 outputs, finite, within HALF_REL (normwise) of the fp32 PyTorch window on the same values."""
    mod = _module("softmax", 2, 7)
    q, k, v, _ = _inputs(dtype=dtype)
    mask = _mask("right")
    loc, log_far = local_blocks_triton(q, k, _with_normaliser(v, mask), 16, True, D ** -0.5, "softmax", mask,
                                       window=7)
    assert loc.dtype == torch.float32
    q32, k32, v32 = (x.detach().float().requires_grad_() for x in (q, k, v))
    ref, ref_far = mod._window_exact(q32, k32, _with_normaliser(v32, mask), mask, True, D ** -0.5, None)
    _normwise(loc, ref, HALF_REL, "loc")
    _normwise(log_far.exp(), ref_far, HALF_REL, "exp(log_far)")
    g = torch.randn_like(ref)
    for name, a, b, x in zip("qkv", torch.autograd.grad((loc * g).sum(), (q, k, v)),
                             torch.autograd.grad((ref * g).sum(), (q32, k32, v32)), (q, k, v)):
        assert a.dtype == x.dtype
        _normwise(a, b, HALF_REL, f"d{name}")


def test_window_argument_check():
    x = torch.randn(1, 2, 2, 10, 4, device=DEVICE)
    kv = torch.randn(1, 2, 1, 10, 4, device=DEVICE)
    v = torch.randn(1, 2, 1, 10, 5, device=DEVICE)
    for bad in (-1, True, 2.0, "8"):
        with pytest.raises(ValueError, match="^window must be an int >= 0"):
            local_blocks_triton(x, kv, v, 4, True, 1.0, "softmax", window=bad)


# ------------------------------------------------------------------ through the attention module
MODULE_KINDS = [
    dict(kind="polysketch", sketch="learned", sketch_size=4, window=5),  # softmax window
    dict(kind="polysketch", sketch="learned", sketch_size=4, window=6, local_kernel="polynomial"),
    dict(kind="linear", feature_map="elu", window=5, window_mix=True),
    dict(kind="performer", num_features=8, window=5),  # with FAVOR+'s q_log_scale
    dict(kind="sliding_window", window=5),
    dict(kind="sliding_window", window=6, local_kernel="polynomial", degree=4),
]


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
@pytest.mark.parametrize("opts", MODULE_KINDS, ids=lambda o: "-".join(str(v) for v in o.values()))
def test_attention_module_on_triton_backend(opts, causal, monkeypatch):
    """PolyAttention with a window on backend='triton' equals backend='loop' and the O(n^2) reference, and the
    Triton window is what ran; causal also with fewer queries than keys (bottom-right aligned, as in a prefill
    after a cached prefix)."""
    import hf_polyattn.ops.triton as triton_pkg

    windows = []
    real = triton_pkg.local_blocks_triton
    monkeypatch.setattr(triton_pkg, "local_blocks_triton",
                        lambda *a, **kw: windows.append(a[-1] if len(a) > 12 else kw.get("window")) or real(*a, **kw))
    monkeypatch.delenv(ENV_VAR, raising=False)
    mods = {which: PolyAttention(PolyAttnConfig(block_size=16, backend=which, **opts), 4, 8, 2).to(DEVICE)
            for which in ("loop", "triton")}
    mods["triton"].load_state_dict(mods["loop"].state_dict())
    if opts.get("window_mix"):  # away from its initial 1, so that a lost factor shows
        with torch.no_grad():
            for mod in mods.values():
                mod.window_mix.fill_(0.7)
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(2, h, N, 8, generator=gen).to(DEVICE).requires_grad_() for h in (4, 2, 2))
    mask = torch.ones(2, N, dtype=torch.bool, device=DEVICE)
    mask[1, 30:] = False
    for lq in ((N, 9) if causal else (N,)):
        qq = q[:, :, N - lq:]
        results = {}
        for which, mod in mods.items():
            out = mod(qq, k, v, causal=causal, key_padding_mask=mask)
            results[which] = (out, torch.autograd.grad(out.square().sum(), (q, k, v)))
        ref = reference_attention(mods["loop"], qq, k, v, causal=causal, key_padding_mask=mask)
        torch.testing.assert_close(results["triton"][0], results["loop"][0], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(results["triton"][0], ref, rtol=1e-4, atol=1e-4)
        for name, g_t, g_l in zip("qkv", results["triton"][1], results["loop"][1]):
            torch.testing.assert_close(g_t, g_l, rtol=1e-4, atol=1e-5 * g_l.abs().max().item(), msg=f"d{name}")
    assert windows and all(w == opts["window"] for w in windows), windows
