"""Sliding-window hybrid attention (ops/window.py) against its naive twin in ops/reference.py."""

from __future__ import annotations

import pytest
import torch

from hf_polyattn import PolyAttnConfig
from hf_polyattn.ops import PolyAttention, reference_attention
from hf_polyattn.ops.backend import ENV_VAR
from hf_polyattn.ops.window import shifted_lt, window_scores

from .test_attention import _padding_mask

D = 8

CONFIGS = [
    ("ps4-softmax-w5", dict(kind="polysketch", sketch_size=8, window=5)),
    ("ps4-poly-w8-learned", dict(kind="polysketch", sketch="learned", sketch_size=8, window=8,
                                 local_kernel="polynomial", qk_norm=True)),
    ("ps2-srht-w3-mix", dict(kind="polysketch", degree=2, sketch="srht", sketch_size=8, window=3, window_mix=True)),
    ("linear-elu-w4", dict(kind="linear", window=4)),
    ("linear-taylor-poly-w6", dict(kind="linear", feature_map="taylor", window=6, local_kernel="polynomial")),
    ("performer-w4-mix", dict(kind="performer", num_features=16, window=4, window_mix=True)),
    ("performer-poly-w7", dict(kind="performer", num_features=16, window=7, local_kernel="polynomial")),
]

# (id, batch, heads, kv_heads, q_len, kv_len, causal, padding)
SHAPES = [
    ("causal-n1", 1, 2, 2, 1, 1, True, None),
    ("causal-n29-gqa", 2, 4, 2, 29, 29, True, None),
    ("causal-n23-padleft", 2, 2, 2, 23, 23, True, "left"),
    ("causal-n23-padright", 2, 2, 1, 23, 23, True, "right"),
    ("causal-q5-after-past21", 2, 4, 2, 5, 21, True, "left"),
    ("bidir-n22-gqa-padright", 2, 4, 2, 22, 22, False, "right"),
    ("bidir-n17-padleft", 2, 2, 2, 17, 17, False, "left"),
]


# chunked prefill shorter and longer than the windows and blocks of these tests, then token by token (26 tokens)
CHUNKS = ((0, 2), (2, 11), (11, 12), (12, 13), (13, 20), *((i, i + 1) for i in range(20, 26)))


def recurrent_outputs(module, q, k, v, chunks, mask=None, check=None):
    """The outputs of ``module`` called on the (start, end) ``chunks`` of q, k, v in turn with a recurrent state,
    concatenated; ``check(state, end)`` must hold after each call."""
    state, outs = module.init_state(), []
    for s, t in chunks:
        o, state = module(q[:, :, s:t], k[:, :, s:t], v[:, :, s:t], causal=True, state=state,
                          key_padding_mask=None if mask is None else mask[:, s:t])
        outs.append(o)
        assert check is None or check(state, t)
    return torch.cat(outs, dim=2)


def _module(opts, heads, kv_heads):
    pa = PolyAttention(PolyAttnConfig(block_size=4, **opts), heads, D, kv_heads, layer_idx=1).double()
    with torch.no_grad():  # move learnable tensors off their initial values so gradients and mixing matter
        for p in pa.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return pa


@pytest.mark.parametrize("shape", SHAPES, ids=[s[0] for s in SHAPES])
@pytest.mark.parametrize("opts", [c[1] for c in CONFIGS], ids=[c[0] for c in CONFIGS])
def test_window_matches_reference(opts, shape):
    _, b, h, hkv, lq, lk, causal, pad = shape
    pa = _module(opts, h, hkv)
    gen = torch.Generator().manual_seed(lq * 7 + lk)
    q = torch.randn(b, h, lq, D, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(b, hkv, lk, D, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(b, hkv, lk, D, generator=gen, dtype=torch.float64, requires_grad=True)
    mask = _padding_mask(b, lk, pad)
    out = pa(q, k, v, causal=causal, key_padding_mask=mask)
    ref = reference_attention(pa, q, k, v, causal=causal, key_padding_mask=mask)
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-9)
    params = [p for p in pa.parameters()]
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v, *params), g, allow_unused=True)
    want = torch.autograd.grad(ref, (q, k, v, *params), g, allow_unused=True)
    for i, (a, e) in enumerate(zip(got, want)):
        if a is None or e is None:  # unused (e.g. no key beyond the window): the other must be zero too
            assert (a is None or not a.abs().any()) and (e is None or not e.abs().any()), f"gradient {i}"
        else:
            torch.testing.assert_close(a, e, rtol=1e-8, atol=1e-9, msg=f"gradient {i}")


@pytest.mark.parametrize("opts", [c[1] for c in CONFIGS], ids=[c[0] for c in CONFIGS])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
def test_window_covering_every_key_keeps_the_kernel_in_the_graph(opts, causal):
    """n <= window: no key is beyond the window, the kernel part adds nothing, and every parameter still gets a
    gradient, zero (not None: DDP's reducer waits for each parameter), also when q, k, v are frozen (attention
    transfer: the loss must have a grad_fn)."""
    pa = _module(opts, 4, 2)
    n = pa.config.window - 1
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, h, n, D, generator=gen, dtype=torch.float64) for h in (4, 2, 2))
    out = pa(q, k, v, causal=causal)
    torch.testing.assert_close(out, reference_attention(pa, q, k, v, causal=causal), rtol=1e-10, atol=1e-10)
    params = dict(pa.named_parameters())
    assert out.grad_fn is not None or not params
    if params:
        grads = torch.autograd.grad(out.sum(), list(params.values()))
        for name, g in zip(params, grads):
            assert g is not None and not g.abs().any(), name


def test_window_is_not_block_diagonal():
    """The first query of a block sees its previous window-1 keys exactly (block-diagonal local_exact
    gave it only itself): the output differs from the block-diagonal variant exactly there."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 16, D, generator=gen, dtype=torch.float64) for _ in range(3))
    win = PolyAttention(PolyAttnConfig(kind="linear", window=4, block_size=4), 2, D).double()
    blk = PolyAttention(PolyAttnConfig(kind="linear", local_exact=True, block_size=4), 2, D).double()
    a, b = win(q, k, v, causal=True), blk(q, k, v, causal=True)
    same = (a - b).abs().amax(dim=(0, 1, 3)) < 1e-12
    assert same[3] and same[7]  # the last query of a block: the same 4 exact keys in both
    assert not same[4] and not same[8]  # the first query of a block: 4 exact keys vs 1


@pytest.mark.parametrize("opts", [c[1] for c in CONFIGS], ids=[c[0] for c in CONFIGS])
def test_window_causal_and_recurrent(opts):
    pa = _module(opts, 4, 2)
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, h, 26, D, generator=gen, dtype=torch.float64) for h in (4, 2, 2))
    full = pa(q, k, v, causal=True)
    # causality: future keys/values do not change earlier outputs
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 15:] += 3.0
    v2[:, :, 15:] -= 2.0
    assert torch.equal(pa(q, k2, v2, causal=True)[:, :, :15], full[:, :, :15])
    # recurrent: chunks shorter and longer than the window, then token by token
    torch.testing.assert_close(
        recurrent_outputs(pa, q, k, v, CHUNKS,
                          check=lambda state, t: state.k.shape[2] == min(pa.config.window, t)),  # constant size
        full, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("opts", [dict(kind="linear", window=4), dict(kind="polysketch", sketch_size=8, window=5),
                                  dict(kind="linear", window=4, sinks=2, learned_sinks=2)],
                         ids=["linear", "polysketch", "linear-sinks"])
def test_window_left_padding_is_exact(opts):
    """Windows are relative to each query, so a left-padded row equals the row unpadded (the
    block-diagonal local_exact cannot promise this); sinks are the row's first real keys, whatever the padding."""
    pa = PolyAttention(PolyAttnConfig(block_size=4, **opts), 2, D).double()
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, 13, D, generator=gen, dtype=torch.float64) for _ in range(3))
    alone = pa(q, k, v, causal=True)
    pad = 3
    qp, kp, vp = (torch.cat([torch.randn(1, 2, pad, D, dtype=torch.float64), t], dim=2) for t in (q, k, v))
    mask = torch.ones(1, 13 + pad, dtype=torch.bool)
    mask[:, :pad] = False
    padded = pa(qp, kp, vp, causal=True, key_padding_mask=mask)
    torch.testing.assert_close(padded[:, :, pad:], alone, rtol=1e-10, atol=1e-10)


def test_window_backends_agree(monkeypatch):
    pa = _module(dict(kind="polysketch", sketch_size=8, window=5), 4, 2)
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, h, 30, D, generator=gen, dtype=torch.float64, requires_grad=True) for h in (4, 2, 2))
    outs = []
    for which in ("loop", "batched"):
        monkeypatch.setenv(ENV_VAR, which)
        for causal in (True, False):
            out = pa(q, k, v, causal=causal)
            outs.append((out, torch.autograd.grad(out.sum(), (q, k, v))))
    for (o1, g1), (o2, g2) in zip(outs[:2], outs[2:]):
        torch.testing.assert_close(o1, o2, rtol=1e-10, atol=1e-10)
        for a, b in zip(g1, g2):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_shifted_lt_and_window_scores_definitions():
    gen = torch.Generator().manual_seed(4)
    a, b, c = (torch.randn(1, 11, 3, generator=gen, dtype=torch.float64) for _ in range(3))
    out = shifted_lt(a, b, c, 4, 2, False, "loop")
    i = torch.arange(11)
    keep = i[None, :] <= i[:, None] - 4
    torch.testing.assert_close(out, ((a @ b.transpose(-1, -2)) * keep) @ c)
    assert shifted_lt(a, b, c, 11, 2, False).abs().sum() == 0  # the window covers everything
    q = torch.randn(1, 1, 1, 11, 3, generator=gen, dtype=torch.float64)
    for causal in (True, False):
        scores, allowed = window_scores(q, q, 4, causal, 1.0, None)
        assert int(allowed.sum()) == (sum(min(4, j + 1) for j in range(11)) if causal
                                      else sum(len(range(max(0, j - 3), min(11, j + 4))) for j in range(11)))


@pytest.mark.parametrize("kind", ["polysketch", "linear"])
def test_window_mix_init_zero_is_the_window_alone_and_the_factor_is_its_magnitude(kind):
    """window_mix_init=0 starts a kernel kind as its window (+ sinks) alone, i.e. kind='sliding_window' with the same
    window and sinks; the factor acts as |m| (a negative factor never makes the kernel part negative), in the module
    and in its reference."""
    torch.manual_seed(0)
    opts = dict(window=6, sinks=2, block_size=4)
    extra = dict(sketch_size=8) if kind == "polysketch" else {}
    cfg = PolyAttnConfig(kind=kind, window_mix=True, window_mix_init=0.0, **opts, **extra)
    pa = PolyAttention(cfg, 4, D, 2).double()
    sw = PolyAttention(PolyAttnConfig(kind="sliding_window", **opts), 4, D, 2).double()
    q, k, v = torch.randn(2, 4, 23, D).double(), torch.randn(2, 2, 23, D).double(), torch.randn(2, 2, 23, D).double()
    mask = _padding_mask(2, 23, "left")
    torch.testing.assert_close(pa(q, k, v, causal=True, key_padding_mask=mask),
                               sw(q, k, v, causal=True, key_padding_mask=mask), rtol=1e-12, atol=1e-12)
    with torch.no_grad():
        pa.window_mix.fill_(0.3)
    pos = pa(q, k, v, causal=True, key_padding_mask=mask)
    with torch.no_grad():
        pa.window_mix.fill_(-0.3)
    torch.testing.assert_close(pa(q, k, v, causal=True, key_padding_mask=mask), pos, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(reference_attention(pa, q, k, v, causal=True, key_padding_mask=mask), pos,
                               rtol=1e-9, atol=1e-9)
    with pytest.raises(ValueError, match="window_mix_init"):
        PolyAttnConfig(kind=kind, window=6, window_mix=True, window_mix_init=-1.0)
    with pytest.raises(ValueError, match="needs window_mix=True"):
        PolyAttnConfig(kind=kind, window=6, window_mix_init=0.1)
