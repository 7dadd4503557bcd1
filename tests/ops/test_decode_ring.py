"""Decoding on a ``WindowRing`` (ops/decode.py) and the softmax heads' growing buffers (ops/hybrid.py).

The ring is what ``generate()`` runs (no gradient recorded): every test compares its token-by-token outputs with the
whole sequence computed at once (no state), and with the generic recurrent step, across the options a windowed layer
takes (sinks at both positions, decay, window_mix, the polynomial window, q/k maps, FAVOR+'s scaled features,
grouped-query heads, left padding, half precision), and counts the operations of a step so that a path that grows
back towards the generic step's fails here rather than in a benchmark.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hf_polyattn import PolyAttnConfig
from hf_polyattn.ops import HybridState, RecurrentState, build_attention
from hf_polyattn.ops.decode import WindowRing
from hf_polyattn.ops.rotary import RopeRotation

D = 8
N = 40  # tokens: the window (6) and the sinks (2) many times over
PREFILL = 13

CONFIGS = {
    "linear-elu": dict(kind="linear", window=6),
    "linear-sinks-gate-mix": dict(kind="linear", window=6, sinks=2, decay="gate", decay_horizon=8.0,
                                  window_mix=True),
    "linear-sinks-window-position": dict(kind="linear", window=6, sinks=2, sink_position="window", decay="gate",
                                         decay_horizon=8.0),
    "linear-scalar-decay": dict(kind="linear", window=6, sinks=1, decay="scalar", decay_horizon=8.0),
    "hedgehog-sinks": dict(kind="linear", feature_map="hedgehog", window=6, sinks=2, decay="gate"),
    "polysketch-proj-norm": dict(kind="polysketch", sketch_size=4, window=6, sinks=2, feature_proj=D, qk_norm=True,
                                 decay="gate"),
    "polysketch-polynomial-window": dict(kind="polysketch", sketch_size=4, window=6, local_kernel="polynomial"),
    "performer": dict(kind="performer", num_features=16, window=6, sinks=2),
    "hybrid": dict(kind="linear", window=6, sinks=2, decay="gate", window_mix=True, softmax_heads=[(0, 1)]),
    # the long-context recipe's kernel heads
    "linear-recipe": dict(kind="linear", window=6, sinks=2, decay="gate", window_mix=True, feature_proj=D,
                          qk_norm=True),
    # with a bounded memory (decay_max_horizon: the decoding step's own gate path caps too)
    "linear-recipe-max-horizon": dict(kind="linear", window=6, sinks=2, decay="gate", window_mix=True,
                                      feature_proj=D, qk_norm=True, decay_max_horizon=3.0),
}


def _module(opts: dict, heads: int = 4, kv_heads: int = 2, dtype=torch.float64):
    cfg = PolyAttnConfig(block_size=4, **opts)
    pa = build_attention(cfg, heads, D, kv_heads, layer_idx=0).to(dtype)
    with torch.no_grad():  # learnable tensors off their initial values: gates that vary, a mix that matters
        for p in pa.parameters():
            p.add_(0.1 * torch.randn_like(p))
    if cfg.sink_position == "window":
        pa.rope = RopeRotation(1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float64) / D)), D)
    return pa


def _inputs(b=2, heads=4, kv_heads=2, n=N, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, h, n, D, generator=gen, dtype=torch.float64).to(dtype)
                 for h in (heads, kv_heads, kv_heads))


def _decode(pa, q, k, v, mask=None, prefill=PREFILL, grad=False):
    """Outputs of a prefill of ``prefill`` tokens, then one token at a time (the ring unless ``grad``)."""
    state, outs = pa.init_state(), []
    with torch.set_grad_enabled(grad):
        for s, t in [(0, prefill), *((i, i + 1) for i in range(prefill, q.shape[2]))]:
            o, state = pa(q[:, :, s:t], k[:, :, s:t], v[:, :, s:t], causal=True, state=state,
                          key_padding_mask=None if mask is None else mask[:, s:t])
            outs.append(o)
    return torch.cat(outs, dim=2), state


def _kernel_state(state):
    return state.kernel if isinstance(state, HybridState) else state


@pytest.mark.parametrize("batch", [1, 2])  # one sequence takes the step's batched matmuls over the kv heads
@pytest.mark.parametrize("name", list(CONFIGS))
def test_ring_decoding_equals_the_whole_sequence_and_the_generic_step(name, batch):
    pa = _module(CONFIGS[name])
    q, k, v = _inputs(b=batch)
    with torch.no_grad():
        full = pa(q, k, v, causal=True)
    ring_out, state = _decode(pa, q, k, v)
    assert isinstance(_kernel_state(state), WindowRing)  # the ring served the steps
    generic_out, generic_state = _decode(pa, q, k, v, grad=True)
    assert isinstance(_kernel_state(generic_state), RecurrentState)
    torch.testing.assert_close(ring_out, full, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(ring_out, generic_out.detach(), rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("name", ["linear-sinks-gate-mix", "linear-sinks-window-position", "hybrid"])
def test_ring_left_padding_equals_each_row_alone(name):
    """Row 0 left-padded by 5 tokens: its outputs equal the row computed alone; sinks are its first real keys."""
    pa = _module(CONFIGS[name])
    q, k, v = _inputs(b=2)
    pad = 5
    mask = torch.ones(2, N, dtype=torch.bool)
    mask[0, :pad] = False
    out, _ = _decode(pa, q, k, v, mask)
    with torch.no_grad():
        alone = pa(q[:1, :, pad:], k[:1, :, pad:], v[:1, :, pad:], causal=True)
        other = pa(q[1:], k[1:], v[1:], causal=True)
    torch.testing.assert_close(out[:1, :, pad:], alone, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(out[1:], other, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("name", ["linear-sinks-gate-mix", "hybrid"])
def test_a_chunk_after_ring_steps_goes_back_to_the_generic_state(name):
    """Decode, then a multi-token chunk (a second prompt turn), then decode again: still the whole sequence."""
    pa = _module(CONFIGS[name])
    q, k, v = _inputs()
    with torch.no_grad():
        full = pa(q, k, v, causal=True)
        state, outs = pa.init_state(), []
        for s, t in [(0, 9), *((i, i + 1) for i in range(9, 20)), (20, 27), *((i, i + 1) for i in range(27, N))]:
            o, state = pa(q[:, :, s:t], k[:, :, s:t], v[:, :, s:t], causal=True, state=state)
            outs.append(o)
    torch.testing.assert_close(torch.cat(outs, dim=2), full, rtol=1e-9, atol=1e-10)


def test_ring_state_size_is_constant_and_selects_rows():
    pa = _module(CONFIGS["linear-sinks-gate-mix"])
    q, k, v = _inputs(b=3)
    state, sizes = pa.init_state(), []
    with torch.no_grad():
        _, state = pa(q[:, :, :PREFILL], k[:, :, :PREFILL], v[:, :, :PREFILL], causal=True, state=state)
        for i in range(PREFILL, N):
            _, state = pa(q[:, :, i:i + 1], k[:, :, i:i + 1], v[:, :, i:i + 1], causal=True, state=state)
            sizes.append(state.nbytes())
        assert len(set(sizes)) == 1
        # beam search reorders rows: the selected state continues exactly as those rows would
        picked = state.index_select(torch.tensor([2, 0]))
        nxt = (torch.randn(2, 4, 1, D, dtype=torch.float64), *(torch.randn(2, 2, 1, D, dtype=torch.float64)
                                                                for _ in range(2)))
        both, _ = pa(*nxt, causal=True, state=picked)
        ref = state.to_recurrent().index_select(torch.tensor([2, 0]))
        with torch.enable_grad():
            expected, _ = pa(*nxt, causal=True, state=ref)
    torch.testing.assert_close(both, expected.detach(), rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("batch", [1, 2])  # one sequence takes ``decode.fused_step``
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_ring_half_precision_is_finite_and_close(dtype, batch):
    pa = _module(CONFIGS["hybrid"], dtype=dtype)
    q, k, v = _inputs(b=batch, dtype=dtype)
    out, _ = _decode(pa, q, k, v)
    assert out.dtype == dtype and torch.isfinite(out).all()
    with torch.no_grad():
        full = pa(q, k, v, causal=True)
    torch.testing.assert_close(out.float(), full.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("softmax, first", [((0,), True), ((2,), False), ((1,), None), ((0, 1), True),
                                            ((1, 2), False)])
def test_hybrid_decoding_splits_any_softmax_heads_layout(softmax, first):
    """Softmax kv heads at the start or the end of a layer's (a decoding step splits them as views and merges with
    one cat) or between kernel heads (index selects): the steps equal the whole sequence, row by row, with a
    left-padded row."""
    opts = dict(CONFIGS["hybrid"], softmax_heads=[(0, h) for h in softmax])
    pa = _module(opts, heads=6, kv_heads=3)
    assert pa._softmax_first is first
    q, k, v = _inputs(b=2, heads=6, kv_heads=3)
    mask = torch.ones(2, N, dtype=torch.bool)
    mask[0, :5] = False
    out, _ = _decode(pa, q, k, v, mask)
    with torch.no_grad():
        alone = pa(q[:1, :, 5:], k[:1, :, 5:], v[:1, :, 5:], causal=True)
        other = pa(q[1:], k[1:], v[1:], causal=True)
    torch.testing.assert_close(out[:1, :, 5:], alone, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(out[1:], other, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("batch", [1, 2])  # one sequence takes ``decode.fused_step``
@pytest.mark.parametrize("change", ["in_place", "replaced"])
def test_ring_steps_read_parameters_changed_between_steps(change, batch):
    """The step keeps views of the layer's parameters (``decode._plan``): a parameter updated in place or replaced
    by a new one between two steps is what the next step reads, as the generic step (run beside it on a copy of the
    module with the same change) reads it. The maps of q and k and the window mix change; the gate does not (the
    ring keeps each window key's log-gate from its arrival, the generic step recomputes them from the values)."""
    import copy

    opts = dict(kind="linear", window=6, sinks=2, decay="gate", window_mix=True, feature_proj=D, qk_norm=True)
    ring_pa = _module(opts)
    generic_pa = copy.deepcopy(ring_pa)
    q, k, v = _inputs(b=batch)
    outs = {}
    for pa, grad in ((ring_pa, False), (generic_pa, True)):
        state, out = pa.init_state(), []
        for s, t in [(0, PREFILL), *((i, i + 1) for i in range(PREFILL, N))]:
            if s == PREFILL + 9:  # after 8 ring steps
                with torch.no_grad():
                    if change == "in_place":
                        for p in (pa.feature_proj.weight, pa.q_norm.weight, pa.k_norm.bias, pa.window_mix):
                            p.mul_(1.5)
                    else:
                        pa.window_mix = torch.nn.Parameter(pa.window_mix.detach() + 1.0)
                        pa.q_norm.weight = torch.nn.Parameter(pa.q_norm.weight.detach() * 2.0)
                        pa.feature_proj.weight = torch.nn.Parameter(pa.feature_proj.weight.detach().flip(-1))
            with torch.set_grad_enabled(grad):
                o, state = pa(q[:, :, s:t], k[:, :, s:t], v[:, :, s:t], causal=True, state=state)
            assert isinstance(state, WindowRing) != grad or s == 0
            out.append(o.detach())
        outs[grad] = torch.cat(out, dim=2)
    torch.testing.assert_close(outs[False], outs[True], rtol=1e-9, atol=1e-10)


def test_step_plan_is_cached_only_over_parameters_in_the_working_dtype():
    from hf_polyattn.ops import decode

    opts = dict(kind="linear", window=6, sinks=2, decay="gate", window_mix=True, feature_proj=D, qk_norm=True)
    pa = _module(opts, dtype=torch.float32)
    plan = decode._plan(pa, torch.float32, torch.device("cpu"), 0.5)
    assert decode._plan(pa, torch.float32, torch.device("cpu"), 0.5) is plan  # cached
    assert decode._plan(pa, torch.float32, torch.device("cpu"), 0.25) is not plan  # another scale
    pa.to(torch.float64)  # the parameters moved: a new plan
    plan64 = decode._plan(pa, torch.float64, torch.device("cpu"), 0.5)
    assert plan64 is not plan and plan64.gate_weight.dtype == torch.float64
    assert plan64.gate_weight.data_ptr() == pa.gate_weight.data_ptr()  # a view of the parameter itself
    half = _module(opts, dtype=torch.bfloat16)  # a converted copy would miss an in-place update: never kept
    assert decode._plan(half, torch.float32, torch.device("cpu"), 0.5) is not \
        decode._plan(half, torch.float32, torch.device("cpu"), 0.5)


def test_softmax_heads_buffers_grow_with_room_and_stay_exact():
    pa = _module(CONFIGS["hybrid"])
    q, k, v = _inputs(n=N)
    _, state = _decode(pa, q, k, v)
    assert state.length == N and state.keys.shape[2] == N
    assert state.k.shape[2] >= N  # room for the next tokens, written in place
    with torch.enable_grad():  # with a gradient recorded the buffers are exact-size copies
        _, gstate = _decode(pa, q.requires_grad_(), k, v, grad=True)
    assert gstate.k.shape[2] == N


class _CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", ["linear-sinks-gate-mix", "hybrid"])
def test_a_ring_step_dispatches_under_half_the_generic_steps_operations(name):
    """A decoding step is dispatch-bound: the generic step took ~230 operations a layer, most of them on 128 x 64
    tensors. The ring's step of the same layer, counted (not timed) against the generic step's in this test, takes
    under half as many."""
    pa = _module(CONFIGS[name], dtype=torch.float32)
    q, k, v = _inputs(n=PREFILL + 2, dtype=torch.float32)
    step = [t[:, :, PREFILL + 1:PREFILL + 2] for t in (q, k, v)]
    counts = {}
    for grad in (False, True):  # False: the ring; True: the generic step (a recorded gradient)
        with torch.set_grad_enabled(grad):
            _, state = pa(q[:, :, :PREFILL], k[:, :, :PREFILL], v[:, :, :PREFILL], causal=True,
                          state=pa.init_state())
            _, state = pa(*(t[:, :, PREFILL:PREFILL + 1] for t in (q, k, v)), causal=True, state=state)
            assert isinstance(_kernel_state(state), WindowRing) != grad
            with _CountOps() as ops:
                pa(*step, causal=True, state=state)
        counts[grad] = ops.count
    assert counts[False] < 0.5 * counts[True], counts


@pytest.mark.parametrize("heads", [1, 3])
def test_one_causal_query_after_a_past_reads_every_key_without_a_mask(monkeypatch, heads):
    """A decoding step of the softmax heads (one query, no padding) takes SDPA without building a mask, or the
    explicit product for one query head of one sequence; both equal the masked definition."""
    from hf_polyattn.ops import hybrid

    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, heads, 1, D, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(1, 1, 29, D, generator=gen, dtype=torch.float64) for _ in range(2))
    sdpa, masks = torch.nn.functional.scaled_dot_product_attention, []

    def counted(*args, **kwargs):
        masks.append(kwargs.get("attn_mask"))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(hybrid.F, "scaled_dot_product_attention", counted)
    out = hybrid.softmax_attention(q, k, v, causal=True, scale=0.4)
    assert masks == ([] if heads == 1 else [None])
    ref = torch.softmax(q @ k.transpose(-1, -2) * 0.4, -1) @ v
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)


def _rotation(layout: str) -> RopeRotation:
    """A RoPE of 16-dim heads in each pairing the RoPE reading gives."""
    inv = 1.0 / (10000 ** (torch.arange(0, 12, 2, dtype=torch.float64) / 16))
    return {"rotate_half": RopeRotation(inv, 12), "interleaved": RopeRotation.interleaved(inv),
            "rotate_half_every_dim": RopeRotation(1.0 / (10000 ** (torch.arange(0, 16, 2, dtype=torch.float64) / 16)),
                                                  16),  # the halves swapped by a roll
            "pairs": RopeRotation(inv, 12, torch.tensor([[0, 2, 4, 6, 8, 10], [15, 13, 11, 9, 7, 5]])),
            "partial": RopeRotation(inv[:3], 6)}[layout]


LAYOUTS = ["rotate_half", "rotate_half_every_dim", "interleaved", "pairs", "partial"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_rotate_by_one_delta_is_rotate(layout):
    """The decoding step's rotation of its sinks' queries (one delta for the batch, cached) equals the general one,
    for every pairing the RoPE reading gives."""
    rot = _rotation(layout)
    for dtype in (torch.float64, torch.float32, torch.bfloat16):
        x = torch.randn(2, 3, 4, 1, 16).to(dtype)
        for delta in (0, -5, -700, 3, -5):
            assert torch.equal(rot.rotate_by(x, delta), rot.rotate(x, torch.tensor(delta))), (dtype, delta)


@pytest.mark.parametrize("name", ["linear-sinks-window-position", "hybrid"])
def test_compiled_ring_step_equals_the_eager_one(name):
    """``compile_decode``: the ring's step under torch.compile gives the eager step's outputs token by token (left
    padding in row 0, a sink still filling there), and it did run compiled (dynamo captured graphs)."""
    from torch._dynamo.utils import counters

    pa = _module(CONFIGS[name])
    q, k, v = _inputs(b=2)
    mask = torch.ones(2, N, dtype=torch.bool)
    mask[0, :5] = False
    eager, _ = _decode(pa, q, k, v, mask)
    for m in pa.modules():
        if hasattr(m, "compile_decode"):
            m.compile_decode = True
    before = counters["stats"]["unique_graphs"]
    try:
        compiled, state = _decode(pa, q, k, v, mask)
    finally:
        for m in pa.modules():
            if hasattr(m, "compile_decode"):
                m.compile_decode = False
    assert counters["stats"]["unique_graphs"] > before
    assert isinstance(_kernel_state(state), WindowRing)
    torch.testing.assert_close(compiled, eager, rtol=1e-9, atol=1e-10)


def _static_decode(pa, q, k, v, mask=None, static_from=PREFILL + 3, capacity=N + 2):
    """``_decode`` with every state made static (``make_static``) once it is steady, from token ``static_from`` on
    (what ``integration.graphs.DecodeGraphs`` does before it records a step); (outputs, state, tokens run static)."""
    state, outs, static = pa.init_state(), [], 0
    with torch.no_grad():
        for s, t in [(0, PREFILL), *((i, i + 1) for i in range(PREFILL, q.shape[2]))]:
            if s >= static_from and state.at is None and state.steady:
                state.make_static(capacity) if isinstance(state, HybridState) else state.make_static()
            static += state.at is not None if hasattr(state, "at") else 0
            part = None if mask is None or bool(mask[:, s:t].all()) else mask[:, s:t]  # as transformers passes it
            o, state = pa(q[:, :, s:t], k[:, :, s:t], v[:, :, s:t], causal=True, state=state, key_padding_mask=part)
            outs.append(o)
    return torch.cat(outs, dim=2), state, static


@pytest.mark.parametrize("name", ["linear-sinks-gate-mix", "linear-sinks-window-position", "linear-elu",
                                  "hedgehog-sinks", "linear-recipe", "hybrid"])
@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded-token"])
def test_static_steps_equal_the_ring_steps(name, padded):
    """Steps on a static state (the slot as a device index, the softmax heads over a fixed buffer with the unwritten
    positions masked: what a CUDA graph records) give the ring's outputs, token by token; a padded new token in the
    middle of decoding too (the static ring's masked write; the hybrid's softmax heads leave the static state)."""
    pa = _module(CONFIGS[name])
    q, k, v = _inputs(b=2)
    mask = None
    if padded:
        mask = torch.ones(2, N, dtype=torch.bool)
        mask[0, N - 6] = False
    ring_out, ring_state = _decode(pa, q, k, v, mask)
    static_out, state, static = _static_decode(pa, q, k, v, mask)
    assert static >= (N - 6 - PREFILL - 3 if padded and name == "hybrid" else N - PREFILL - 3)  # after make_static
    torch.testing.assert_close(static_out, ring_out, rtol=1e-9, atol=1e-10)
    ring, ring_ref = _kernel_state(state), _kernel_state(ring_state)
    assert ring.at is not None and int(ring.at) == ring.head == ring_ref.head and ring.length == ring_ref.length
    assert isinstance(state, HybridState) is (name == "hybrid")
    if name == "hybrid":
        assert (state.at is None) is padded  # a padded token leaves the static softmax heads
        torch.testing.assert_close(state.keys, ring_state.keys)


def test_make_static_refuses_a_state_that_is_not_steady_and_counts_each_rows_real_keys():
    pa = _module(CONFIGS["linear-sinks-window-position"])
    q, k, v = _inputs(b=2)
    _, short = _decode(pa, q[:, :, :5], k[:, :, :5], v[:, :, :5], prefill=3)  # 5 tokens: the ring not full
    assert isinstance(short, WindowRing) and not short.steady
    with pytest.raises(ValueError, match="only when full with its sinks filled"):
        short.make_static()
    mask = torch.ones(2, N, dtype=torch.bool)
    mask[0, 2:10] = False  # row 0: its 2 sinks, then 8 padded keys: full and steady with 4 real keys seen at 12
    _, state = _decode(pa, q[:, :, :12], k[:, :, :12], v[:, :, :12], mask[:, :12], prefill=9)
    assert state.steady and state.seen.tolist() == [4, 12]
    state.make_static()
    assert state.real.tolist() == [4, 12] and int(state.at) == state.head
    assert state.index_select(torch.tensor([1, 0])).at is None  # reordered rows: a new ring, not static
    assert state.to_recurrent().seen.tolist() == [4, 12]


def test_static_steps_with_a_padded_row_equal_the_ring_steps():
    """Left padding and a padded token while static: each row's sinks' query shift from its own real keys, counted
    on the device (a Python count would be recorded once in a CUDA graph)."""
    pa = _module(CONFIGS["linear-sinks-window-position"])
    q, k, v = _inputs(b=2)
    mask = torch.ones(2, N, dtype=torch.bool)
    mask[0, :5] = False
    mask[1, N - 4] = False
    ring_out, ring_state = _decode(pa, q, k, v, mask)
    static_out, state, static = _static_decode(pa, q, k, v, mask)
    assert static >= N - PREFILL - 3
    torch.testing.assert_close(static_out, ring_out, rtol=1e-9, atol=1e-10)
    assert state.real.tolist() == [N - 5, N - 1] and state.to_recurrent().seen.tolist() == [N - 5, N - 1]


def _fused(pa, on: bool) -> None:
    for m in pa.modules():
        if hasattr(m, "fused_decode"):
            m.fused_decode = on


# the configs whose one-sequence steps ``decode.fused_step`` takes (elementwise or Hedgehog feature maps, a softmax
# window)
FUSED = ["linear-elu", "linear-sinks-gate-mix", "linear-sinks-window-position", "linear-scalar-decay", "hybrid",
         "linear-recipe", "linear-recipe-max-horizon", "hedgehog-sinks"]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("name", FUSED)
def test_fused_steps_equal_the_general_ring_steps(monkeypatch, name, dtype):
    """One unpadded sequence with its ring steady takes ``fused_step`` (counted); its outputs equal the general
    ``ring_step``'s (``fused_decode=False``) token by token and the whole sequence at once, within float rounding:
    the same arithmetic, the queries' and the leaving key's features as rows of one pass, the sinks' rotation as a
    matmul."""
    from hf_polyattn.ops import attention, decode

    pa = _module(CONFIGS[name], dtype=dtype)
    q, k, v = _inputs(b=1, dtype=dtype)
    calls = []
    monkeypatch.setattr(attention, "fused_step", lambda *a: calls.append(1) or decode.fused_step(*a))
    fused, state = _decode(pa, q, k, v)
    assert len(calls) == N - PREFILL  # the ring is full after the prefill (13 keys, window 6)
    _fused(pa, False)
    general, general_state = _decode(pa, q, k, v)
    assert len(calls) == N - PREFILL
    with torch.no_grad():
        full = pa(q, k, v, causal=True)
    tol = dict(rtol=1e-9, atol=1e-10) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fused, general, **tol)
    torch.testing.assert_close(fused, full, **tol)
    ring, ref = _kernel_state(state), _kernel_state(general_state)
    assert (ring.head, ring.count, ring.length, ring.real_run) == (ref.head, ref.count, ref.length, ref.real_run)
    for a, b in zip(ring.tensors(), ref.tensors()):
        torch.testing.assert_close(a, b, **tol)


def test_fused_steps_wait_for_a_window_of_real_keys_after_a_padded_one(monkeypatch):
    """A padded token of one sequence leaves a zero slot in the ring: the general step writes it and the steps
    after it until every slot holds a real key again (``WindowRing.real_run``), then ``fused_step`` again; the
    outputs equal the general step's throughout. A left-padded prefill waits the same way."""
    from hf_polyattn.ops import attention, decode

    pa = _module(CONFIGS["linear-recipe"])
    q, k, v = _inputs(b=1)
    window = pa.config.window
    mask = torch.ones(1, N, dtype=torch.bool)
    mask[0, 2] = False  # inside the prefill, in the window it keeps: the ring starts with a zero slot
    mask[0, PREFILL + 10] = False
    fused_at = []
    original = decode.fused_step
    monkeypatch.setattr(attention, "fused_step", lambda *a: fused_at.append(a[6].length) or original(*a))
    out, _, _ = _static_decode(pa, q, k, v, mask, static_from=N)  # the masks as transformers passes them
    _fused(pa, False)
    general, _, _ = _static_decode(pa, q, k, v, mask, static_from=N)
    torch.testing.assert_close(out, general, rtol=1e-9, atol=1e-10)
    # the padded key at 2 left the window before the prefill's end: fused from the first step, but for the padded
    # token at PREFILL + 10 and the window's steps after it
    waited = set(range(PREFILL + 10, PREFILL + 11 + window))
    assert sorted(fused_at) == sorted(set(range(PREFILL, N)) - waited)
    mask[0, PREFILL - 2] = False  # now in the window the prefill keeps: its ring starts with a zero slot
    fused_at.clear()
    _fused(pa, True)
    out, _, _ = _static_decode(pa, q, k, v, mask, static_from=N)
    assert min(fused_at) == PREFILL + window  # once every slot was written by a decoding step's real key
    _fused(pa, False)
    general, _, _ = _static_decode(pa, q, k, v, mask, static_from=N)
    torch.testing.assert_close(out, general, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("name", ["linear-recipe", "linear-sinks-window-position"])
def test_a_fused_step_dispatches_at_most_six_tenths_of_the_ring_steps_operations(name):
    """``fused_step`` against the general ``ring_step`` on the same steady ring, counted: 59 against 107 dispatched
    operations for the long-context recipe's kernel heads (51 against 95 with the sinks' re-rotated query)."""
    pa = _module(CONFIGS[name], dtype=torch.float32)
    q, k, v = _inputs(b=1, n=PREFILL + 3, dtype=torch.float32)
    counts = {}
    for on in (True, False):
        _fused(pa, on)
        with torch.no_grad():
            _, state = pa(q[:, :, :PREFILL], k[:, :, :PREFILL], v[:, :, :PREFILL], causal=True, state=pa.init_state())
            for i in (PREFILL, PREFILL + 1):  # the second step builds the sinks' rotation for its delta
                _, state = pa(*(t[:, :, i:i + 1] for t in (q, k, v)), causal=True, state=state)
            with _CountOps() as ops:
                pa(*(t[:, :, PREFILL + 2:PREFILL + 3] for t in (q, k, v)), causal=True, state=state)
        counts[on] = ops.count
    assert counts[True] <= 0.6 * counts[False], counts


@pytest.mark.parametrize("layout", LAYOUTS)
def test_rotation_matrix_is_rotate_by(layout):
    """``RopeRotation.matrix_by``: rows times it are ``rotate_by`` (float rounding: the matmul sums each dim's two
    products itself), for every pairing, dtype and delta, the last delta's matrix kept."""
    rot = _rotation(layout)
    for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 1e-5)):
        x = torch.randn(7, 16, dtype=dtype)
        for delta in (0, -5, -700, 3, -5):
            m = rot.matrix_by(delta, 16, x.device, dtype)
            assert m.dtype == dtype and rot.matrix_by(delta, 16, x.device, dtype) is m
            torch.testing.assert_close(x @ m, rot.rotate_by(x, delta), rtol=tol, atol=tol)
    with pytest.raises(ValueError, match="the rotation needs"):
        rot.matrix_by(-1, rot.head_dims_needed - 1, torch.device("cpu"), torch.float32)
