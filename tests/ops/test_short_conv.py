"""short_conv: the causal depthwise convolution on q / k of every kernel kind (ops/conv.py): the identity at the
start, the layer against the naive reference with trained weights, decoding with and without a cache, causality,
padding, gradients and half precision."""

from __future__ import annotations

import pytest
import torch

from hf_polyattn import PolyAttnConfig
from hf_polyattn.ops import PolyAttention, reference_attention
from hf_polyattn.ops.conv import causal_conv, reference_causal_conv
from tests.kinds.inputs import padding_mask, qkv

# every kernel kind, with the local parts and maps the convolution composes with
KINDS = {
    "linear-window-sinks-gate": dict(kind="linear", window=4, sinks=2, decay="gate"),
    "linear-blocks-qknorm": dict(kind="linear", local_exact=True, block_size=4, qk_norm=True),
    "polysketch-proj": dict(kind="polysketch", sketch_size=4, feature_proj=8),
    "performer": dict(kind="performer", num_features=8),
    "taylor-window": dict(kind="taylor", window=3),
    "polynomial": dict(kind="polynomial", degree=2),
}


def _module(opts: dict, size: int = 3, perturb: bool = True, dtype=torch.float64) -> PolyAttention:
    mod = PolyAttention(PolyAttnConfig(short_conv=size, **opts), 4, 8, 2).to(dtype)
    if perturb:
        gen = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for p in mod.parameters():
                p.add_(0.3 * torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.dtype))
    return mod


def test_conv_equals_its_definition_and_carries_a_tail():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 2, 11, 5, generator=gen, dtype=torch.float64)
    w = torch.randn(3, 2, 5, 4, generator=gen, dtype=torch.float64)
    y, inputs = causal_conv(x, w)
    torch.testing.assert_close(y, reference_causal_conv(x, w), rtol=0, atol=1e-14)
    assert inputs.shape[-2] == 3 + 11
    # the second half with the first half's last 3 inputs as its tail: the same rows
    y2, _ = causal_conv(x[..., 6:, :], w, tail=inputs[..., 6:9, :])
    torch.testing.assert_close(y2, y[..., 6:, :], rtol=0, atol=1e-14)


@pytest.mark.parametrize("kind", list(KINDS))
def test_identity_at_the_start(kind):
    """An untrained short_conv leaves the layer as it was: the same output as without the option (same seed) at every
    real query (a padded query is zeroed before the convolution, so its own row, which nothing reads, may change)."""
    opts = KINDS[kind]
    plain = PolyAttention(PolyAttnConfig(**opts), 4, 8, 2)
    conv = PolyAttention(PolyAttnConfig(short_conv=4, **opts), 4, 8, 2)
    missing = conv.load_state_dict(plain.state_dict(), strict=False).missing_keys
    assert sorted(missing) == ["conv_k.weight", "conv_q.weight"]
    q, k, v = qkv(2, 4, 2, 21, 21, 8, seed=1, dtype=torch.float32)
    mask = padding_mask(2, 21, "right")
    real = mask[:, None, :, None].expand(2, 4, 21, 8)
    torch.testing.assert_close(conv(q, k, v, causal=True, key_padding_mask=mask)[real],
                               plain(q, k, v, causal=True, key_padding_mask=mask)[real], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(conv(q, k, v, causal=True), plain(q, k, v, causal=True), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("side", [None, "left", "holes"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_layer_equals_reference(kind, side):
    mod = _module(KINDS[kind])
    q, k, v = qkv(2, 4, 2, 13, 13, 8, seed=2)
    mask = padding_mask(2, 13, side)
    if side == "left" and KINDS[kind].get("local_exact"):
        mask = padding_mask(2, 12, side)  # blocks sit at absolute positions: pad by a multiple of block_size
        q, k, v = qkv(2, 4, 2, 12, 12, 8, seed=2)
    torch.testing.assert_close(mod(q, k, v, causal=True, key_padding_mask=mask),
                               reference_attention(mod, q, k, v, causal=True, key_padding_mask=mask), rtol=0,
                               atol=1e-12)


@pytest.mark.parametrize("kind", ["performer", "polysketch-proj"])
def test_bidirectional(kind):
    """Encoders: the convolution stays causal over the sequence, both directions read the convolved q, k."""
    mod = _module(KINDS[kind])
    q, k, v = qkv(2, 4, 2, 13, 13, 8, seed=3)
    mask = padding_mask(2, 13, "right")
    torch.testing.assert_close(mod(q, k, v, causal=False, key_padding_mask=mask),
                               reference_attention(mod, q, k, v, causal=False, key_padding_mask=mask), rtol=0,
                               atol=1e-12)


@pytest.mark.parametrize("side", [None, "left"])
@pytest.mark.parametrize("kind", [k for k in KINDS if k != "polynomial"])
def test_decode_equals_no_cache(kind, side):
    """A chunk of 6, tokens one at a time, a chunk of 5: the outputs of one call over all 20, and a state of the same
    size after 15 tokens as after 20 (constant memory: the convolution keeps its last size - 1 inputs)."""
    mod = _module(KINDS[kind])
    n = 20
    q, k, v = qkv(2, 4, 2, n, n, 8, seed=4)
    mask = padding_mask(2, n, side)
    if side == "left" and KINDS[kind].get("local_exact"):
        mask[0] = True
        mask[0, :4] = False
    full = mod(q, k, v, causal=True, key_padding_mask=mask)
    state, outs, sizes = mod.init_state(), [], []
    for lo, hi in [(0, 6), *((t, t + 1) for t in range(6, 15)), (15, n)]:
        out, state = mod(q[:, :, lo:hi], k[:, :, lo:hi], v[:, :, lo:hi], causal=True,
                         key_padding_mask=None if mask is None else mask[:, lo:hi], state=state)
        outs.append(out)
        sizes.append(state.nbytes())
        assert state.conv_q.shape[-2] == state.conv_k.shape[-2] == 2
    torch.testing.assert_close(torch.cat(outs, dim=2), full, rtol=0, atol=1e-12)
    if not KINDS[kind].get("local_exact"):  # a block's buffer grows and empties by design
        assert sizes[-1] == sizes[-2]


@pytest.mark.parametrize("kind", ["linear-window-sinks-gate", "performer"])
def test_causal(kind):
    mod = _module(KINDS[kind], size=4)
    q, k, v = qkv(1, 4, 2, 16, 16, 8, seed=5)
    base = mod(q, k, v, causal=True)
    for t in (0, 7, 15):
        q2, k2, v2 = q.clone(), k.clone(), v.clone()
        for x in (q2, k2, v2):
            x[:, :, t + 1 :] += torch.randn_like(x[:, :, t + 1 :])
        torch.testing.assert_close(mod(q2, k2, v2, causal=True)[:, :, : t + 1], base[:, :, : t + 1], rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["linear-window-sinks-gate", "polysketch-proj"])
def test_left_padding_does_not_leak(kind):
    """Garbage at left-padded positions does not reach the convolution of the real tokens."""
    mod = _module(KINDS[kind], size=4)
    q, k, v = qkv(1, 4, 2, 12, 12, 8, seed=6)
    alone = mod(q, k, v, causal=True)
    pad = 5
    qp, kp, vp = (torch.cat([100 * torch.randn_like(x[:, :, :pad]), x], dim=2) for x in (q, k, v))
    mask = torch.ones(1, 12 + pad, dtype=torch.bool)
    mask[:, :pad] = False
    torch.testing.assert_close(mod(qp, kp, vp, causal=True, key_padding_mask=mask)[:, :, pad:], alone, rtol=0,
                               atol=1e-12)


def test_gradcheck_and_weight_gradients():
    mod = PolyAttention(PolyAttnConfig(kind="linear", window=2, short_conv=2), 2, 3, 1).double()
    with torch.no_grad():
        mod.conv_q.weight.add_(0.2)
        mod.conv_k.weight.sub_(0.1)
    q, k, v = qkv(1, 2, 1, 6, 6, 3, seed=7, grad=True)
    assert torch.autograd.gradcheck(lambda a, b, c: mod(a, b, c, causal=True), (q, k, v))
    params = [mod.conv_q.weight, mod.conv_k.weight]
    got = torch.autograd.grad(mod(q, k, v, causal=True).square().sum(), params)
    want = torch.autograd.grad(reference_attention(mod, q, k, v, causal=True).square().sum(), params)
    for a, b in zip(got, want):
        assert a.abs().sum() > 0
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_precision(dtype):
    mod = _module(KINDS["linear-window-sinks-gate"], dtype=dtype)
    q, k, v = (x.requires_grad_() for x in qkv(1, 4, 2, 40, 40, 8, seed=8, dtype=dtype))
    out = mod(q, k, v, causal=True)
    assert out.dtype == dtype and torch.isfinite(out).all()
    assert all(torch.isfinite(g).all() for g in torch.autograd.grad(out.float().square().mean(),
                                                                       [q, k, v, *mod.parameters()]))


def test_refusals():
    mod = _module(KINDS["performer"])
    q, k, v = qkv(1, 4, 2, 3, 9, 8, seed=9)
    with pytest.raises(ValueError, match="short_conv=3 convolves the queries of every key: it needs q_len == kv_len"):
        mod(q, k, v, causal=True)
    with pytest.raises(ValueError, match="short_conv must be an int >= 0"):
        PolyAttnConfig(kind="linear", short_conv=-1)
    with pytest.raises(ValueError, match="does not read short_conv"):
        PolyAttnConfig(kind="sliding_window", window=4, short_conv=4)
    with pytest.raises(ValueError, match="does not read short_conv"):
        PolyAttnConfig.for_kind("bigbird", short_conv=4)
