"""Triton sliding window with attention sinks and learned slots (``local_blocks_triton(..., sinks=...)``) against the
PyTorch ``_window_exact`` and the O(n^2) reference, alone and through the attention module.

Without a GPU the kernels run in Triton's interpreter (tests/ops/triton_setup.py); with one, compiled on CUDA.
"""

from __future__ import annotations

import pytest
import torch

from hf_polyattn import PolyAttnConfig
from hf_polyattn.ops import PolyAttention
from hf_polyattn.ops.backend import ENV_VAR
from hf_polyattn.ops.common import _with_normaliser
from hf_polyattn.ops.reference import reference_attention
from hf_polyattn.ops.rotary import RopeRotation
from hf_polyattn.ops.triton import local_blocks_triton
from hf_polyattn.ops.window import sink_shifts
from tests.ops.test_triton_local import HALF_REL, _inputs, _mask, _normwise
from tests.ops.test_triton_window import _compare, _module
from tests.ops.triton_setup import DEVICE  # sets TRITON_INTERPRET before the kernels load

N = 37
D = 8
# a RoPE with a small base: angles of order 1 per position on every pair, so that a wrong rotation shows
ROPE = RopeRotation(1.0 / 10.0 ** (torch.arange(0, D, 2, dtype=torch.float64) / D), D)


@pytest.mark.parametrize("mask_kind", [None, "right", "left"], ids=["nomask", "right", "left"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal-s3-l2", "bidir-l2"])
@pytest.mark.parametrize("kernel,degree", [("softmax", 2), ("polynomial", 2), ("polynomial", 4)],
                         ids=["softmax", "poly2", "poly4"])
def test_matches_pytorch_window(kernel, degree, causal, mask_kind, monkeypatch):
    """w = 5 at n = 37, GQA (H = 4, Hkv = 2), padding (row 1 left-padded by 20: its sinks are keys 20..22), 3 sinks
    (causal) and 2 learned slots."""
    _compare(kernel, degree, 5, causal, mask_kind, monkeypatch, sinks=3 if causal else 0, learned_sinks=2)


@pytest.mark.parametrize("sinks,learned", [(3, 0), (0, 3)], ids=["sinks-only", "learned-only"])
def test_sinks_or_slots_alone(sinks, learned, monkeypatch):
    _compare("softmax", 2, 4, True, "left", monkeypatch, sinks=sinks, learned_sinks=learned)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
def test_two_slot_tiles_several_row_tiles_large_scores(causal, monkeypatch):
    """19 slots (6 sinks + 13 learned: two tiles of 16) at n = 150 (3 row tiles), w = 66, scores ~ +-60 with FAVOR+'s
    q_log_scale: the row maxima come from the slots as well as the window."""
    _compare("softmax", 2, 66, causal, "left", monkeypatch, n=150, q_scale=8.0, log_scale=True,
             sinks=6 if causal else 0, learned_sinks=13)


@pytest.mark.parametrize("rotated", [False, True], ids=["own-positions", "rotated"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_inputs(dtype, rotated):
    """Half q, k, v and sinks (and the queries re-rotated for them, ``sink_q``): fp32 outputs, finite, within HALF_REL
    (normwise) of the fp32 PyTorch window; every gradient in its input's dtype."""
    mod = _module("softmax", 2, 7, sinks=3, learned_sinks=2)
    q, k, v, _ = _inputs(dtype=dtype)
    mask = _mask("left")
    found = mod._window_sinks(k, v, mask, None)
    rest = found.rest(mask)
    # what a bf16 model hands over, as inputs of their own (the gathered sinks' path back into k is PyTorch's gather)
    leaves = [x.detach().to(dtype).requires_grad_() for x in (found.k, found.v)]
    extra = {}
    if rotated:
        shifts = sink_shifts(mask, N, N, 0, 7 + 3 - 1, q.device)
        leaves.append(ROPE.rotate(q.detach(), shifts[:, None, None, :]).requires_grad_())
        extra = dict(sink_q=leaves[-1], learned=2)
    loc, log_far = local_blocks_triton(q, k, _with_normaliser(v, rest), 16, True, D ** -0.5, "softmax", rest,
                                       window=7, sinks=(*leaves[:2], found.pos), **extra)
    assert loc.dtype == torch.float32
    f32 = [x.detach().float().requires_grad_() for x in (q, k, v, *leaves)]
    ref, ref_far = mod._window_exact(f32[0], f32[1], _with_normaliser(f32[2], rest), rest, True, D ** -0.5, None,
                                     f32[3], f32[4], found.pos, *((f32[5], 2) if rotated else ()))
    _normwise(loc, ref, HALF_REL, "loc")
    _normwise(log_far.exp(), ref_far, HALF_REL, "exp(log_far)")
    g = torch.randn_like(ref)
    inputs = (q, k, v, *leaves)
    for name, a, b, x in zip(["q", "k", "v", "sink_k", "sink_v", "sink_q"],
                             torch.autograd.grad((loc * g).sum(), inputs), torch.autograd.grad((ref * g).sum(), f32),
                             inputs):
        assert a.dtype == x.dtype and torch.isfinite(a).all()
        _normwise(a.float(), b, HALF_REL, f"d{name}")


def test_sinks_argument_checks():
    q = torch.randn(1, 2, 2, 10, 4, device=DEVICE)
    k = torch.randn(1, 2, 1, 10, 4, device=DEVICE)
    v = torch.randn(1, 2, 1, 10, 5, device=DEVICE)
    good = (torch.randn(1, 2, 1, 3, 4, device=DEVICE), torch.randn(1, 2, 1, 3, 5, device=DEVICE),
            torch.zeros(1, 3, dtype=torch.long, device=DEVICE))
    with pytest.raises(ValueError, match="^sinks need window > 0"):
        local_blocks_triton(q, k, v, 4, True, 1.0, "softmax", sinks=good)
    for bad, match in (((good[0], good[1]), "^sinks must be a tuple"),
                       ((good[0][..., :3], good[1], good[2]), "^sink keys / values need"),
                       ((good[0], good[1], good[2].float()), "^sink positions need"),
                       ((good[0], good[1][:, :, :, :2], good[2]), "^sink keys and values need shapes")):
        with pytest.raises(ValueError, match=match):
            local_blocks_triton(q, k, v, 4, True, 1.0, "softmax", window=3, sinks=bad)
    # the queries re-rotated for the sinks (sink_position='window'), and the learned slots before them
    with pytest.raises(ValueError, match=r"^sink_q needs sinks"):
        local_blocks_triton(q, k, v, 4, True, 1.0, "softmax", window=3, sink_q=q)
    for sink_q, match in ((q[..., :9, :], r"^sink_q needs q's shape \(1, 2, 2, 10, 4\), got \(1, 2, 2, 9, 4\)"),
                          (q.double(), r"^sink_q must be a float32, bfloat16 or float16 tensor")):
        with pytest.raises(ValueError, match=match):
            local_blocks_triton(q, k, v, 4, True, 1.0, "softmax", window=3, sinks=good, sink_q=sink_q)
    for bad in (-1, 4, True, 1.0):
        with pytest.raises(ValueError, match=r"^learned must be an int in \[0, 3\]"):
            local_blocks_triton(q, k, v, 4, True, 1.0, "softmax", window=3, sinks=good, sink_q=q, learned=bad)


# ------------------------------------------------------------------ through the attention module
MODULE_KINDS = [
    dict(kind="polysketch", sketch="learned", sketch_size=4, window=5, sinks=3, learned_sinks=2),
    dict(kind="linear", feature_map="elu", window=5, window_mix=True, sinks=2),
    dict(kind="performer", num_features=8, window=5, sinks=2, learned_sinks=1),  # FAVOR+'s q_log_scale
    dict(kind="sliding_window", window=5, sinks=4, learned_sinks=2),
    dict(kind="sliding_window", window=6, local_kernel="polynomial", degree=4, sinks=2),
]


def _spied(monkeypatch):
    """(the number of slots (0 without sinks), whether re-rotated queries came) of each Triton window call."""
    import hf_polyattn.ops.triton as triton_pkg

    calls = []
    real = triton_pkg.local_blocks_triton

    def spy(*a, **kw):
        calls.append((0 if kw.get("sinks") is None else kw["sinks"][0].shape[3], kw.get("sink_q") is not None))
        return real(*a, **kw)

    monkeypatch.setattr(triton_pkg, "local_blocks_triton", spy)
    return calls


def _module_pair(opts, rope=None):
    """The same module on the 'loop' and the 'triton' backends; ``rope``: the RoPE it re-rotates the queries that
    score its sinks with (``sink_position='window'``)."""
    mods = {which: PolyAttention(PolyAttnConfig(block_size=16, backend=which, **opts), 4, 8, 2).to(DEVICE)
            for which in ("loop", "triton")}
    with torch.no_grad():
        for p in mods["loop"].parameters():  # slots and mixing factor away from their start
            p.add_(0.3 * torch.randn_like(p))
    mods["triton"].load_state_dict(mods["loop"].state_dict())
    for mod in mods.values():
        mod.rope = rope
    return mods


# causal: every kind; bidirectional (sinks are causal only): the kinds with learned slots, without their sinks
def _name(opts) -> str:
    return "-".join(str(v) for v in opts.values())


MODULE_CASES = [pytest.param(opts, True, None, id=f"causal-{_name(opts)}") for opts in MODULE_KINDS]
MODULE_CASES += [pytest.param({**opts, "sinks": 0}, False, None, id=f"bidir-{_name(opts)}")
                 for opts in MODULE_KINDS if opts.get("learned_sinks")]
# sinks at positions within the window (sink_position='window') of a RoPE model: the kernels score them with the
# re-rotated queries, whose gradient the host turns back into q's
MODULE_CASES += [pytest.param(opts, True, ROPE, id=f"rope-{_name(opts)}") for opts in MODULE_KINDS
                 if opts.get("learned_sinks") or opts.get("local_kernel")]


@pytest.mark.parametrize("opts,causal,rope", MODULE_CASES)
def test_attention_module_on_triton_backend(opts, causal, rope, monkeypatch):
    """Backend 'triton' equals 'loop' and the O(n^2) reference (values; q, k, v and slot gradients), causal also with
    fewer queries than keys (a prefill after a cached prefix); bidirectional with the learned slots alone."""
    calls = _spied(monkeypatch)
    monkeypatch.delenv(ENV_VAR, raising=False)
    mods = _module_pair(opts, rope)
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(2, h, N, 8, generator=gen).to(DEVICE).requires_grad_() for h in (4, 2, 2))
    mask = torch.ones(2, N, dtype=torch.bool, device=DEVICE)
    mask[1, :6] = False  # row 1's sinks start at key 6
    for lq in ((N, 9) if causal else (N,)):
        qq = q[:, :, N - lq:]
        results = {}
        for which, mod in mods.items():
            out = mod(qq, k, v, causal=causal, key_padding_mask=mask)
            slots = [p for n, p in mod.named_parameters() if n.startswith("sink_")]
            results[which] = (out, torch.autograd.grad(out.square().sum(), (q, k, v, *slots)))
        ref = reference_attention(mods["loop"], qq, k, v, causal=causal, key_padding_mask=mask)
        torch.testing.assert_close(results["triton"][0], results["loop"][0], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(results["triton"][0], ref, rtol=1e-4, atol=1e-4)
        for i, (g_t, g_l) in enumerate(zip(results["triton"][1], results["loop"][1])):
            torch.testing.assert_close(g_t, g_l, rtol=1e-4, atol=1e-5 * g_l.abs().max().item(), msg=f"gradient {i}")
    slots = opts.get("sinks", 0) + opts.get("learned_sinks", 0)
    assert calls and all(c == (slots, rope is not None) for c in calls), calls


@pytest.mark.parametrize("rope", [None, ROPE], ids=["own-positions", "rope"])
def test_chunked_equals_full_on_triton_backend(rope, monkeypatch):
    """Prefill in chunks and token-by-token decoding on the 'triton' backend: the state's sink slots reach the
    kernels with every later chunk longer than the window; a decode step reads its own row only, as tensors
    (``SlidingWindowAttention._window_rows_dense``: the kernel would compute every row of the window for it); with
    a RoPE (lengths beyond w + s) the state's count of real keys (``seen``) places each chunk's queries."""
    from hf_polyattn.kinds.sliding_window import SlidingWindowAttention

    calls, dense = _spied(monkeypatch), []
    rows = SlidingWindowAttention._window_rows_dense
    monkeypatch.setattr(SlidingWindowAttention, "_window_rows_dense",
                        lambda self, q5, *a, **k: dense.append(q5.shape[3]) or rows(self, q5, *a, **k))
    monkeypatch.delenv(ENV_VAR, raising=False)
    mod = _module_pair(dict(kind="sliding_window", window=4, sinks=2, learned_sinks=1), rope)["triton"]
    gen = torch.Generator().manual_seed(8)
    n = 14
    q, k, v = (torch.randn(2, h, n, 8, generator=gen).to(DEVICE) for h in (4, 2, 2))
    mask = torch.ones(2, n, dtype=torch.bool, device=DEVICE)
    mask[0, :3] = False
    with torch.no_grad():
        full = mod(q, k, v, causal=True, key_padding_mask=mask)
        state, outs = mod.init_state(), []
        for a, b in ((0, 5), (5, 11), *((i, i + 1) for i in range(11, n))):
            o, state = mod(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], causal=True, state=state,
                           key_padding_mask=mask[:, a:b])
            outs.append(o)
    torch.testing.assert_close(torch.cat(outs, dim=2), full, rtol=1e-5, atol=1e-5)
    assert state.sink_mask.all() and len(calls) == 1 + 2 and dense == [1] * (n - 11)
    # the learned slot, the state's 2 sinks, 2 (empty) sink slots of the chunk
    assert calls[-1] == (1 + 2 + 2, rope is not None)
    assert state.seen is None if rope is None else state.seen.tolist() == [n - 3, n]
