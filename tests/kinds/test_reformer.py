"""Reformer LSH attention (kinds/reformer.py) against its naive dense union-mask reference."""

from __future__ import annotations

import pytest
import torch

from hf_polyattn import PolyAttnConfig
from hf_polyattn.kinds.reformer import ReformerAttention, reformer_reference
from hf_polyattn.registry import get_kind

from .inputs import padding_mask, qkv

D = 8

CONFIGS = [
    ("shared-4b-w3", dict(num_buckets=4, bucket_window=3)),
    ("shared-6b-3h-w2", dict(num_buckets=6, num_hashes=3, bucket_window=2)),
    ("shared-2b-1h-w5", dict(num_buckets=2, num_hashes=1, bucket_window=5)),
    ("own-k-4b-3h-w2", dict(num_buckets=4, num_hashes=3, bucket_window=2, shared_qk=False)),
    ("own-k-2b-2h-w4", dict(num_buckets=2, num_hashes=2, bucket_window=4, shared_qk=False)),
]

# (id, batch, heads, kv_heads, q_len, kv_len, causal, padding); q_len < kv_len only without shared QK
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
    cfg = PolyAttnConfig(kind="reformer", options=opts, **extra)
    return ReformerAttention(cfg, heads, D, kv_heads, layer_idx=layer_idx).double()


@pytest.mark.parametrize("shape", SHAPES, ids=[s[0] for s in SHAPES])
@pytest.mark.parametrize("opts", [c[1] for c in CONFIGS], ids=[c[0] for c in CONFIGS])
def test_matches_reference(opts, shape):
    _, b, h, hkv, lq, lk, causal, pad = shape
    mod = _module(opts, h, hkv)
    q, k, v = qkv(b, h, hkv, lq, lk, D, seed=lq * 7 + lk, grad=True)
    mask = padding_mask(b, lk, pad)
    if mod.shared_qk and lq != lk:
        with pytest.raises(ValueError, match="shared_qk"):
            mod(q, k, v, causal=causal, key_padding_mask=mask)
        return
    out = mod(q, k, v, causal=causal, key_padding_mask=mask)
    ref = reformer_reference(mod, q, k, v, causal=causal, key_padding_mask=mask)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), g, allow_unused=True)
    want = torch.autograd.grad(ref, (q, k, v), g, allow_unused=True)
    for name, a, e in zip("qkv", got, want):
        if mod.shared_qk and name == "k":  # the model's keys are not read: keys are the normalised queries
            assert a is None and e is None
            continue
        torch.testing.assert_close(a, e, rtol=1e-9, atol=1e-10, msg=f"gradient of {name}")


def test_rounds_are_counted_once():
    """Two identical hashing rounds attend to the same pairs: the union softmax equals one round (a pair found
    in both rounds is not counted twice)."""
    one = _module(dict(num_buckets=4, num_hashes=1, bucket_window=3))
    two = _module(dict(num_buckets=4, num_hashes=2, bucket_window=3))
    rot = one.rotations(torch.device("cpu"), torch.float64)
    two._rotations[("cpu", torch.float64)] = torch.cat([rot, rot])
    q, k, v = qkv(2, 2, 2, 31, 31, D, seed=1)
    for causal in (True, False):
        torch.testing.assert_close(two(q, k, v, causal=causal), one(q, k, v, causal=causal), rtol=1e-12, atol=1e-12)
        ref = reformer_reference(two, q, k, v, causal=causal)
        torch.testing.assert_close(two(q, k, v, causal=causal), ref, rtol=1e-12, atol=1e-12)


def _influence(mod, q, k, v, causal, row, head=0):
    """Keys whose values change output row ``row`` of ``head`` (heads = kv heads here)."""
    v = v.detach().clone().requires_grad_(True)
    out = mod(q, k, v, causal=causal)
    (gv,) = torch.autograd.grad(out[0, head, row].sum(), (v,))
    return set(torch.nonzero(gv[0, head].abs().sum(-1) > 0).flatten().tolist())


def test_attended_sets_follow_the_definition():
    """One round: a causal query reads the last bucket_window keys of its bucket up to itself (shared QK: not
    itself); bidirectional ones within bucket_window ranks on both sides."""
    w = 3
    mod = _module(dict(num_buckets=4, num_hashes=1, bucket_window=w), 1)
    q, k, v = qkv(1, 1, 1, 40, 40, D, seed=2)
    keys = torch.nn.functional.normalize(q, dim=-1, eps=1e-6)
    bucket = mod.buckets(keys)[0, 0, 0].tolist()
    for p in range(40):
        same = [j for j in range(40) if bucket[j] == bucket[p]]
        r = same.index(p)
        causal = set(same[max(0, r - w + 1): r + 1]) - {p} or {p}
        bidir = set(same[max(0, r - w + 1): r + w]) - {p} or {p}
        assert _influence(mod, q, k, v, True, p) == causal, p
        assert _influence(mod, q, k, v, False, p) == bidir, p
    assert _influence(mod, q, k, v, True, 0) == {0}  # the first token has only itself
    torch.testing.assert_close(mod(q, k, v, causal=True)[:, :, 0], v[:, :, 0], rtol=1e-12, atol=1e-12)


def test_own_keys_are_hashed_with_the_same_rotations():
    mod = _module(dict(num_buckets=4, num_hashes=1, bucket_window=2, shared_qk=False), 1)
    q, k, v = qkv(1, 1, 1, 30, 30, D, seed=3)
    qb, kb = mod.buckets(q)[0, 0, 0].tolist(), mod.buckets(k)[0, 0, 0].tolist()
    for p in (0, 9, 29):
        keys = [j for j in range(p + 1) if kb[j] == qb[p]]
        assert _influence(mod, q, k, v, True, p) == set(keys[-2:])  # itself included when in its bucket


@pytest.mark.parametrize("opts", [CONFIGS[0][1], CONFIGS[3][1]], ids=["shared", "own-k"])
def test_causal_and_cache_path(opts):
    """Future tokens change no earlier row; decoding token by token (and chunked prefill) with a state gives the
    rows of one full call, with padding on the left of one batch row."""
    mod = _module(opts, 4, 2)
    q, k, v = qkv(2, 4, 2, 40, 40, D, seed=4)
    mask = torch.ones(2, 40, dtype=torch.bool)
    mask[1, :5] = False
    full = mod(q, k, v, causal=True, key_padding_mask=mask)
    q2, k2, v2 = q.clone(), k.clone(), v.clone()
    q2[:, :, 25:] *= -2.0
    k2[:, :, 25:] += 3.0
    v2[:, :, 25:] -= 2.0
    assert torch.equal(mod(q2, k2, v2, causal=True, key_padding_mask=mask)[:, :, :25], full[:, :, :25])
    state, outs = mod.init_state(), []
    for s, t in ((0, 7), (7, 8), (8, 20), *((i, i + 1) for i in range(20, 40))):
        o, state = mod(q[:, :, s:t], k[:, :, s:t], v[:, :, s:t], causal=True, key_padding_mask=mask[:, s:t],
                       state=state)
        outs.append(o)
    assert state.length == 40 and state.k.shape[1] == (4 if mod.shared_qk else 2)  # one key head per query head
    torch.testing.assert_close(torch.cat(outs, dim=2), full, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
@pytest.mark.parametrize("opts", [CONFIGS[1][1], CONFIGS[3][1]], ids=["shared", "own-k"])
def test_padding_is_exact(opts, causal):
    """Only the order of the unpadded keys enters: padded keys contribute nothing, and a left- or right-padded
    row equals the row unpadded."""
    mod = _module(opts, 2, 2)
    q, k, v = qkv(1, 2, 2, 26, 26, D, seed=5)
    alone = mod(q, k, v, causal=causal)
    left, right = qkv(1, 2, 2, 4, 4, D, seed=6), qkv(1, 2, 2, 5, 5, D, seed=7)
    qp, kp, vp = (torch.cat([a, t, c], dim=2) for a, t, c in zip(left, (q, k, v), right))
    mask = torch.zeros(1, 35, dtype=torch.bool)
    mask[:, 4:30] = True
    padded = mod(qp, kp, vp, causal=causal, key_padding_mask=mask)
    torch.testing.assert_close(padded[:, :, 4:30], alone, rtol=1e-12, atol=1e-12)
    assert torch.isfinite(padded).all()


def test_bucket_window_and_hashes_matter():
    q, k, v = qkv(1, 2, 2, 64, 64, D, seed=8)
    base = _module(dict(num_buckets=4, bucket_window=4))(q, k, v, causal=True)
    assert (_module(dict(num_buckets=4, bucket_window=8))(q, k, v, causal=True) - base).abs().max() > 1e-3
    assert (_module(dict(num_buckets=4, bucket_window=4, num_hashes=1))(q, k, v, causal=True) - base).abs().max() > 1e-3
    # one bucket, a window over everything, own keys: exact softmax attention
    every = _module(dict(num_buckets=2, num_hashes=1, bucket_window=64, shared_qk=False))
    every._rotations[("cpu", torch.float64)] = torch.zeros(1, 2, D, 1, dtype=torch.float64)
    dense = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(every(q, k, v, causal=True), dense, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("shared", [True, False], ids=["shared", "own-k"])
def test_half_precision_is_finite(dtype, shared):
    mod = ReformerAttention(PolyAttnConfig(kind="reformer", options=dict(num_buckets=4, bucket_window=8,
                                                                        shared_qk=shared)), 4, D, 2)
    q, k, v = qkv(2, 4, 2, 70, 70, D, seed=9, dtype=dtype, draw_dtype=torch.float64)
    q = q * 30
    mask = padding_mask(2, 70, "left")
    for causal in (True, False):
        out = mod(q, k, v, causal=causal, key_padding_mask=mask)
        assert out.dtype == dtype and torch.isfinite(out).all()


def test_large_sequence_runs():
    """n = 4096 in float32 with the default options: the chunked sorted path stays quick."""
    mod = ReformerAttention(PolyAttnConfig(kind="reformer"), 2, 16, 1)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 4096, 16, generator=gen)
    k, v = (torch.randn(1, 1, 4096, 16, generator=gen) for _ in range(2))
    for causal in (True, False):
        assert torch.isfinite(mod(q, k, v, causal=causal)).all()


@pytest.mark.parametrize("bad, name", [
    (dict(num_buckets=5), "num_buckets"),
    (dict(num_buckets=0), "num_buckets"),
    (dict(num_hashes=0), "num_hashes"),
    (dict(bucket_window=0), "bucket_window"),
    (dict(shared_qk="yes"), "shared_qk"),
    (dict(buckets=4), "buckets"),
])
def test_bad_options(bad, name):
    with pytest.raises(ValueError, match=name):
        PolyAttnConfig(kind="reformer", options=bad)


def test_shared_qk_needs_the_queries_as_keys():
    mod = _module(dict(num_buckets=4), 2, 2)
    q, k, v = qkv(1, 2, 2, 3, 9, D, seed=0)
    with pytest.raises(ValueError, match="shared_qk"):
        mod(q, k, v, causal=False)


def test_spec_and_seed():
    spec = get_kind("reformer")
    assert spec.causal and spec.bidirectional and spec.linear_time and spec.fields == ("seed",)
    assert "2001.04451" in spec.title
    assert list(spec.bench) == ["reformer-2x32"]
    cfg = PolyAttnConfig(**spec.bench["reformer-2x32"])
    assert cfg.options == {"num_buckets": 32, "num_hashes": 2, "bucket_window": 64, "shared_qk": True}
    assert "2x32" in spec.table_label(cfg)
    a, b = _module({}), _module({}, layer_idx=2)
    ra = a.rotations(torch.device("cpu"), torch.float64)
    assert ra.shape == (2, 2, D, 16)
    assert torch.equal(ra, _module({}).rotations(torch.device("cpu"), torch.float64))
    assert not torch.equal(ra, b.rotations(torch.device("cpu"), torch.float64))


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
@pytest.mark.parametrize("shared", [True, False], ids=["shared", "own-k"])
def test_fully_padded_row_gives_zeros(causal, shared):
    mod = _module(dict(num_buckets=4, bucket_window=3, shared_qk=shared), 4, 2)
    q, k, v = qkv(2, 4, 2, 19, 19, D, seed=10, grad=True)
    mask = torch.ones(2, 19, dtype=torch.bool)
    mask[0] = False
    out = mod(q, k, v, causal=causal, key_padding_mask=mask)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    torch.testing.assert_close(out[1:], mod(q[1:], k[1:], v[1:], causal=causal), rtol=1e-12, atol=1e-12)
    grads = torch.autograd.grad(out.sum(), (q, k, v), allow_unused=True)
    assert all(g is None or torch.isfinite(g).all() for g in grads)
