"""ops/slot_step.py: one decoding step of many sequences' steady rings in their slots of stacked buffers.

The reference is the whole sequence in one call: B sequences of different lengths, each prefilled into its own slot
(``pack_ring``), then stepped together by ``slot_step`` token after token, give each sequence's outputs of the
whole call; the slots and entries the step does not own are left as they were."""

import math

import pytest
import torch

from hf_polyattn import PolyAttnConfig
from hf_polyattn.ops import build_attention
from hf_polyattn.ops.cpu_kernels import kernel_error, run_slot_step_native, slot_step_kernel
from hf_polyattn.ops.packed import RingLayout, pack_ring, ring_from_state
from hf_polyattn.ops.rotary import RopeRotation
from hf_polyattn.ops.slot_step import (
    compiled_slot_step,
    run_slot_step,
    slot_buffers,
    slot_plan,
    slot_state,
    slot_step,
    slot_step_reason,
)

W, S, BLOCK, D, HQ, HKV = 8, 2, 4, 16, 4, 2
ROPE = RopeRotation(1.0 / 10.0 ** (torch.arange(0, D, 2, dtype=torch.float64) / D), D)

CONFIGS = {
    # the demo's layer (elu, gated decay, window mix, q/k LayerNorm, a feature projection, sinks at window positions)
    "demo": dict(kind="linear", feature_map="elu", window=W, sinks=S, decay="gate", window_mix=True,
                 window_mix_init=0.01, block_size=BLOCK, qk_norm=True, feature_proj=D, decay_horizon=16.0),
    "demo-capped": dict(kind="linear", feature_map="elu", window=W, sinks=S, decay="gate", block_size=BLOCK,
                        qk_norm=True, feature_proj=D, decay_max_horizon=4.0),
    "hedgehog-own": dict(kind="linear", feature_map="hedgehog", window=W, sinks=S, decay="gate", block_size=BLOCK,
                         sink_position="own"),
    "relu-scalar": dict(kind="linear", feature_map="relu", window=W, sinks=S, decay="scalar", block_size=BLOCK),
    "plain-window": dict(kind="linear", window=W, sinks=S, block_size=BLOCK),
}


def _module(name, rope=True):
    m = build_attention(PolyAttnConfig(**CONFIGS[name]), HQ, D, HKV, 0).eval()
    with torch.no_grad():  # away from the initial values, so that a parameter read wrongly shows
        for p in m.parameters():
            p.add_(0.1 * torch.randn_like(p))
    if rope:
        m.rope = ROPE
    return m


def _run(m, lengths, steps, slots, dtype=torch.float32, step_fn=slot_step, sub=1, device="cpu"):
    """(the outputs of ``steps`` tokens of each sequence stepped together (B, Hq, steps, D), each sequence's whole
    call, the stack of buffers (slots, 3 entries, ...) and a copy of it from before the steps)."""
    layout = RingLayout(heads=3, features=m.num_features, head_dim=D, window=W, sinks=S,
                        decay=m.config.decay != "none", key_dtype=dtype)
    raw, stack = slot_buffers(layout, 5, 3, device)
    raw.copy_(torch.randn_like(raw))  # every slot and entry filled: one the step should not touch shows
    seqs = [[torch.randn(1, h, n + steps, D, dtype=dtype).to(device) for h in (HQ, HKV, HKV)] for n in lengths]
    scale = 1.0 / math.sqrt(D)
    with torch.no_grad():
        wholes = [m(q, k, v, causal=True) for q, k, v in seqs]
        for (q, k, v), n, slot in zip(seqs, lengths, slots):
            _, st = m(q[:, :, :n], k[:, :, :n], v[:, :, :n], causal=True, state=m.init_state())
            pack_ring(ring_from_state(m, st, layout), [t[slot, sub] for t in stack], layout)
        before = [t.clone() for t in stack]
        plan = slot_plan(m, layout.work, torch.device(device), scale)
        assert plan is not None
        index, sub_t = torch.tensor(slots, device=device), torch.tensor([sub], device=device)
        state, offsets = slot_state(stack)
        dims = (3, 3, m.num_features, D, layout.decay)
        outs = []
        for t in range(steps):
            q, k, v = (torch.cat([s[j][:, :, n + t] for s, n in zip(seqs, lengths)]) for j in range(3))
            q4 = q.view(len(slots), HKV, HQ // HKV, D)
            if step_fn == "native":
                f32 = [t.float().contiguous() for t in (q4, k, v)]
                out = run_slot_step_native(slot_step_kernel(), *f32, index, sub, state, plan,
                                           torch.tensor(offsets), dims)
            else:
                out = run_slot_step(step_fn, q4, k, v, index, sub_t, state, plan, offsets, dims)
            outs.append(out.reshape(len(slots), HQ, 1, D).to(dtype))
    return torch.cat(outs, dim=2), wholes, stack, before


@pytest.mark.parametrize("rope", [True, False])
@pytest.mark.parametrize("name", CONFIGS)
def test_steps_of_a_batch_equal_each_whole_sequence(name, rope):
    m = _module(name, rope)
    lengths, steps, slots = [W + S, 2 * W + 5, 4 * W + 3], 2 * W + 1, [3, 0, 2]
    got, wholes, stack, before = _run(m, lengths, steps, slots)
    for r, (whole, n) in enumerate(zip(wholes, lengths)):
        torch.testing.assert_close(got[r:r + 1], whole[:, :, n:n + steps], rtol=1e-5, atol=1e-5)
        assert stack[5][slots[r], 1, 0] == n + steps  # the length counter advanced by the slot's own tokens
    # every other entry and slot as it was; ``valid`` never written (a steady ring's slots all hold keys)
    for t, b in zip(stack, before):
        assert torch.equal(t[:, 0], b[:, 0]) and torch.equal(t[:, 2], b[:, 2])
        assert torch.equal(t[[1, 4]], b[[1, 4]])
    assert torch.equal(stack[3], before[3])


def _native_or_skip():
    if slot_step_kernel() is None:  # CI builds it: .ci/run's machines have a C compiler
        pytest.skip(f"the native kernel is not built here: {kernel_error()}")
    return "native"


@pytest.mark.parametrize("rope", [True, False])
@pytest.mark.parametrize("name", CONFIGS)
def test_native_step_equals_each_whole_sequence_and_the_reference(name, rope):
    """ops/cpu/slot_step.c: the same outputs as the whole sequence and the same buffers as the PyTorch step."""
    m = _module(name, rope)
    lengths, steps, slots = [W + S, 2 * W + 5, 4 * W + 3], 2 * W + 1, [3, 0, 2]
    torch.manual_seed(0)
    got, wholes, stack, before = _run(m, lengths, steps, slots, step_fn=_native_or_skip())
    for r, (whole, n) in enumerate(zip(wholes, lengths)):
        torch.testing.assert_close(got[r:r + 1], whole[:, :, n:n + steps], rtol=1e-5, atol=1e-5)
    for t, b in zip(stack, before):
        assert torch.equal(t[:, 0], b[:, 0]) and torch.equal(t[:, 2], b[:, 2])
        assert torch.equal(t[[1, 4]], b[[1, 4]])
    torch.manual_seed(0)
    _, _, reference, _ = _run(m, lengths, steps, slots)
    for a, b in zip(stack, reference):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("native", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_model_is_finite_and_equal(dtype, native):
    m = _module("demo").to(dtype)
    lengths, steps = [W + S + 1, 3 * W], W + 2
    got, wholes, _, _ = _run(m, lengths, steps, [1, 4], dtype, step_fn=_native_or_skip() if native else slot_step)
    assert torch.isfinite(got).all()
    for r, (whole, n) in enumerate(zip(wholes, lengths)):
        torch.testing.assert_close(got[r:r + 1], whole[:, :, n:n + steps])


def test_a_single_sequence_steps_alone():
    m = _module("demo")
    got, wholes, _, _ = _run(m, [3 * W + 1], W + 3, [2], sub=0)
    torch.testing.assert_close(got, wholes[0][:, :, 3 * W + 1:], rtol=1e-5, atol=1e-5)


def test_compiled_step_equals_the_eager_step():
    """The compiled step (what the vLLM plugin runs) on batches of 1 and 3 and on a layer with one kv head fewer
    than the buffers hold: the same outputs and the same buffers as the eager reference."""
    m = _module("demo")
    for lengths, slots in (([2 * W + 1], [3]), ([W + S, 2 * W + 5, 4 * W + 3], [3, 0, 2])):
        torch.manual_seed(0)
        eager, _, stack_e, _ = _run(m, lengths, W + 2, slots)
        torch.manual_seed(0)
        compiled, _, stack_c, _ = _run(m, lengths, W + 2, slots, step_fn=compiled_slot_step())
        torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
        for a, b in zip(stack_c, stack_e):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (recipes/gpu_checks.sh serve runs it)")
def test_compiled_step_on_cuda_equals_each_whole_sequence():
    """The vLLM plugin's decoding step on a GPU (no native kernel there): ``slot_step`` compiled for CUDA."""
    m = _module("demo").cuda()
    lengths, steps, slots = [W + S, 2 * W + 5, 4 * W + 3], W + 2, [3, 0, 2]
    got, wholes, _, _ = _run(m, lengths, steps, slots, step_fn=compiled_slot_step(), device="cuda")
    for r, (whole, n) in enumerate(zip(wholes, lengths)):
        torch.testing.assert_close(got[r:r + 1], whole[:, :, n:n + steps], rtol=1e-5, atol=1e-5)


def test_layers_it_does_not_serve_are_named():
    cfg = dict(CONFIGS["demo"])
    assert slot_step_reason(_module("demo")) is None
    m = build_attention(PolyAttnConfig(**dict(cfg, sparse_cache=16, sparse_chunk=4)), HQ, D, HKV, 0)
    assert slot_step_reason(m) == "a sparse cache"
    m = build_attention(PolyAttnConfig(**dict(cfg, feature_map="taylor")), HQ, D, HKV, 0)
    assert "feature map" in slot_step_reason(m)
    m = _module("demo")
    m.rope = RopeRotation.interleaved(ROPE.inv_freq)
    assert "rotation pairs" in slot_step_reason(m)
    assert slot_plan(m, torch.float32, torch.device("cpu"), 0.25) is None


def test_without_a_compiler_the_native_step_is_absent_and_says_why(monkeypatch, tmp_path):
    import hf_polyattn.ops.cpu_kernels as ck

    monkeypatch.setenv("HF_POLYATTN_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setattr(ck, "_compiler", lambda: None)
    ck.slot_step_kernel.cache_clear()
    try:
        assert ck.slot_step_kernel() is None
        assert "no C compiler found" in ck.kernel_error()
        assert not list(tmp_path.iterdir())
    finally:
        ck.slot_step_kernel.cache_clear()


def test_the_native_step_is_built_once_into_its_cache(monkeypatch, tmp_path):
    import hf_polyattn.ops.cpu_kernels as ck

    _native_or_skip()
    monkeypatch.setenv("HF_POLYATTN_KERNEL_CACHE", str(tmp_path))
    first = ck._build(ck._SOURCE, "slot_step")
    stamp = first.stat().st_mtime_ns
    assert ck._build(ck._SOURCE, "slot_step") == first and first.stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [first.name]
