"""Sinks scored at positions within the window (``sink_position='window'`` with a RoPE rotation on the module)
against the naive definition in ops/reference.py: values and every gradient in float64, causality, padding,
grouped-query attention, chunked prefill and decoding equal to the full forward; the invariance the setting is for (a
far query scores the sinks as a query at w + s - 1 with the same content does); 'own' and modules without RoPE
unchanged, bit for bit; the rotation itself; config errors and labels. (Half-precision inputs, and chunked prefill and
decoding of more configs: test_sinks.py, its 'rope' cases.)"""

from __future__ import annotations

import pytest
import torch

from hf_polyattn import PolyAttnConfig
from hf_polyattn.ops import HybridAttention, PolyAttention, reference_attention
from hf_polyattn.ops.hybrid import hybrid_reference
from hf_polyattn.ops.reference import reference_weights
from hf_polyattn.ops.rotary import RopeRotation
from hf_polyattn.ops.window import sink_shifts

from .test_attention import _padding_mask
from .test_sinks import _assert_grads_match, _qkv, assert_matches_reference
from .test_window import CHUNKS, SHAPES, recurrent_outputs

D = 8


def _rope(rotary_dim: int = D, base: float = 10.0) -> RopeRotation:
    """A RoPE with a small base: angles of order 1 per position on every pair, so that a wrong rotation shows."""
    return RopeRotation(1.0 / base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim), rotary_dim)


def _module(opts, heads, kv_heads, rope=None, **extra):
    pa = PolyAttention(PolyAttnConfig(block_size=4, **opts, **extra), heads, D, kv_heads, layer_idx=1).double()
    with torch.no_grad():  # learnable tensors off their start: slots, mixing factor, LayerNorms matter
        gen = torch.Generator().manual_seed(11)
        for p in pa.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    pa.rope = _rope() if rope is None else rope
    return pa


CONFIGS = [
    ("sliding-w4-s2-l2", dict(kind="sliding_window", window=4, sinks=2, learned_sinks=2)),
    ("sliding-poly-w5-s3", dict(kind="sliding_window", window=5, local_kernel="polynomial", degree=2, sinks=3)),
    ("linear-w3-s2-mix", dict(kind="linear", window=3, sinks=2, window_mix=True)),
    ("ps4-w4-s3-l1-norm", dict(kind="polysketch", sketch="learned", sketch_size=8, window=4, sinks=3,
                               learned_sinks=1, qk_norm=True, feature_proj=12)),
    ("performer-w4-s2", dict(kind="performer", num_features=16, window=4, sinks=2)),
    ("linear-w3-s1-gate", dict(kind="linear", window=3, sinks=1, decay="gate")),
]
CAUSAL_SHAPES = [s for s in SHAPES if s[6]]


@pytest.mark.parametrize("shape", CAUSAL_SHAPES, ids=[s[0] for s in CAUSAL_SHAPES])
@pytest.mark.parametrize("opts", [c[1] for c in CONFIGS], ids=[c[0] for c in CONFIGS])
def test_matches_reference(opts, shape):
    """Values and the gradients of q, k, v and every parameter, the reference re-rotating query by query."""
    assert_matches_reference(_module(opts, shape[2], shape[3]), shape)


def _rotated(x: torch.Tensor, positions: torch.Tensor, rope: RopeRotation) -> torch.Tensor:
    """x (..., n, d) rotated at ``positions`` (n,) as transformers' Llama does: x cos + rotate_half(x) sin on the
    rotary dims, cos/sin of the frequencies repeated twice."""
    angle = positions.double()[:, None] * rope.inv_freq.double()
    cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)
    r = x[..., : rope.rotary_dim]
    half = rope.rotary_dim // 2
    turned = r * cos + torch.cat([-r[..., half:], r[..., :half]], -1) * sin
    return torch.cat([turned, x[..., rope.rotary_dim :]], -1)


@pytest.mark.parametrize("learned", [0, 2], ids=["sinks", "sinks+slots"])
def test_far_query_scores_sinks_as_a_query_at_w_plus_s_minus_1(learned):
    """The invariance the setting is for. A long sequence whose last query (position 40) sees window keys with the
    same unrotated content and the same sinks as the last query (position w + s - 1 = 6) of a short one: RoPE makes
    its window scores those of the short query, and 'window' makes its sink scores so too, so both outputs are equal
    (forward, and the long one decoded token by token). 'own' scores the sinks 34 positions farther: different."""
    w, s, n = 4, 3, 41
    rope = _rope()
    gen = torch.Generator().manual_seed(7)
    q_raw, k_raw, v = (torch.randn(1, heads, n, D, generator=gen, dtype=torch.float64) for heads in (2, 1, 1))
    short = list(range(s)) + list(range(n - w, n))  # the sinks, then the far query's window
    pos = torch.arange(n)
    q_long, k_long = _rotated(q_raw, pos, rope), _rotated(k_raw, pos, rope)
    q_short, k_short = (_rotated(x[:, :, short], pos[: s + w], rope) for x in (q_raw, k_raw))
    outs = {}
    for where in ("window", "own"):
        pa = _module(dict(kind="sliding_window", window=w, sinks=s, learned_sinks=learned), 2, 1, rope=rope,
                     sink_position=where)
        if learned:
            with torch.no_grad():
                pa.sink_k.zero_()
        far = pa(q_long, k_long, v, causal=True)[:, :, -1]
        near = pa(q_short, k_short, v[:, :, short], causal=True)[:, :, -1]
        outs[where] = (far, near)
        # the definition too: the sinks' unnormalised weights of both queries
        wl = reference_weights(pa, q_long, k_long, causal=True)[..., -1, learned : learned + s]
        ws = reference_weights(pa, q_short, k_short, causal=True)[..., -1, learned : learned + s]
        if where == "window":
            torch.testing.assert_close(wl, ws, rtol=1e-12, atol=0)
            decoded = recurrent_outputs(pa, q_long, k_long, v, [(0, 9), *((t, t + 1) for t in range(9, n))])
            torch.testing.assert_close(decoded[:, :, -1], near, rtol=1e-12, atol=1e-12)
        else:
            assert not torch.allclose(wl, ws, rtol=1e-3)
    torch.testing.assert_close(outs["window"][0], outs["window"][1], rtol=1e-12, atol=1e-12)
    assert not torch.allclose(outs["own"][0], outs["own"][1], rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(outs["own"][1], outs["window"][1], rtol=1e-12, atol=1e-12)  # at w + s - 1: both


def test_left_padding_changes_no_row():
    """A row left-padded by 5 gives the outputs of the same row alone: its queries' positions count real keys."""
    pa = _module(dict(kind="polysketch", sketch_size=8, window=4, sinks=2, learned_sinks=1), 4, 2)
    q, k, v = _qkv(1, 4, 2, 20, 20, seed=2, grad=False)
    alone = pa(q, k, v, causal=True)
    pad = torch.zeros(1, 4, 5, D, dtype=torch.float64)
    padded = [torch.cat([pad[:, : x.shape[1]], x], dim=2) for x in (q, k, v)]
    mask = torch.ones(1, 25, dtype=torch.bool)
    mask[0, :5] = False
    torch.testing.assert_close(pa(*padded, causal=True, key_padding_mask=mask)[:, :, 5:], alone, rtol=1e-10,
                               atol=1e-10)


@pytest.mark.parametrize("opts", [c[1] for c in CONFIGS], ids=[c[0] for c in CONFIGS])
def test_own_and_no_rope_are_the_unrotated_path(opts):
    """'own' with a rotation set, and 'window' without one (GPT-2, BERT), compute what the module without a rotation
    computes, bit for bit (the code path the project had before sink_position, which ``rope=None`` keeps), also
    decoding; 'window' with a rotation changes exactly the outputs of the queries beyond w + s - 1 (rounding aside:
    the others turn by 0)."""
    q, k, v = _qkv(2, 4, 2, 26, 26, seed=3, grad=False)
    mask = torch.ones(2, 26, dtype=torch.bool)
    mask[1, :6] = False
    plain = _module(opts, 4, 2, sink_position="own")
    plain.rope = None
    want = plain(q, k, v, causal=True, key_padding_mask=mask)
    want_decoded = recurrent_outputs(plain, q, k, v, CHUNKS, mask)
    for where, rope in (("own", _rope()), ("window", None)):
        pa = _module(opts, 4, 2, sink_position=where)
        pa.rope = rope
        assert torch.equal(pa(q, k, v, causal=True, key_padding_mask=mask), want)
        assert torch.equal(recurrent_outputs(pa, q, k, v, CHUNKS, mask), want_decoded)
    moved = _module(opts, 4, 2)(q, k, v, causal=True, key_padding_mask=mask)
    span = opts["window"] + opts["sinks"] - 1
    real = torch.stack([torch.arange(26), (torch.arange(26) - 6)])  # row 1: 6 pads
    far = real > span
    diff = (moved - want).abs().amax(dim=(1, 3))
    assert (diff[~far] < 1e-12).all() and (diff[far] > 1e-6).all(), diff


def test_hybrid_module_passes_the_rotation_on():
    """softmax_heads: the kind's module of the other heads gets the layer's rotation; against hybrid_reference."""
    cfg = PolyAttnConfig(kind="linear", window=3, sinks=2, learned_sinks=1, softmax_heads=((1, 0),))
    layer = HybridAttention(cfg, 4, D, 2, layer_idx=1).double()
    rope = _rope()
    layer.rope = rope
    assert layer.rope is rope and layer.kernel.rope is rope
    q, k, v = _qkv(2, 4, 2, 17, 17, seed=5)
    mask = _padding_mask(2, 17, "left")
    out = layer(q, k, v, causal=True, key_padding_mask=mask)
    ref = hybrid_reference(layer, q, k, v, causal=True, key_padding_mask=mask)
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-9)
    _assert_grads_match(out, ref, (q, k, v))
    layer.rope = None
    assert not torch.allclose(layer(q, k, v, causal=True, key_padding_mask=mask), out)


# ----------------------------------------------------------------------------- the pieces
def test_rotation():
    """R(p) as transformers applies it (``_rotated``), R(a) R(b) = R(a + b), orthogonal, partial rotary left alone
    beyond rotary_dim, integer shifts of any broadcastable shape; bad frequencies refused."""
    rope = _rope(6)
    x = torch.randn(2, 3, 5, D, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    pos = torch.tensor([0, 3, 7, 100, 8000])
    torch.testing.assert_close(rope.rotate(x, pos), _rotated(x, pos, rope), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(rope.rotate(rope.rotate(x, pos), -pos - 5), rope.rotate(x, torch.full((5,), -5)),
                               rtol=1e-11, atol=1e-11)
    torch.testing.assert_close(rope.rotate(x, pos).norm(dim=-1), x.norm(dim=-1), rtol=1e-12, atol=0)
    assert torch.equal(rope.rotate(x, pos)[..., 6:], x[..., 6:])
    assert torch.equal(rope.rotate(x, torch.zeros(2, 1, 5, dtype=torch.long)), x)
    assert rope.rotate(x.float(), pos).dtype == torch.float32
    with pytest.raises(ValueError, match=r"^rotary_dim must be 2 \* len\(inv_freq\) = 6"):
        RopeRotation(rope.inv_freq, 4)
    with pytest.raises(ValueError, match="^inv_freq must be a non-empty 1-D float tensor"):
        RopeRotation(torch.arange(3), 6)
    with pytest.raises(ValueError, match=r"^x has 4 dims, the rotation needs 6 \(rotary_dim = 6\)"):
        rope.rotate(x[..., :4], pos)


def _naive_rotated(x: torch.Tensor, delta: torch.Tensor, inv_freq: torch.Tensor, pairs: list) -> torch.Tensor:
    """R(delta) x written out: one 2x2 rotation per (a_t, b_t) by delta f_t, element by element (float64)."""
    out = x.clone()
    for n in range(x.shape[-2]):
        for t, (a, b) in enumerate(pairs):
            angle = float(delta[n]) * float(inv_freq[t])
            c, s = torch.tensor(angle, dtype=torch.float64).cos(), torch.tensor(angle, dtype=torch.float64).sin()
            out[..., n, a] = x[..., n, a] * c - x[..., n, b] * s
            out[..., n, b] = x[..., n, b] * c + x[..., n, a] * s
    return out


PAIRINGS = {
    "rotate_half": [(t, t + 3) for t in range(3)],
    "interleaved": [(2 * t, 2 * t + 1) for t in range(3)],  # GPT-J, Cohere, GLM
    "trailing-half": [(2 + t, 5 + t) for t in range(3)],  # a rotated block after 2 unrotated dims
    "scattered": [(7, 0), (3, 5), (1, 6)],
}


@pytest.mark.parametrize("name", list(PAIRINGS))
def test_rotation_of_any_pairing_equals_the_naive_rotation(name):
    """Every layout the integration reads (which dims pair with which) against the rotation written out element by
    element; the group law, orthogonality, the dims outside the pairs untouched, float32 in float32 out; the
    rotate_half pairs are the default layout (one name)."""
    pairs = PAIRINGS[name]
    rope = _rope(6)
    turned = RopeRotation(rope.inv_freq, 6, torch.tensor(pairs).T)
    assert (turned.pairs is None) == (name == "rotate_half")
    x = torch.randn(2, 3, 5, D, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    pos = torch.tensor([0, -3, 7, 100, -8000])
    torch.testing.assert_close(turned.rotate(x, pos), _naive_rotated(x, pos, rope.inv_freq, pairs), rtol=1e-12,
                               atol=1e-12)
    torch.testing.assert_close(turned.rotate(turned.rotate(x, pos), -pos - 5),
                               turned.rotate(x, torch.full((5,), -5)), rtol=1e-11, atol=1e-11)
    torch.testing.assert_close(turned.rotate(x, pos).norm(dim=-1), x.norm(dim=-1), rtol=1e-12, atol=0)
    untouched = sorted(set(range(D)) - {d for pair in pairs for d in pair})
    assert torch.equal(turned.rotate(x, pos)[..., untouched], x[..., untouched])
    assert turned.rotate(x.float(), pos).dtype == torch.float32
    # shifts of another broadcastable shape (one per row and query, as the module passes them)
    shifts = torch.tensor([[3, -4, 0, 9, -1], [0, 0, -2, 5, 6]])[:, None, :]
    torch.testing.assert_close(turned.rotate(x, shifts)[1], _naive_rotated(x[1], shifts[1, 0], rope.inv_freq,
                                                                            pairs), rtol=1e-12, atol=1e-12)


def test_interleaved_and_pairing_errors():
    """``interleaved`` is GPT-J's (2t, 2t + 1); a pairing that names a dim twice, a float or a wrong shape is
    refused naming the parameter; a head narrower than the largest paired dim is refused."""
    f = _rope(6).inv_freq
    assert torch.equal(RopeRotation.interleaved(f).pairs, torch.tensor(PAIRINGS["interleaved"]).T)
    with pytest.raises(ValueError, match=r"^pairs must name 6 distinct non-negative head dims"):
        RopeRotation(f, 6, torch.tensor([[0, 1, 2], [2, 3, 4]]))
    with pytest.raises(ValueError, match=r"^pairs must name 6 distinct non-negative head dims"):
        RopeRotation(f, 6, torch.tensor([[0, 1, 2], [3, 4, -5]]))
    with pytest.raises(ValueError, match=r"^pairs must be an integer tensor of shape \(2, len\(inv_freq\)\) = "
                                         r"\(2, 3\), got \(3, 2\)"):
        RopeRotation(f, 6, torch.tensor(PAIRINGS["interleaved"]))
    with pytest.raises(ValueError, match=r"^pairs must be an integer tensor"):
        RopeRotation(f, 6, torch.zeros(2, 3))
    with pytest.raises(ValueError, match=r"^x has 7 dims, the rotation needs 8 \(rotary_dim = 6\)"):
        RopeRotation(f, 6, torch.tensor(PAIRINGS["scattered"]).T).rotate(torch.zeros(1, 7), torch.zeros(1))


@pytest.mark.parametrize("name", ["partial", "interleaved", "trailing-half"])
def test_rotations_match_reference_with_gradients(name):
    """The module's re-rotation against the reference's query-by-query rotation, with left padding, and finite
    differences of q, k, v through it: GPT-NeoX's rotation of the first 4 of 8 dims, GPT-J's interleaved pairs, a
    rotated block after unrotated dims. A pairing other than rotate_half changes the outputs (a different model)."""
    rope = _rope(4) if name == "partial" else RopeRotation(_rope(6).inv_freq, 6, torch.tensor(PAIRINGS[name]).T)
    pa = _module(dict(kind="linear", window=3, sinks=2, learned_sinks=1), 2, 1, rope=rope)
    q, k, v = _qkv(1, 2, 1, 11, 11, seed=4)
    mask = torch.ones(1, 11, dtype=torch.bool)
    mask[0, :2] = False
    out = pa(q, k, v, causal=True, key_padding_mask=mask)
    torch.testing.assert_close(out, reference_attention(pa, q, k, v, causal=True, key_padding_mask=mask),
                               rtol=1e-9, atol=1e-9)
    if name != "partial":  # the same frequencies on the rotate_half pairs
        other = _module(dict(kind="linear", window=3, sinks=2, learned_sinks=1), 2, 1, rope=_rope(6))
        assert not torch.allclose(other(q, k, v, causal=True, key_padding_mask=mask), out, rtol=1e-4, atol=1e-4)
    assert torch.autograd.gradcheck(lambda *x: pa(*x, causal=True, key_padding_mask=mask), (q, k, v))


def test_sink_shifts():
    """delta_i = min(0, span - p_i), p_i = the real keys before query i (a state's count first), rows
    bottom-right aligned."""
    mask = torch.tensor([[False, False, True, True, True, True, True], [True] * 7])
    assert sink_shifts(mask, 7, 7, 0, 2, "cpu").tolist() == [[0, 0, 0, 0, 0, -1, -2], [0, 0, 0, -1, -2, -3, -4]]
    assert sink_shifts(mask, 3, 7, 0, 2, "cpu").tolist() == [[0, -1, -2], [-2, -3, -4]]
    assert sink_shifts(None, 2, 2, torch.tensor([3, 10]), 4, "cpu").tolist() == [[0, 0], [-6, -7]]
    assert sink_shifts(None, 1, 1, 9, 4, "cpu").tolist() == [[-5]]


@pytest.mark.parametrize("opts,match", [
    (dict(kind="sliding_window", window=8, sink_position="own"),
     r"^sink_position='own' needs sinks > 0 \(it places the attention sinks\), got sinks=0"),
    (dict(kind="linear", window=8, learned_sinks=2, sink_position="own"), r"^sink_position='own' needs sinks > 0"),
    (dict(kind="sliding_window", window=8, sinks=4, sink_position="absolute"),
     r"^sink_position must be one of \['window', 'own'\], got 'absolute'"),
    (dict(kind="polynomial", degree=2, sink_position="own"), r"kind='polynomial' does not read sink_position"),
    (dict(kind="bigbird", sink_position="own"), r"kind='bigbird' does not read sink_position"),
])
def test_config_errors(opts, match):
    with pytest.raises(ValueError, match=match):
        PolyAttnConfig(**opts)


def test_labels_and_round_trip():
    cfg = PolyAttnConfig(kind="sliding_window", window=128, sinks=4)
    assert cfg.sink_position == "window"
    assert cfg.spec.table_label(cfg) == ("sliding_window (exact softmax 128-token sliding window + 4 sink tokens "
                                         "(positions within the window): StreamingLLM, training-free)")
    own = cfg.replace(sink_position="own")
    assert "+ 4 sink tokens (their own positions)" in own.spec.table_label(own)
    assert "4 attention sinks, scored at positions within the window, + the exact" in cfg.spec.memory_note(cfg)
    assert "4 attention sinks, scored at their own positions, + the exact" in own.spec.memory_note(own)
    assert PolyAttnConfig.from_dict(own.to_dict()) == own
    cfg = PolyAttnConfig(kind="polysketch", window=64, sinks=1, learned_sinks=8)
    assert ("64-token sliding window + 1 sink token (positions within the window) + 8 learned sink slots"
            in cfg.spec.table_label(cfg))
    assert cfg.to_dict()["sink_position"] == "window"
