"""``sink_span`` (``sink_position='window'`` on a RoPE module): a query with p_i real keys before it scores the sinks
as if it sat at min(p_i, S), S = sink_span (0: w + s - 1, StreamingLLM's rule). Against the naive definition in
ops/reference.py (values and gradients in float64, padding, grouped-query heads, a query after a past, the sparse
cache); chunked prefill and token-by-token decoding (the ring: its general, fused and static steps) equal to the
whole sequence; left padding; S = w + s - 1 bit for bit the default; a larger S changes exactly the queries beyond
w + s - 1 and equals 'own' up to S; the span helper; config errors, labels and the round trip."""

from __future__ import annotations

import pytest
import torch

from hf_polyattn import PolyAttnConfig
from hf_polyattn.ops import reference_attention
from hf_polyattn.ops.decode import WindowRing
from hf_polyattn.ops.reference import reference_weights

from .test_decode_ring import _decode, _fused, _inputs, _kernel_state, _static_decode
from .test_decode_ring import _module as ring_module
from .test_sink_position import CAUSAL_SHAPES, _module, _rope
from .test_sinks import _qkv, assert_matches_reference
from .test_window import recurrent_outputs

D = 8

# w + s - 1 = 5, 6, 4, 6 and 4: every span below is beyond it and short of the sequences (22-29 tokens)
CONFIGS = [
    ("sliding-w4-s2-l2-span11", dict(kind="sliding_window", window=4, sinks=2, learned_sinks=2, sink_span=11)),
    ("linear-w5-s2-mix-span9", dict(kind="linear", window=5, sinks=2, window_mix=True, sink_span=9)),
    ("ps4-w3-s2-norm-span7", dict(kind="polysketch", sketch="learned", sketch_size=8, window=3, sinks=2,
                                  qk_norm=True, feature_proj=12, sink_span=7)),
    ("linear-w4-s3-gate-span12", dict(kind="linear", window=4, sinks=3, decay="gate", sink_span=12)),
]


@pytest.mark.parametrize("shape", CAUSAL_SHAPES, ids=[s[0] for s in CAUSAL_SHAPES])
@pytest.mark.parametrize("opts", [c[1] for c in CONFIGS], ids=[c[0] for c in CONFIGS])
def test_matches_reference(opts, shape):
    """Values and the gradients of q, k, v and every parameter: the module's shifts against the reference's
    query-by-query rotation to min(p_i, S) (left and right padding, a query block after a past of 21 keys)."""
    assert_matches_reference(_module(opts, shape[2], shape[3]), shape)


# the linear-only preset's layer with its bounded sparse cache re-chosen by the last queries, a span beyond w + s - 1
PRESET = dict(kind="linear", feature_map="hedgehog", window=5, sinks=2, decay="gate", decay_max_horizon=3.0,
              window_mix=True, feature_proj=D, qk_norm=True, sparse_cache=3, sparse_chunk=4, sparse_observe=2,
              sink_span=14)


def test_sparse_cache_matches_reference():
    """The sparse cache's block loop (its sinks scored by the span's queries, ``_sparse_call``) against the
    definition, with a left-padded row."""
    torch.manual_seed(0)
    pa = ring_module(PRESET)
    q, k, v = _inputs(n=40)
    mask = torch.ones(2, 40, dtype=torch.bool)
    mask[0, :5] = False
    with torch.no_grad():
        for m in (None, mask):
            torch.testing.assert_close(pa(q, k, v, causal=True, key_padding_mask=m),
                                       reference_attention(pa, q, k, v, causal=True, key_padding_mask=m),
                                       rtol=1e-10, atol=1e-12)


# the ring's configs (test_decode_ring's sizes: 40 tokens, a prefill of 13, window 6, 2 sinks): the span (20) is
# crossed while decoding, so steps before it score the sinks with the query itself and steps after it turn
RING = {
    "linear-gate-span20": dict(kind="linear", window=6, sinks=2, decay="gate", decay_horizon=8.0, sink_span=20),
    "hedgehog-recipe-span20": dict(kind="linear", feature_map="hedgehog", window=6, sinks=2, decay="gate",
                                   window_mix=True, feature_proj=D, qk_norm=True, decay_max_horizon=3.0,
                                   sink_span=20),
    "hybrid-span20": dict(kind="linear", window=6, sinks=2, decay="gate", window_mix=True, softmax_heads=[(0, 1)],
                          sink_span=20),
}


@pytest.mark.parametrize("batch", [1, 2])  # one sequence takes ``decode.fused_step``
@pytest.mark.parametrize("name", list(RING))
def test_prefill_and_decoding_equal_the_forward(name, batch):
    """A prefill of 13 tokens, then one token at a time on the ring, then the generic recurrent step: each equals the
    whole sequence; one sequence's fused steps equal the general ring step's."""
    pa = ring_module(RING[name])
    q, k, v = _inputs(b=batch)
    with torch.no_grad():
        full = pa(q, k, v, causal=True)
    ring_out, state = _decode(pa, q, k, v)
    assert isinstance(_kernel_state(state), WindowRing)
    generic_out, _ = _decode(pa, q, k, v, grad=True)
    torch.testing.assert_close(ring_out, full, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(generic_out.detach(), full, rtol=1e-9, atol=1e-10)
    _fused(pa, False)
    general, _ = _decode(pa, q, k, v)
    torch.testing.assert_close(general, ring_out, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("name", list(RING))
def test_left_padded_decoding_equals_each_row_alone(name):
    """Row 0 left-padded by 5 tokens: its span counts real keys, so its outputs (prefill, decoding) equal the row
    alone; static steps (the rows' real keys counted on the device) with a padded token in row 1 too equal the
    ring's."""
    pa = ring_module(RING[name])
    q, k, v = _inputs(b=2)
    pad, n = 5, q.shape[2]
    mask = torch.ones(2, n, dtype=torch.bool)
    mask[0, :pad] = False
    out, _ = _decode(pa, q, k, v, mask)
    with torch.no_grad():
        alone = pa(q[:1, :, pad:], k[:1, :, pad:], v[:1, :, pad:], causal=True)
        other = pa(q[1:], k[1:], v[1:], causal=True)
        forward = pa(q, k, v, causal=True, key_padding_mask=mask)
    torch.testing.assert_close(out[:1, :, pad:], alone, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(out[1:], other, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(forward[:1, :, pad:], alone, rtol=1e-9, atol=1e-10)
    mask[1, n - 4] = False  # and a padded token while static
    ring_out, _ = _decode(pa, q, k, v, mask)
    static_out, _, static = _static_decode(pa, q, k, v, mask)
    assert (static > 0) is (name != "hybrid-span20")  # a padded row keeps the hybrid's softmax heads dynamic
    torch.testing.assert_close(static_out, ring_out, rtol=1e-9, atol=1e-10)


def test_sparse_cache_prefill_and_decoding_equal_the_forward():
    """The preset's layer: chunked prefill (the cache chosen again at each chunk's end by its last queries) then
    single tokens, against the definition with the same calls; left padding."""
    torch.manual_seed(0)
    pa = ring_module(PRESET)
    q, k, v = _inputs(n=40)
    mask = torch.ones(2, 40, dtype=torch.bool)
    mask[0, :5] = False
    chunks = [(0, 13), (13, 22), *((i, i + 1) for i in range(22, 40))]
    for m in (None, mask):
        with torch.no_grad():
            got = recurrent_outputs(pa, q, k, v, chunks, m)
            want = reference_attention(pa, q, k, v, causal=True, key_padding_mask=m,
                                       calls=[t - s for s, t in chunks])
        torch.testing.assert_close(got[:, :, 5:], want[:, :, 5:], rtol=1e-9, atol=1e-11)  # row 0's pads aside
        torch.testing.assert_close(got[1], want[1], rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("opts", [c[1] for c in CONFIGS], ids=[c[0] for c in CONFIGS])
def test_span_at_w_plus_s_minus_1_is_the_default_bit_for_bit(opts):
    """sink_span = w + s - 1 is the rule sink_span=0 names: the same outputs, bit for bit, forward with left padding
    and decoded in chunks; the helper resolves both to it."""
    base = {key: value for key, value in opts.items() if key != "sink_span"}
    edge = base["window"] + base["sinks"] - 1
    q, k, v = _qkv(2, 4, 2, 26, 26, seed=3, grad=False)
    mask = torch.ones(2, 26, dtype=torch.bool)
    mask[1, :6] = False
    chunks = [(0, 9), *((i, i + 1) for i in range(9, 26))]
    default, same = _module(base, 4, 2), _module({**base, "sink_span": edge}, 4, 2)
    assert default.config.resolved_sink_span == same.config.resolved_sink_span == edge
    assert torch.equal(default(q, k, v, causal=True, key_padding_mask=mask),
                       same(q, k, v, causal=True, key_padding_mask=mask))
    with torch.no_grad():
        assert torch.equal(recurrent_outputs(default, q, k, v, chunks, mask),
                           recurrent_outputs(same, q, k, v, chunks, mask))


def test_span_equal_to_the_default_on_the_ring_is_bit_for_bit():
    """The ring's three paths (general, fused, static) with sink_span = w + s - 1: the default's outputs exactly."""
    base = dict(RING["linear-gate-span20"])
    del base["sink_span"]
    for batch in (1, 2):
        q, k, v = _inputs(b=batch)
        outs = []
        for opts in (base, {**base, "sink_span": 7}):
            torch.manual_seed(0)
            pa = ring_module(opts)
            outs.append((_decode(pa, q, k, v)[0], _static_decode(pa, q, k, v)[0]))
        assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


@pytest.mark.parametrize("opts", [c[1] for c in CONFIGS], ids=[c[0] for c in CONFIGS])
def test_a_larger_span_changes_exactly_the_queries_beyond_w_plus_s_minus_1(opts):
    """The option is read: against sink_span=0 the outputs of the queries at p_i <= w + s - 1 are the same (neither
    turns them) and every later one differs; against 'own' (no turn) the queries at p_i <= S are the same and every
    later one differs. Row 1 is left-padded by 6."""
    base = {key: value for key, value in opts.items() if key != "sink_span"}
    span, edge = opts["sink_span"], opts["window"] + opts["sinks"] - 1
    q, k, v = _qkv(2, 4, 2, 26, 26, seed=3, grad=False)
    mask = torch.ones(2, 26, dtype=torch.bool)
    mask[1, :6] = False
    real = torch.stack([torch.arange(26), torch.arange(26) - 6])  # real keys before each query (row 1: 6 pads)
    with torch.no_grad():
        out = _module(opts, 4, 2)(q, k, v, causal=True, key_padding_mask=mask)
        default = _module(base, 4, 2)(q, k, v, causal=True, key_padding_mask=mask)
        own = _module(base, 4, 2, sink_position="own")(q, k, v, causal=True, key_padding_mask=mask)
    for other, level in ((default, edge), (own, span)):
        diff = (out - other).abs().amax(dim=(1, 3))
        assert (diff[real <= level] < 1e-12).all() and (diff[real > level] > 1e-6).all(), (level, diff)


def test_the_definition_scores_the_sinks_from_min_p_and_the_span():
    """The reference's sink weights of a far query with sink_span S are those of a query at S with the same
    unrotated content: the invariance the span moves (w + s - 1 without it)."""
    from .test_sink_position import _rotated

    w, s, span, n = 4, 3, 15, 41
    rope = _rope()
    gen = torch.Generator().manual_seed(7)
    q_raw, k_raw = (torch.randn(1, heads, n, D, generator=gen, dtype=torch.float64) for heads in (2, 1))
    pos = torch.arange(n)
    pa = _module(dict(kind="sliding_window", window=w, sinks=s, sink_span=span), 2, 1, rope=rope)
    far = reference_weights(pa, _rotated(q_raw, pos, rope), _rotated(k_raw, pos, rope), causal=True)[..., -1, :s]
    near_pos = torch.arange(span + 1)
    short = list(range(span)) + [n - 1]  # the sinks (and the keys between), then the far query's own content
    q_short, k_short = (_rotated(x[:, :, short], near_pos, rope) for x in (q_raw, k_raw))
    near = reference_weights(pa, q_short, k_short, causal=True)[..., -1, :s]
    torch.testing.assert_close(far, near, rtol=1e-12, atol=0)


@pytest.mark.parametrize("opts,match", [
    (dict(kind="sliding_window", window=8, sink_span=20),
     r"^sink_span=20 needs sinks > 0 and sink_position='window' \(.*0 = off\), got sinks=0"),
    (dict(kind="sliding_window", window=8, sinks=4, sink_position="own", sink_span=20),
     r"^sink_span=20 needs sinks > 0 and sink_position='window'.*sink_position='own'"),
    (dict(kind="sliding_window", window=8, sinks=4, sink_span=10),
     r"^sink_span must be 0 or >= window \+ sinks - 1 = 11 \(a sink is never scored closer than the window's "
     r"oldest key\), got 10"),
    (dict(kind="sliding_window", window=8, sinks=4, sink_span=-1), r"sink_span must be an int >= 0"),
    (dict(kind="sliding_window", window=8, sinks=4, sink_span=2.5), r"sink_span must be an int"),
    (dict(kind="sliding_window", window=8, sinks=4, sink_span=True), r"sink_span must be an int"),
    (dict(kind="polynomial", degree=2, sink_span=20), r"kind='polynomial' does not read sink_span"),
])
def test_config_errors(opts, match):
    with pytest.raises(ValueError, match=match):
        PolyAttnConfig(**opts)


def test_resolved_span_labels_and_round_trip():
    cfg = PolyAttnConfig(kind="sliding_window", window=128, sinks=4)
    assert cfg.sink_span == 0 and cfg.resolved_sink_span == 131
    spanned = cfg.replace(sink_span=1024)
    assert spanned.resolved_sink_span == 1024 and cfg.replace(sink_span=131).resolved_sink_span == 131
    assert "+ 4 sink tokens (positions at most 1024 back)" in spanned.spec.table_label(spanned)
    assert "4 attention sinks, scored at positions at most 1024 back, + the" in spanned.spec.memory_note(spanned)
    assert "(positions within the window)" in cfg.spec.table_label(cfg)  # unchanged without a span
    assert PolyAttnConfig.from_dict(spanned.to_dict()) == spanned and spanned.to_dict()["sink_span"] == 1024
    old = cfg.to_dict()
    del old["sink_span"]  # a config.json from before the field: the default rule
    assert PolyAttnConfig.from_dict(old) == cfg
    for kind in ("linear", "delta"):
        assert PolyAttnConfig(kind=kind, window=8, sinks=2, sink_span=64).sink_span == 64
