"""BigBird block-sparse attention (kinds/bigbird.py) against its naive dense-mask reference."""

from __future__ import annotations

import pytest
import torch

from hf_polyattn import PolyAttnConfig
from hf_polyattn.kinds.bigbird import BigBirdAttention, bigbird_reference
from hf_polyattn.registry import get_kind

from .inputs import padding_mask, qkv

D = 8

CONFIGS = [
    ("b4", dict(block=4)),
    ("b3-w1-g2-r2", dict(block=3, window_blocks=1, global_blocks=2, random_blocks=2)),
    ("b4-w5-g0-r1", dict(block=4, window_blocks=5, global_blocks=0, random_blocks=1)),
    ("b2-w3-g1-r0", dict(block=2, window_blocks=3, global_blocks=1, random_blocks=0)),
]

# (id, batch, heads, kv_heads, q_len, kv_len, causal, padding)
SHAPES = [
    ("causal-n1", 1, 2, 2, 1, 1, True, None),
    ("causal-n37-gqa", 2, 4, 2, 37, 37, True, None),
    ("causal-n23-padleft", 2, 2, 2, 23, 23, True, "left"),
    ("causal-n23-padright", 2, 2, 1, 23, 23, True, "right"),
    ("causal-q5-after-past21", 2, 4, 2, 5, 21, True, "left"),
    ("bidir-n30-gqa-padright", 2, 4, 2, 30, 30, False, "right"),
    ("bidir-n17-padleft", 2, 2, 2, 17, 17, False, "left"),
    ("bidir-q9-kv37", 2, 2, 2, 9, 37, False, "right"),
]


def _module(opts, heads=2, kv_heads=None, layer_idx=1, seed=None):
    extra = {} if seed is None else {"seed": seed}
    cfg = PolyAttnConfig(kind="bigbird", options=opts, **extra)
    return BigBirdAttention(cfg, heads, D, kv_heads, layer_idx=layer_idx).double()


@pytest.mark.parametrize("shape", SHAPES, ids=[s[0] for s in SHAPES])
@pytest.mark.parametrize("opts", [c[1] for c in CONFIGS], ids=[c[0] for c in CONFIGS])
def test_matches_reference(opts, shape):
    _, b, h, hkv, lq, lk, causal, pad = shape
    mod = _module(opts, h, hkv)
    q, k, v = qkv(b, h, hkv, lq, lk, D, seed=lq * 7 + lk, grad=True)
    mask = padding_mask(b, lk, pad)
    out = mod(q, k, v, causal=causal, key_padding_mask=mask)
    ref = bigbird_reference(mod, q, k, v, causal=causal, key_padding_mask=mask)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), g)
    want = torch.autograd.grad(ref, (q, k, v), g)
    for name, a, e in zip("qkv", got, want):
        torch.testing.assert_close(a, e, rtol=1e-9, atol=1e-10, msg=f"gradient of {name}")


def _influence(mod, n, causal, row):
    """The keys whose values change output row ``row`` (from the gradient of the values)."""
    q, k, v = qkv(1, 2, 2, n, n, D, seed=5, grad=True)
    out = mod(q, k, v, causal=causal)
    (gv,) = torch.autograd.grad(out[:, :, row].sum(), (v,))
    return set(torch.nonzero(gv.abs().sum(dim=(0, 1, 3)) > 0).flatten().tolist())


def test_attended_sets_follow_the_definition():
    """Block 4, n = 64 (16 blocks): a causal row reads the global block, its own block up to itself, the previous
    block and 3 random earlier blocks; a bidirectional row the global block, 3 window blocks and 3 random ones;
    a global row (bidirectional) reads every key."""
    mod = _module(dict(block=4))
    n, bs = 64, 4
    p = 45  # block 11
    keys = _influence(mod, n, True, p)
    rnd = mod.random_key_blocks(11, None)
    assert len(rnd) == 3 and all(1 <= c < 10 for c in rnd)
    want = {j for j in range(p + 1) if j // bs in {0, 10, 11, *rnd}}
    assert keys == want and len(want) == 4 + 4 + 2 + 12
    keys = _influence(mod, n, False, p)
    rnd = mod.random_key_blocks(11, 16)
    assert len(rnd) == 3 and all(c >= 1 and abs(c - 11) > 1 for c in rnd)
    assert keys == {j for j in range(n) if j // bs in {0, 10, 11, 12, *rnd}}
    assert _influence(mod, n, False, 2) == set(range(n))  # a global query reads every key
    assert _influence(mod, n, True, 2) == {0, 1, 2}  # ... causally
    # every query reads the global keys, causal ones only once they are in the past
    assert {0, 1, 2, 3} <= _influence(mod, n, True, 63)


def test_random_blocks_are_deterministic_and_seeded():
    a, b = _module(dict(block=4)), _module(dict(block=4))
    rows = [a.random_key_blocks(qb, None) for qb in range(40)]
    assert rows == [b.random_key_blocks(qb, None) for qb in range(40)]
    other_layer = _module(dict(block=4), layer_idx=2)
    other_seed = _module(dict(block=4), seed=7)
    assert rows != [other_layer.random_key_blocks(qb, None) for qb in range(40)]
    assert rows != [other_seed.random_key_blocks(qb, None) for qb in range(40)]
    for qb, row in enumerate(rows):  # causal: earlier blocks outside the window and the global block
        assert len(row) == min(3, max(0, qb - 2)) and len(set(row)) == len(row)
        assert all(1 <= c <= qb - 2 for c in row)
    for qb in range(20):  # bidirectional: outside the window and the global block
        row = a.random_key_blocks(qb, 20)
        assert len(row) == min(3, len([c for c in range(1, 20) if abs(c - qb) > 1]))
        assert all(1 <= c < 20 and abs(c - qb) > 1 for c in row)


def test_causal_and_cache_path():
    """Future tokens change no earlier row; decoding token by token (and chunked prefill) with a state gives
    the rows of one full call (rows depend on their absolute position, never on Lq)."""
    mod = _module(dict(block=3, random_blocks=2), 4, 2)
    q, k, v = qkv(2, 4, 2, 40, 40, D, seed=1)
    mask = torch.ones(2, 40, dtype=torch.bool)
    mask[1, :5] = False
    full = mod(q, k, v, causal=True, key_padding_mask=mask)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 25:] += 3.0
    v2[:, :, 25:] -= 2.0
    assert torch.equal(mod(q, k2, v2, causal=True, key_padding_mask=mask)[:, :, :25], full[:, :, :25])
    state, outs = mod.init_state(), []
    for s, t in ((0, 7), (7, 8), (8, 20), *((i, i + 1) for i in range(20, 40))):
        o, state = mod(q[:, :, s:t], k[:, :, s:t], v[:, :, s:t], causal=True, key_padding_mask=mask[:, s:t],
                       state=state)
        outs.append(o)
    assert state.length == 40 and state.k.shape[2] == 40
    torch.testing.assert_close(torch.cat(outs, dim=2), full, rtol=1e-12, atol=1e-12)


def test_bidirectional_rows_do_not_depend_on_q_len():
    mod = _module(dict(block=4), 4, 2)
    q, k, v = qkv(2, 4, 2, 33, 33, D, seed=2)
    full = mod(q, k, v, causal=False)
    for lq in (1, 6, 30):
        torch.testing.assert_close(mod(q[:, :, -lq:], k, v, causal=False), full[:, :, -lq:], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
def test_padding(causal):
    """Padded keys contribute nothing (any values there, any side); a right-padded row equals the row unpadded.
    Left padding moves the absolute positions (block boundaries, global tokens): no invariance promised."""
    mod = _module(dict(block=4), 2, 2)
    q, k, v = qkv(1, 2, 2, 29, 29, D, seed=3)
    alone = mod(q, k, v, causal=causal)
    pad = 7
    extra = qkv(1, 2, 2, pad, pad, D, seed=4)
    qp, kp, vp = (torch.cat([t, e], dim=2) for t, e in zip((q, k, v), extra))
    mask = torch.ones(1, 29 + pad, dtype=torch.bool)
    mask[:, 29:] = False
    right = mod(qp, kp, vp, causal=causal, key_padding_mask=mask)
    torch.testing.assert_close(right[:, :, :29], alone, rtol=1e-12, atol=1e-12)
    for side in ("left", "right"):
        mask = padding_mask(2, 29, side)
        q2, k2, v2 = qkv(2, 2, 2, 29, 29, D, seed=6)
        base = mod(q2, k2, v2, causal=causal, key_padding_mask=mask)
        k3, v3 = k2.clone(), v2.clone()
        k3[~mask[:, None, :, None].expand_as(k3)] = 50.0
        v3[~mask[:, None, :, None].expand_as(v3)] = -50.0
        torch.testing.assert_close(mod(q2, k3, v3, causal=causal, key_padding_mask=mask), base, rtol=0, atol=1e-12)


def test_differs_from_full_softmax_and_is_sparse_enough():
    mod = _module(dict(block=4))
    n = 96
    assert len(_influence(mod, n, True, 90)) < 40  # global 4 + window 4 + 3 (own, up to itself) + random 12
    q, k, v = qkv(1, 2, 2, n, n, D, seed=8)
    dense = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert (mod(q, k, v, causal=True) - dense).abs().max() > 1e-3
    # with every block selected it is exact softmax attention
    full = _module(dict(block=4, window_blocks=2 * (n // 4) + 1))
    torch.testing.assert_close(full(q, k, v, causal=True), dense, rtol=1e-10, atol=1e-10)
    dense = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    torch.testing.assert_close(full(q, k, v, causal=False), dense, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_precision_is_finite(dtype):
    mod = BigBirdAttention(PolyAttnConfig(kind="bigbird", options=dict(block=8)), 4, D, 2)
    q, k, v = qkv(2, 4, 2, 70, 70, D, seed=9, dtype=dtype, draw_dtype=torch.float64)
    q = q * 30  # large logits
    mask = padding_mask(2, 70, "left")
    for causal in (True, False):
        out = mod(q, k, v, causal=causal, key_padding_mask=mask)
        assert out.dtype == dtype and torch.isfinite(out).all()


def test_large_sequence_runs():
    """n = 4096 in float32: the sparse path (no n x n matrix) stays quick."""
    mod = BigBirdAttention(PolyAttnConfig(kind="bigbird", options=dict(block=64)), 2, 16, 1)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 4096, 16, generator=gen)
    k, v = (torch.randn(1, 1, 4096, 16, generator=gen) for _ in range(2))
    for causal in (True, False):
        assert torch.isfinite(mod(q, k, v, causal=causal)).all()


@pytest.mark.parametrize("bad, name", [
    (dict(block=0), "block"),
    (dict(window_blocks=2), "window_blocks"),
    (dict(window_blocks=0), "window_blocks"),
    (dict(global_blocks=-1), "global_blocks"),
    (dict(random_blocks=-2), "random_blocks"),
    (dict(block=2.5), "block"),
    (dict(blocks=4), "blocks"),
])
def test_bad_options(bad, name):
    with pytest.raises(ValueError, match=name):
        PolyAttnConfig(kind="bigbird", options=bad)


def test_spec():
    spec = get_kind("bigbird")
    assert spec.causal and spec.bidirectional and spec.linear_time and spec.fields == ("seed",)
    assert "2007.14062" in spec.title
    for row, kwargs in spec.bench.items():
        cfg = PolyAttnConfig(**kwargs)
        assert cfg.kind == "bigbird" and row == "bigbird-64" and cfg.options["block"] == 64
    assert "block=64" in spec.table_label(PolyAttnConfig(kind="bigbird"))
    mod = BigBirdAttention(PolyAttnConfig(kind="bigbird"), 2, D)
    assert mod.block == 64 and mod.window_blocks == 3 and mod.global_blocks == 1 and mod.random_blocks == 3
    q, k, v = qkv(1, 2, 2, 3, 3, D, seed=0, dtype=torch.float32, draw_dtype=torch.float64)
    assert torch.isfinite(mod(q, k, v, causal=True)).all()


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
def test_fully_padded_row_gives_zeros(causal):
    mod = _module(dict(block=4), 4, 2)
    q, k, v = qkv(2, 4, 2, 19, 19, D, seed=10, grad=True)
    mask = torch.ones(2, 19, dtype=torch.bool)
    mask[0] = False
    out = mod(q, k, v, causal=causal, key_padding_mask=mask)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    torch.testing.assert_close(out[1:], mod(q[1:], k[1:], v[1:], causal=causal), rtol=1e-12, atol=1e-12)
    assert all(torch.isfinite(g).all() for g in torch.autograd.grad(out.sum(), (q, k, v)))
