"""ops/packed.py: a sequence's kernel-head state in fixed-size slot buffers (what a serving engine keeps).

The engine's contract: a prompt split anywhere into chunks, each chunk run on the state unpacked from the slot the
previous chunk packed, gives the outputs of the whole prompt in one call, and so does decoding token by token."""

import pytest
import torch

from hf_polyattn import PolyAttnConfig
from hf_polyattn.ops import build_attention
from hf_polyattn.ops.packed import PackedLayout, pack, unpack

W, S, BLOCK, D = 8, 2, 4, 16

CONFIGS = {
    # the long-context preset's layer (elu, gated decay, window mix, q/k LayerNorm, a feature projection)
    "demo": dict(kind="linear", feature_map="elu", window=W, sinks=S, decay="gate", window_mix=True,
                 window_mix_init=0.01, block_size=BLOCK, qk_norm=True, feature_proj=D, decay_horizon=16.0),
    "sinks-own": dict(kind="linear", feature_map="hedgehog", window=W, sinks=S, decay="gate", block_size=BLOCK,
                      sink_position="own"),
    "plain-window": dict(kind="linear", window=W, block_size=BLOCK),
    "no-window": dict(kind="linear", block_size=BLOCK),
}


def _module(name):
    m = build_attention(PolyAttnConfig(**CONFIGS[name]), 4, D, 2, 0).eval()
    with torch.no_grad():  # away from the initial values, so that a parameter read wrongly shows
        for p in m.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return m


def _layout(m, dtype=torch.float32):
    cfg = m.config
    return PackedLayout(heads=m.num_kv_heads, features=m.num_features, head_dim=D,
                        keys=max(cfg.window, cfg.block_size), sinks=cfg.sinks, key_dtype=dtype)


def _inputs(n, dtype=torch.float32):
    return (torch.randn(1, 4, n, D, dtype=dtype), torch.randn(1, 2, n, D, dtype=dtype),
            torch.randn(1, 2, n, D, dtype=dtype))


@pytest.mark.parametrize("name", CONFIGS)
# split points around the window and the sinks: 1, w - 1, w, w + 1, w + sinks, and a later one
@pytest.mark.parametrize("split", [1, W - 1, W, W + 1, W + S, 3 * W + 1])
def test_chunks_through_a_slot_equal_one_call(name, split):
    m = _module(name)
    layout = _layout(m)
    q, k, v = _inputs(40)
    with torch.no_grad():
        whole = m(q, k, v, causal=True)
        slot = [b[0] for b in layout.empty(3)]  # slot 0 of three
        out1, st = m(q[:, :, :split], k[:, :, :split], v[:, :, :split], causal=True, state=m.init_state())
        pack(st, slot, layout)
        out2, st = m(q[:, :, split:], k[:, :, split:], v[:, :, split:], causal=True,
                     state=unpack(slot, layout, 2))
    torch.testing.assert_close(torch.cat([out1, out2], dim=2), whole, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", CONFIGS)
def test_decoding_through_a_slot_equals_one_call(name):
    m = _module(name)
    layout = _layout(m)
    q, k, v = _inputs(3 * W)
    with torch.no_grad():
        whole = m(q, k, v, causal=True)
        slot = [b[1] for b in layout.empty(2)]
        out, st = m(q[:, :, :1], k[:, :, :1], v[:, :, :1], causal=True, state=m.init_state())
        outs = [out]
        for t in range(1, q.shape[2]):
            pack(st, slot, layout)
            out, st = m(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], causal=True,
                        state=unpack(slot, layout, 2))
            outs.append(out)
    torch.testing.assert_close(torch.cat(outs, dim=2), whole, rtol=1e-5, atol=1e-5)


def test_pack_then_unpack_gives_every_field_back():
    m = _module("demo")
    layout = _layout(m)
    q, k, v = _inputs(W + S + 3)
    with torch.no_grad():
        _, st = m(q, k, v, causal=True, state=m.init_state())
    slot = [b[0] for b in layout.empty(1)]
    pack(st, slot, layout)
    back = unpack(slot, layout, 2)
    assert back.length == st.length == W + S + 3
    for name in ("kv", "k", "v", "sink_k", "sink_v", "sink_mask"):
        assert getattr(st, name) is not None, name  # the case covers every packed field
        assert torch.equal(getattr(back, name), getattr(st, name)), name


def test_a_layer_with_fewer_heads_uses_the_first_of_the_slot():
    m = _module("demo")
    big = PackedLayout(heads=3, features=m.num_features, head_dim=D, keys=W, sinks=S)
    q, k, v = _inputs(20)
    with torch.no_grad():
        whole = m(q, k, v, causal=True)
        slot = [b[0] for b in big.empty(1)]
        out1, st = m(q[:, :, :11], k[:, :, :11], v[:, :, :11], causal=True, state=m.init_state())
        pack(st, slot, big)
        out2, _ = m(q[:, :, 11:], k[:, :, 11:], v[:, :, 11:], causal=True, state=unpack(slot, big, 2))
    torch.testing.assert_close(torch.cat([out1, out2], dim=2), whole, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_keys_pack_finite_and_equal(dtype):
    m = _module("demo").to(dtype)
    layout = _layout(m, dtype)
    q, k, v = _inputs(30, dtype)
    with torch.no_grad():
        whole = m(q, k, v, causal=True)
        slot = [b[0] for b in layout.empty(1)]
        out1, st = m(q[:, :, :13], k[:, :, :13], v[:, :, :13], causal=True, state=m.init_state())
        pack(st, slot, layout)
        out2, _ = m(q[:, :, 13:], k[:, :, 13:], v[:, :, 13:], causal=True, state=unpack(slot, layout, 2))
    got = torch.cat([out1, out2], dim=2)
    assert torch.isfinite(got).all() and got.dtype == dtype
    torch.testing.assert_close(got, whole)


def test_refusals_name_what_is_wrong():
    m = _module("demo")
    layout = _layout(m)
    q, k, v = _inputs(12)
    with torch.no_grad():
        _, st = m(q, k, v, causal=True, state=m.init_state())
    slot = [b[0] for b in layout.empty(1)]
    with pytest.raises(ValueError, match="buffers must be the 6 tensors"):
        pack(st, slot[:5], layout)
    small = PackedLayout(heads=1, features=m.num_features, head_dim=D, keys=W, sinks=S)
    with pytest.raises(ValueError, match="2 kv heads; the layout 1"):
        pack(st, [b[0] for b in small.empty(1)], small)
    few_keys = PackedLayout(heads=2, features=m.num_features, head_dim=D, keys=W - 1, sinks=S)
    with pytest.raises(ValueError, match="room for 7 keys"):
        pack(st, [b[0] for b in few_keys.empty(1)], few_keys)
    from dataclasses import replace
    with pytest.raises(ValueError, match="RecurrentState.seen is set"):
        pack(replace(st, seen=torch.tensor([12])), slot, layout)
    with pytest.raises(ValueError, match="RecurrentState.conv_k"):
        pack(replace(st, conv_k=torch.zeros(1)), slot, layout)
    with pytest.raises(ValueError, match="heads must be an int in 1..2"):
        unpack(slot, layout, 3)
    with pytest.raises(ValueError, match="keys must be an int >= 1"):
        PackedLayout(heads=1, features=4, head_dim=4, keys=0, sinks=0)


# ----------------------------------------------------------------------------------------------- the ring layout
RING_CONFIGS = ["demo", "sinks-own", "plain-window"]


def _ring_layout(m, dtype=torch.float32, heads=None):
    from hf_polyattn.ops.packed import RingLayout

    cfg = m.config
    return RingLayout(heads=heads or m.num_kv_heads, features=m.num_features, head_dim=D, window=cfg.window,
                      sinks=cfg.sinks, decay=cfg.decay != "none", key_dtype=dtype)


def _through_ring_slot(m, layout, q, k, v, cuts, heads=2):
    """Run ``m`` over the chunks between ``cuts``, packing its state as a ring after each and unpacking it for the
    next; the outputs concatenated."""
    from hf_polyattn.ops.packed import pack_ring, ring_from_state, unpack_ring

    slot = [b[1] for b in layout.empty(2)]
    outs, state = [], m.init_state()
    bounds = [0, *cuts, q.shape[2]]
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        if i:
            state = unpack_ring(slot, layout, heads)
        out, state = m(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], causal=True, state=state)
        pack_ring(ring_from_state(m, state, layout), slot, layout)
        outs.append(out)
    return torch.cat(outs, dim=2)


@pytest.mark.parametrize("name", RING_CONFIGS)
@pytest.mark.parametrize("split", [1, W - 1, W, W + 1, W + S, 3 * W + 1])
def test_chunks_through_a_ring_slot_equal_one_call(name, split):
    m = _module(name)
    q, k, v = _inputs(40)
    with torch.no_grad():
        whole = m(q, k, v, causal=True)
        got = _through_ring_slot(m, _ring_layout(m), q, k, v, [split, split + 1, split + 2])
    torch.testing.assert_close(got, whole, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", RING_CONFIGS)
def test_decoding_through_a_ring_slot_writes_the_slot_in_place(name):
    from hf_polyattn.ops.packed import unpack_ring

    m = _module(name)
    layout = _ring_layout(m, heads=3)  # more heads than the layer's: the first ones used
    q, k, v = _inputs(3 * W)
    with torch.no_grad():
        whole = m(q, k, v, causal=True)
        got = _through_ring_slot(m, layout, q, k, v, list(range(1, 3 * W)))
        # a decoding step on the unpacked ring writes the slot's own tensors
        slot = [b[0] for b in layout.empty(1)]
        ring = unpack_ring(slot, layout, 2)
        assert ring.keys.data_ptr() == slot[1].data_ptr() and ring.kv.data_ptr() == slot[0].data_ptr()
    torch.testing.assert_close(got, whole, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_ring_slot_in_half_precision_is_finite_and_equal(dtype):
    m = _module("demo").to(dtype)
    q, k, v = _inputs(30, dtype)
    with torch.no_grad():
        whole = m(q, k, v, causal=True)
        got = _through_ring_slot(m, _ring_layout(m, dtype), q, k, v, [13, 14, 15, 16, 17])
    assert torch.isfinite(got).all() and got.dtype == dtype
    torch.testing.assert_close(got, whole)


def test_ring_refusals_name_what_is_wrong():
    from dataclasses import replace

    from hf_polyattn.ops.packed import pack_ring, ring_from_state

    m = _module("demo")
    layout = _ring_layout(m)
    q, k, v = _inputs(12)
    with torch.no_grad():
        _, st = m(q, k, v, causal=True, state=m.init_state())
    ring = ring_from_state(m, st, layout)
    slot = [b[0] for b in layout.empty(1)]
    with pytest.raises(ValueError, match="seen set: True"):
        pack_ring(replace(ring, seen=torch.tensor([12])), slot, layout)
    with pytest.raises(ValueError, match="does not fit the layout"):
        pack_ring(ring, [b[0] for b in _ring_layout(m, heads=1).empty(1)], _ring_layout(m, heads=1))
    with pytest.raises(TypeError, match="must be a WindowRing"):
        pack_ring(st, slot, layout)


@pytest.mark.parametrize("stacked", [False, True])
@pytest.mark.parametrize("name", RING_CONFIGS)
def test_a_batch_of_rings_at_different_positions_steps_as_each_alone(name, stacked):
    """Requests of different lengths decode in one batch (``gather_rings``: each row rotated to one ring position,
    ``scatter_rings``: written back at its own): each row's outputs equal its whole sequence's. ``stacked``: the
    buffers are one entry of buffers stacked over 3 layers (the vLLM plugin's state layers, strided views), and the
    other entries are left as they were."""
    from hf_polyattn.ops.packed import gather_rings, pack_ring, ring_from_state, ring_steady, scatter_rings

    m = _module(name)
    layout = _ring_layout(m, heads=3)
    lengths, steps, slots = [W + S + 1, 2 * W + 5, 4 * W + 3], 2 * W + 1, [3, 0, 2]
    if stacked:
        stack = [torch.randn(4, 3, *t.shape[1:]).to(t.dtype) for t in layout.empty(4)]
        before = [t.clone() for t in stack]
        buffers = [t[:, 1] for t in stack]
    else:
        buffers = layout.empty(4)
    seqs = [_inputs(n + steps) for n in lengths]
    with torch.no_grad():
        wholes = [m(q, k, v, causal=True) for q, k, v in seqs]
        for (q, k, v), n, slot in zip(seqs, lengths, slots):
            _, st = m(q[:, :, :n], k[:, :, :n], v[:, :, :n], causal=True, state=m.init_state())
            pack_ring(ring_from_state(m, st, layout), [b[slot] for b in buffers], layout)
        index = torch.tensor(slots)
        outs = []
        for t in range(steps):
            assert all(ring_steady(buffers[5][i].tolist(), layout) for i in slots)
            ring, pos = gather_rings(buffers, layout, index, 2)
            step = [torch.cat([s[j][:, :, n + t:n + t + 1] for s, n in zip(seqs, lengths)]) for j in range(3)]
            out, ring = m(*step, causal=True, state=ring)
            scatter_rings(ring, buffers, layout, index, pos)
            outs.append(out)
        got = torch.cat(outs, dim=2)
    for r, (whole, n) in enumerate(zip(wholes, lengths)):
        torch.testing.assert_close(got[r:r + 1], whole[:, :, n:n + steps], rtol=1e-5, atol=1e-5)
        assert int(buffers[5][slots[r]][0]) == n + steps  # each slot's length advanced by its own tokens
    if stacked:
        for t, b in zip(stack, before):
            assert torch.equal(t[:, 0], b[:, 0]) and torch.equal(t[:, 2], b[:, 2])


# ------------------------------------------------------------------------------------ the ring with a sparse cache
# cache of 4 keys chosen in blocks of 4: at 40 tokens 5 selections. 'sparse-observe' is the linear-only preset's
# layer (Hedgehog, decay, sinks at their own positions, ranked by attention, chosen again by the last 3 queries of
# a multi-token call); 'sparse-recall' ranks by LoLA's recall error, without decay (no attention buffers, no slot_log)
SPARSE_CONFIGS = {
    "sparse-observe": dict(kind="linear", feature_map="hedgehog", window=W, sinks=S, decay="gate", block_size=BLOCK,
                           sink_position="own", sparse_cache=4, sparse_chunk=4, sparse_score="attention",
                           sparse_observe=3),
    "sparse-recall": dict(kind="linear", feature_map="elu", window=W, sinks=S, block_size=BLOCK, sparse_cache=4,
                          sparse_chunk=2, qk_norm=True, feature_proj=D),
}


def _sparse_module(name):
    m = build_attention(PolyAttnConfig(**SPARSE_CONFIGS[name]), 4, D, 2, 0).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return m


def _sparse_layout(m, heads=None):
    from hf_polyattn.ops.packed import RingLayout

    cfg = m.config
    return RingLayout(heads=heads or m.num_kv_heads, features=m.num_features, head_dim=D, window=cfg.window,
                      sinks=cfg.sinks, decay=cfg.decay != "none", cache=cfg.sparse_cache, chunk=cfg.sparse_chunk,
                      kernel_dim=m.kernel_dim, groups=m.groups, attention=cfg.sparse_score == "attention",
                      observe=cfg.sparse_observe)


def _in_process(m, q, k, v, cuts):
    """The module over the chunks between ``cuts`` on its own state objects (what transformers' cache does)."""
    outs, state = [], m.init_state()
    bounds = [0, *cuts, q.shape[2]]
    for a, b in zip(bounds, bounds[1:]):
        out, state = m(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], causal=True, state=state)
        outs.append(out)
    return torch.cat(outs, dim=2)


def _as_the_plugin(m, layout, q, k, v, cuts, heads=2):
    """The vLLM layer's loop (serving/vllm/layer.py): each chunk on the ring unpacked from the slot, or on the ring
    object kept from the previous step when it holds the slot's own views; packed back after each chunk."""
    from hf_polyattn.ops.packed import pack_ring, ring_from_state, unpack_ring

    slot = [b[1] for b in layout.empty(3)]
    outs, kept = [], None
    bounds = [0, *cuts, q.shape[2]]
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        state = m.init_state() if i == 0 else kept if kept is not None else unpack_ring(slot, layout, heads)
        out, state = m(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], causal=True, state=state)
        ring = ring_from_state(m, state, layout)
        pack_ring(ring, slot, layout)
        kept = ring if ring.keys.data_ptr() == slot[1].data_ptr() else None
        outs.append(out)
    return torch.cat(outs, dim=2)


@pytest.mark.parametrize("name", SPARSE_CONFIGS)
# a prompt shorter than the window, past window + sinks, past the first selections; then token by token
@pytest.mark.parametrize("prompt", [5, W + S + 1, W + S + 4 + 4 + 3, 29])
def test_a_sparse_ring_through_a_slot_equals_the_module_on_its_own_state(name, prompt):
    m = _sparse_module(name)
    q, k, v = _inputs(48)
    cuts = [prompt, *range(prompt + 1, 48)]
    with torch.no_grad():
        want = _in_process(m, q, k, v, cuts)
        got = _as_the_plugin(m, _sparse_layout(m, heads=3), q, k, v, cuts)
        if not m.config.sparse_observe:  # the streaming rule alone: any split equals one call
            torch.testing.assert_close(want, m(q, k, v, causal=True), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", SPARSE_CONFIGS)
def test_sparse_chunks_through_a_slot_equal_the_same_chunks_in_process(name):
    m = _sparse_module(name)
    q, k, v = _inputs(48)
    cuts = [7, 19, 20, 33]
    with torch.no_grad():
        want = _in_process(m, q, k, v, cuts)
        got = _as_the_plugin(m, _sparse_layout(m), q, k, v, cuts)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", SPARSE_CONFIGS)
def test_pack_ring_then_unpack_ring_gives_every_sparse_field_back(name):
    from hf_polyattn.ops.packed import pack_ring, ring_from_state, unpack_ring

    m = _sparse_module(name)
    layout = _sparse_layout(m, heads=3)
    q, k, v = _inputs(22)  # the cache full after a few selections, and keys waiting in the block
    with torch.no_grad():
        _, st = m(q, k, v, causal=True, state=m.init_state())
        _, st = m(q[:, :, :1], k[:, :, :1], v[:, :, :1], causal=True, state=st)  # a decoding step: a ring
    ring = ring_from_state(m, st, layout)
    assert int(ring.pending[0]) > 0 and bool(ring.valid[:, S:S + 4].any())  # the case holds a cache and a block
    slot = [b[0] for b in layout.empty(1)]
    pack_ring(ring, slot, layout)
    back = unpack_ring(slot, layout, 2)
    for f in ("kv", "keys", "vext", "valid", "logg", "kin", "slot_log", "pending", "q_hist", "q_real", "score"):
        a, b = getattr(ring, f), getattr(back, f)
        assert (a is None) == (b is None), f
        if a is not None:
            assert torch.equal(a, b), f
    for f in ("head", "count", "length", "extra", "cache", "real_run", "sink_waiting", "sinks"):
        assert getattr(ring, f) == getattr(back, f), f
    assert (ring.filled is None) == (back.filled is None)
    assert back.kin.data_ptr() == slot[6].data_ptr()  # written in place by the next step


def test_sparse_ring_layout_sizes_and_refusals():
    from dataclasses import replace

    from hf_polyattn.ops.packed import RingLayout, gather_rings, pack_ring, ring_from_state, ring_steady

    m = _sparse_module("sparse-observe")
    layout = _sparse_layout(m)
    plain = _ring_layout(m)
    h, g, lam, c = 2, 2, 4, 4
    # the sparse fields' bytes: 8 more slots of keys, [v, 1] and valid; kin, slot_log, pending + q_real, q_hist, score
    extra = (h * 8 * D + h * 8 * (D + 1) + 8 + h * 8 * m.kernel_dim + h * 8 + 1 + c + h * g * c * D + h * lam) * 4
    assert layout.nbytes() == plain.nbytes() + extra
    q, k, v = _inputs(W + S + 9)
    with torch.no_grad():
        _, st = m(q, k, v, causal=True, state=m.init_state())
    ring = ring_from_state(m, st, layout)
    with pytest.raises(ValueError, match="is not the layout's"):
        pack_ring(ring, [b[0] for b in plain.empty(1)], plain)
    with pytest.raises(ValueError, match="is not the layout's"):
        pack_ring(ring, [b[0] for b in replace(layout, cache=8).empty(1)], replace(layout, cache=8))
    with pytest.raises(ValueError, match="kernel_dim must be an int >= 1"):
        replace(layout, kernel_dim=0)
    with pytest.raises(ValueError, match="with cache=0 they must be 0"):
        replace(plain, chunk=4)
    assert not ring_steady([W + S + 9, 0, W, -1, W, 0], layout)  # a sparse ring never batches
    with pytest.raises(ValueError, match="sparse cache"):
        gather_rings(layout.empty(2), layout, torch.tensor([0, 1]), 2)
    assert isinstance(layout, RingLayout)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_sparse_ring_slot_in_half_precision_keeps_float32_and_equals_the_module(dtype):
    from dataclasses import replace

    m = _sparse_module("sparse-observe").to(dtype)
    layout = replace(_sparse_layout(m), key_dtype=dtype)
    assert set(layout.dtypes()) == {torch.float32}  # the ring's buffers, the queries and scores in the working dtype
    q, k, v = _inputs(40, dtype)
    cuts = [25, *range(26, 40)]
    with torch.no_grad():
        want = _in_process(m, q, k, v, cuts)
        got = _as_the_plugin(m, layout, q, k, v, cuts)
    assert torch.isfinite(got).all() and got.dtype == dtype
    torch.testing.assert_close(got, want)
