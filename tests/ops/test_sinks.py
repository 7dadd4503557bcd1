"""Attention sinks (``sinks``) and learned sink slots (``learned_sinks``) beside the sliding window, against the naive
definition in ops/reference.py: values and every gradient in float64, causality, padding, grouped-query attention,
chunked prefill and token-by-token decoding equal to the full forward, half-precision inputs, the slots' start."""

from __future__ import annotations

import pytest
import torch

from hf_polyattn import PolyAttnConfig
from hf_polyattn.ops import PolyAttention, reference_attention
from hf_polyattn.ops.backend import ENV_VAR
from hf_polyattn.ops.reference import reference_weights
from hf_polyattn.ops.rotary import RopeRotation
from hf_polyattn.ops.window import first_true, keep_sinks, sink_flags

from .test_attention import _padding_mask
from .test_window import SHAPES, _module

D = 8
# a RoPE with a small base: angles of order 1 per position on every pair, so that a wrong rotation shows
ROPE = RopeRotation(1.0 / 10.0 ** (torch.arange(0, D, 2, dtype=torch.float64) / D), D)

CONFIGS = [
    ("ps4-softmax-w5-s3", dict(kind="polysketch", sketch_size=8, window=5, sinks=3)),
    ("ps4-poly-w4-s2-l3-norm", dict(kind="polysketch", sketch="learned", sketch_size=8, window=4,
                                    local_kernel="polynomial", qk_norm=True, sinks=2, learned_sinks=3)),
    ("linear-elu-w4-s2-l3", dict(kind="linear", window=4, sinks=2, learned_sinks=3)),
    ("performer-w4-s3-mix", dict(kind="performer", num_features=16, window=4, sinks=3, window_mix=True)),
    ("taylor-poly-w3-s1", dict(kind="taylor", window=3, local_kernel="polynomial", sinks=1)),
    ("hedgehog-w4-l2", dict(kind="linear", feature_map="hedgehog", window=4, learned_sinks=2)),
    ("linear-proj-w3-l4", dict(kind="linear", feature_proj=12, window=3, learned_sinks=4)),
    ("sliding-w4-s2", dict(kind="sliding_window", window=4, sinks=2)),
    ("sliding-poly-w5-s3-l2", dict(kind="sliding_window", window=5, local_kernel="polynomial", degree=2, sinks=3,
                                   learned_sinks=2)),
]

def _qkv(b, h, hkv, lq, lk, seed, grad=True):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(b, heads, n, D, generator=gen, dtype=torch.float64, requires_grad=grad)
            for heads, n in ((h, lq), (hkv, lk), (hkv, lk))]


def _assert_grads_match(out, ref, inputs, what=""):
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, inputs, g, allow_unused=True)
    want = torch.autograd.grad(ref, inputs, g, allow_unused=True)
    for i, (a, e) in enumerate(zip(got, want)):
        if a is None or e is None:  # unused (no key beyond the window): the other must be zero too
            assert (a is None or not a.abs().any()) and (e is None or not e.abs().any()), f"{what} gradient {i}"
        else:
            torch.testing.assert_close(a, e, rtol=1e-8, atol=1e-9, msg=f"{what} gradient {i}")


def assert_matches_reference(pa, shape) -> None:
    """``pa`` on the inputs of one of test_window's SHAPES against ``reference_attention``: values, and the gradients
    of q, k, v and every parameter (float64)."""
    _, b, h, hkv, lq, lk, causal, pad = shape
    q, k, v = _qkv(b, h, hkv, lq, lk, seed=lq * 7 + lk)
    mask = _padding_mask(b, lk, pad)
    out = pa(q, k, v, causal=causal, key_padding_mask=mask)
    ref = reference_attention(pa, q, k, v, causal=causal, key_padding_mask=mask)
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-9)
    _assert_grads_match(out, ref, (q, k, v, *pa.parameters()))


@pytest.mark.parametrize("shape", SHAPES, ids=[s[0] for s in SHAPES])
@pytest.mark.parametrize("opts", [c[1] for c in CONFIGS], ids=[c[0] for c in CONFIGS])
def test_sinks_match_reference(opts, shape):
    _, b, h, hkv, lq, lk, causal, pad = shape
    pa = _module(opts, h, hkv)
    if opts.get("sinks") and not causal:
        q, k, v = _qkv(b, h, hkv, lq, lk, seed=0)
        with pytest.raises(ValueError, match=r"^sinks=\d+ is defined for causal attention only"):
            pa(q, k, v, causal=causal, key_padding_mask=_padding_mask(b, lk, pad))
        return
    assert_matches_reference(pa, shape)


def test_reference_weights_definition():
    """The naive definition itself, causal, sliding_window kind, w = 3, s = 2, row 0 left-padded by 2: a query sees
    its window and its row's first 2 real keys (never a future one), nothing else; slots in front, seen by all."""
    pa = _module(dict(kind="sliding_window", window=3, sinks=2, learned_sinks=1), 2, 2)
    q, k, _ = _qkv(2, 2, 2, 9, 9, seed=0, grad=False)
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[0, :2] = False
    w = reference_weights(pa, q, k, causal=True, key_padding_mask=mask)
    assert w.shape == (2, 2, 9, 1 + 9)
    assert (w[..., 0] > 0).all()  # the slot
    seen = w[..., 1:] > 0
    for row, sinks in ((0, {2, 3}), (1, {0, 1})):
        for i in range(9):
            want = {j for j in range(9) if (i - 3 < j <= i or (j in sinks and j <= i)) and mask[row, j]}
            assert {j for j in range(9) if seen[row, 0, i, j]} == want, (row, i)


@pytest.mark.parametrize("opts", [c[1] for c in CONFIGS if c[1].get("sinks")],
                         ids=[c[0] for c in CONFIGS if c[1].get("sinks")])
def test_sinks_change_what_they_should(opts):
    """Against the same module without sinks: the outputs of queries whose window still covers the first keys are
    the same, every later one differs (an implementation that ignored sinks would pass the reference test only if
    the reference ignored them too)."""
    pa = _module(opts, 2, 2)
    plain = PolyAttention(PolyAttnConfig(block_size=4, **{**opts, "sinks": 0}), 2, D, 2, layer_idx=1).double()
    plain.load_state_dict(pa.state_dict())
    q, k, v = _qkv(1, 2, 2, 16, 16, seed=3, grad=False)
    a, b = pa(q, k, v, causal=True), plain(q, k, v, causal=True)
    same = (a - b).abs().amax(dim=(0, 1, 3)) < 1e-12
    w = opts["window"]
    assert same[:w].all() and not same[w:].any(), same


# every config; with a RoPE (sink_position='window' re-rotating the queries of the sinks) those with sinks
CHUNKED_CASES = [pytest.param(opts, None, id=name) for name, opts in CONFIGS]
CHUNKED_CASES += [pytest.param(opts, ROPE, id=f"rope-{name}") for name, opts in CONFIGS if opts.get("sinks")]


@pytest.mark.parametrize("opts,rope", CHUNKED_CASES)
def test_causal_and_chunked_equal_full(opts, rope):
    """Future keys change no earlier output; chunked prefill (chunks shorter and longer than the window, the first
    one all padding in row 0) then token-by-token decoding give the full forward, left-padded rows included, with
    a state of constant size (the last w keys, the s sinks); with a RoPE the state counts each row's real keys
    (``seen``) once a key was padded, and the sequence reaches beyond w + s."""
    pa = _module(opts, 4, 2)
    pa.rope = rope
    n = 26
    q, k, v = _qkv(2, 4, 2, n, n, seed=1, grad=False)
    mask = torch.ones(2, n, dtype=torch.bool)
    mask[0, :7] = False
    w, s = pa.config.window, pa.config.sinks
    for m in (None, mask):
        full = pa(q, k, v, causal=True, key_padding_mask=m)
        k2, v2 = k.clone(), v.clone()
        k2[:, :, 15:] += 3.0
        v2[:, :, 15:] -= 2.0
        assert torch.equal(pa(q, k2, v2, causal=True, key_padding_mask=m)[:, :, :15], full[:, :, :15])
        state, outs = pa.init_state(), []
        for a, b in ((0, 2), (2, 9), (9, 10), (10, 13), (13, 20), *((i, i + 1) for i in range(20, n))):
            o, state = pa(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], causal=True, state=state,
                          key_padding_mask=None if m is None else m[:, a:b])
            outs.append(o)
            assert state.k.shape[2] == min(w, b)
            assert state.seen is None if rope is None or m is None else torch.equal(state.seen, m[:, :b].sum(-1))
            if s and b > w:  # sink slots exist once a key has left the window, always s of them
                assert state.sink_k.shape == (2, 2, s, D) and state.sink_mask.shape == (2, s)
            elif s:
                assert state.sink_k is None
        torch.testing.assert_close(torch.cat(outs, dim=2), full, rtol=1e-10, atol=1e-10)
        if s:  # row 0's sinks are its first real keys, 7.. (left padding), row 1's 0..
            for row, first in ((0, 0 if m is None else 7), (1, 0)):
                assert state.sink_mask[row].all()
                torch.testing.assert_close(state.sink_k[row], k[row, :, first : first + s])


def test_backends_agree(monkeypatch):
    pa = _module(dict(kind="polysketch", sketch_size=8, window=5, sinks=2, learned_sinks=2), 4, 2)
    q, k, v = _qkv(2, 4, 2, 30, 30, seed=3)
    results = []
    for which in ("loop", "batched"):
        monkeypatch.setenv(ENV_VAR, which)
        out = pa(q, k, v, causal=True)
        results.append((out, torch.autograd.grad(out.sum(), (q, k, v, pa.sink_k, pa.sink_v))))
    (o1, g1), (o2, g2) = results
    torch.testing.assert_close(o1, o2, rtol=1e-10, atol=1e-10)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_gradcheck():
    """Finite differences of q, k, v and the learned slots (given to the module by ``functional_call``)."""
    from torch.func import functional_call

    pa = _module(dict(kind="linear", window=3, sinks=2, learned_sinks=2), 2, 1)
    q, k, v = _qkv(1, 2, 1, 9, 9, seed=4)
    mask = torch.ones(1, 9, dtype=torch.bool)
    mask[0, :2] = False

    def attend(q, k, v, sink_k, sink_v):
        return functional_call(pa, {"sink_k": sink_k, "sink_v": sink_v}, (q, k, v),
                               dict(causal=True, key_padding_mask=mask))

    slots = (pa.sink_k.detach().clone().requires_grad_(), pa.sink_v.detach().clone().requires_grad_())
    assert torch.autograd.gradcheck(attend, (q, k, v, *slots))


@pytest.mark.parametrize("kernel", ["softmax", "polynomial"])
def test_untrained_slots_stay_near_the_model(kernel):
    """Zero keys and values: a polynomial window (alpha 0) gives a slot weight 0^p = 0, so nothing changes; a softmax
    window adds exp(-m_i) per slot to the denominator alone, so each output row is the slot-free row times one
    factor in (0, 1]. reset_parameters puts the slots back to zero."""
    opts = dict(kind="linear", window=4, local_kernel=kernel, degree=2)
    base = PolyAttention(PolyAttnConfig(**opts), 2, D, 1).double()
    slots = PolyAttention(PolyAttnConfig(**opts, learned_sinks=8), 2, D, 1).double()
    slots.load_state_dict(base.state_dict(), strict=False)
    assert not slots.sink_k.abs().any() and not slots.sink_v.abs().any()
    q, k, v = _qkv(2, 2, 1, 11, 11, seed=5, grad=False)
    a, b = base(q, k, v, causal=True), slots(q, k, v, causal=True)
    if kernel == "polynomial":
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)
    else:
        ratio = b / a
        torch.testing.assert_close(ratio, ratio[..., :1].expand_as(ratio), rtol=1e-9, atol=1e-9)
        assert (ratio > 0).all() and (ratio <= 1).all() and (ratio < 1 - 1e-6).any()
    with torch.no_grad():
        slots.sink_k.normal_()
        slots.sink_v.normal_()
    slots.reset_parameters()
    assert not slots.sink_k.abs().any() and not slots.sink_v.abs().any()


@pytest.mark.parametrize("rope", [None, "rope", "interleaved"], ids=["own-positions", "rope", "rope-interleaved"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("opts", [dict(kind="polysketch", sketch_size=8, window=8, sinks=4, learned_sinks=4),
                                  dict(kind="sliding_window", window=8, sinks=4, learned_sinks=4)],
                         ids=["polysketch", "sliding"])
def test_half_inputs_finite(opts, dtype, rope):
    """Scores of +-60 (q, k scaled by 8): exp would overflow fp16 without the float32 compute and the stabiliser; also
    with the sinks scored by queries re-rotated with a RoPE (``sink_position='window'``, rotate_half and GPT-J's
    interleaved pairs) beyond w + s = 12."""
    pa = PolyAttention(PolyAttnConfig(block_size=16, **opts), 4, D, 2).to(dtype)
    if rope:
        inv_freq = 1.0 / 10000 ** (torch.arange(0, D, 2, dtype=torch.float32) / D)
        pa.rope = RopeRotation(inv_freq, D) if rope == "rope" else RopeRotation.interleaved(inv_freq)
    with torch.no_grad():
        pa.sink_k.normal_()
        pa.sink_v.normal_()
    gen = torch.Generator().manual_seed(6)
    q, k, v = ((s * torch.randn(2, h, 64, D, generator=gen)).to(dtype).requires_grad_()
               for h, s in ((4, 8.0), (2, 8.0), (2, 1.0)))
    mask = torch.ones(2, 64, dtype=torch.bool)
    mask[0, :9] = False
    out = pa(q, k, v, causal=True, key_padding_mask=mask)
    assert out.dtype == dtype and torch.isfinite(out).all()
    grads = torch.autograd.grad(out.float().square().sum(), (q, k, v, pa.sink_k, pa.sink_v))
    assert all(torch.isfinite(g).all() for g in grads)


def test_sink_helpers():
    mask = torch.tensor([[False, False, True, True, False, True, True], [True] * 7])
    flags = sink_flags(mask, 7, torch.tensor([2, 3]), "cpu")
    assert flags.tolist() == [[False, False, True, True, False, False, False], [True, True, True] + [False] * 4]
    assert sink_flags(None, 4, 2, "cpu").tolist() == [[True, True, False, False]]
    idx, found = first_true(flags, 3)
    assert found.tolist() == [[True, True, False], [True, True, True]]
    assert idx[found].tolist() == [2, 3, 0, 1, 2]
    # keep_sinks: kept slots first, then the leaving sinks in order, in ``count`` slots
    k = torch.arange(2 * 1 * 4 * 1, dtype=torch.float64).view(2, 1, 4, 1)
    kept_k, kept_v, filled = keep_sinks(None, None, None, k[:, :, :2], k[:, :, :2],
                                        torch.tensor([[False, True], [True, True]]), 2)
    assert filled.tolist() == [[True, False], [True, True]] and kept_k[0, 0, 0, 0] == 1
    kept_k, _, filled = keep_sinks(kept_k, kept_v, filled, k[:, :, 2:], k[:, :, 2:],
                                   torch.tensor([[True, False], [True, True]]), 2)
    assert filled.all() and kept_k[:, 0, :, 0].tolist() == [[1.0, 2.0], [4.0, 5.0]]


@pytest.mark.parametrize("opts,match", [
    (dict(kind="linear", sinks=4), r"^sinks=4 needs window > 0"),
    (dict(kind="performer", learned_sinks=2), r"^learned_sinks=2 needs window > 0"),
    (dict(kind="polysketch", window=8, sinks=-1), r"^sinks must be an int >= 0, got -1"),
    (dict(kind="linear", window=8, learned_sinks=2.0), r"^learned_sinks must be an int >= 0, got 2\.0"),
    (dict(kind="polynomial", degree=2, sinks=4), r"kind='polynomial' does not read sinks"),
    (dict(kind="bigbird", learned_sinks=1), r"kind='bigbird' does not read learned_sinks"),
])
def test_config_validation(opts, match):
    with pytest.raises(ValueError, match=match):
        PolyAttnConfig(**opts)


def test_labels_and_memory_notes():
    cfg = PolyAttnConfig(kind="sliding_window", window=128, sinks=4)
    assert cfg.spec.table_label(cfg) == ("sliding_window (exact softmax 128-token sliding window + 4 sink tokens "
                                         "(positions within the window): StreamingLLM, training-free)")
    assert "the first 4 and the last 128 keys and values" in cfg.spec.memory_note(cfg)
    assert "132 keys" in cfg.spec.memory_note(cfg)
    cfg = PolyAttnConfig(kind="polysketch", window=64, sinks=1, learned_sinks=8)
    assert "64-token sliding window + 1 sink token (positions within the window) + 8 learned sink slots" in \
        cfg.spec.table_label(cfg)
    assert "65 keys" in cfg.spec.memory_note(cfg)
    assert "sink" not in PolyAttnConfig(kind="linear", window=4).spec.memory_note(PolyAttnConfig(kind="linear",
                                                                                                window=4))
