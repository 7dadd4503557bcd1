"""kind 'delta': the gated delta rule's chunked path against its recurrent form and the paper's definition, the
layer against ``reference_delta`` (window, sinks, decay, short convolution, padding), decoding with and without a
cache, causality, half precision, gradients, linear memory and the start as the window + sinks model."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from hf_polyattn import PolyAttnConfig
from hf_polyattn.kinds.delta import DeltaAttention
from hf_polyattn.kinds.sliding_window import SlidingWindowAttention
from hf_polyattn.ops.delta import delta_rule, delta_rule_chunked, delta_rule_recurrent, l2_normalise
from hf_polyattn.ops.reference import reference_delta
from recipes.live_memory import PeakLive
from tests.kinds.inputs import padding_mask, qkv


def _rule_inputs(b=2, h=3, g=2, n=150, dk=8, dv=5, seed=0, dtype=torch.float64, gates=True, state=True):
    gen = torch.Generator().manual_seed(seed)

    def draw(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q = l2_normalise(draw(b, h, g, n, dk))
    k = l2_normalise(draw(b, h, 1, n, dk))
    v = draw(b, h, 1, n, dv)
    beta = torch.sigmoid(draw(b, h, 1, n))
    log_gate = F.logsigmoid(draw(b, h, 1, n) + 2.0) if gates else None
    s0 = draw(b, h, 1, dk, dv) if state else None
    cast = [None if t is None else t.to(dtype) for t in (q, k, v, beta, log_gate, s0)]
    return tuple(cast)


def _paper_form(q, k, v, beta, log_gate, s0):
    """S_t = a_t S_{t-1} (I - b_t k_t k_t^T) + b_t v_t k_t^T (S: d_v x d_k), o_t = S_t q_t, one token at a time."""
    s = torch.zeros(*k.shape[:3], v.shape[-1], k.shape[-1], dtype=q.dtype) if s0 is None else s0.transpose(-1, -2)
    eye = torch.eye(k.shape[-1], dtype=q.dtype)
    outs = []
    for t in range(q.shape[-2]):
        kt, bt = k[..., t, :], beta[..., t, None, None]
        a = 1.0 if log_gate is None else torch.exp(log_gate[..., t])[..., None, None]
        s = a * s @ (eye - bt * kt[..., :, None] * kt[..., None, :]) + bt * v[..., t, :, None] * kt[..., None, :]
        outs.append((s @ q[..., t, :, None]).squeeze(-1))
    return torch.stack(outs, dim=-2), s.transpose(-1, -2)


@pytest.mark.parametrize("chunk,n", [(64, 150), (16, 150), (4, 9), (64, 1), (64, 64)], ids=lambda x: str(x))
@pytest.mark.parametrize("gates,state", [(True, True), (False, False), (True, False)], ids=["gated-s0", "plain",
                                                                                            "gated"])
def test_chunked_equals_the_definition(chunk, n, gates, state):
    args = _rule_inputs(n=n, gates=gates, state=state)
    want, want_state = _paper_form(*args)
    out, final = delta_rule_chunked(*args, chunk=chunk)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
    torch.testing.assert_close(final, want_state, rtol=0, atol=1e-12)
    out, final = delta_rule_recurrent(*args)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
    torch.testing.assert_close(final, want_state, rtol=0, atol=1e-12)


def test_chunked_float32_accumulates_in_float32():
    """fp32 inputs over 3 chunks (gates near 1: the state keeps 150 tokens) within 2e-5 of float64."""
    args = _rule_inputs(n=150)
    want, want_state = _paper_form(*args)
    out, final = delta_rule_chunked(*(t.float() for t in args))
    assert out.dtype == final.dtype == torch.float32
    torch.testing.assert_close(out.double(), want, rtol=0, atol=2e-5)
    torch.testing.assert_close(final.double(), want_state, rtol=0, atol=2e-5)


def test_chunked_path_gradcheck():
    """Gradients of every input (q, k, v, write strengths, log-gates, initial state) through the triangular solves
    and the chunk loop, float64, 3 chunks of 4."""
    args = tuple(t.requires_grad_() for t in _rule_inputs(b=1, h=1, g=2, n=10, dk=3, dv=2))
    assert torch.autograd.gradcheck(lambda *a: delta_rule_chunked(*a, chunk=4), args)


def test_padded_tokens_write_nothing():
    """beta 0 and log-gate 0 at a token: the state and every later output are those of the sequence without it."""
    q, k, v, beta, lg, s0 = _rule_inputs(n=40)
    keep = torch.ones(40, dtype=torch.bool)
    keep[[0, 5, 17, 33]] = False
    out, final = delta_rule_chunked(q, k, v, beta * keep, lg * keep, s0, chunk=8)
    short, short_final = delta_rule_chunked(q[..., keep, :], k[..., keep, :], v[..., keep, :], beta[..., keep],
                                            lg[..., keep], s0, chunk=8)
    torch.testing.assert_close(out[..., keep, :], short, rtol=0, atol=1e-12)
    torch.testing.assert_close(final, short_final, rtol=0, atol=1e-12)


def test_delta_rule_overwrites_a_key():
    """The point of the delta rule: writing v2 under a unit key that held v1 with b = 1 reads back v2 exactly (an
    additive state would read v1 + v2); with b = 0.5, half of each."""
    k = torch.zeros(1, 1, 1, 2, 8, dtype=torch.float64)
    k[..., 3] = 1.0
    v = torch.randn(1, 1, 1, 2, 4, dtype=torch.float64)
    out, _ = delta_rule_chunked(k, k, v, torch.ones(1, 1, 1, 2, dtype=torch.float64))
    torch.testing.assert_close(out[..., 1, :], v[..., 1, :], rtol=0, atol=1e-15)
    out, _ = delta_rule_chunked(k, k, v, torch.full((1, 1, 1, 2), 0.5, dtype=torch.float64))
    torch.testing.assert_close(out[..., 1, :], 0.25 * v[..., 0, :] + 0.5 * v[..., 1, :], rtol=0, atol=1e-15)


# --------------------------------------------------------------------------------------------------- the layer
LAYERS = {
    "delta": dict(window=0, sinks=0, decay="none"),
    "gated": dict(window=0, sinks=0, decay="gate"),
    "window-sinks-gate": dict(window=5, sinks=2, decay="gate"),
    "window-sinks-gate-max-horizon": dict(window=5, sinks=2, decay="gate", decay_max_horizon=2.0),
    "window-learned-scalar-conv": dict(window=4, sinks=0, learned_sinks=2, decay="scalar", short_conv=3),
    "conv-gate": dict(window=0, sinks=0, decay="gate", short_conv=4),
    "elu-window": dict(window=4, sinks=1, decay="gate", delta_feature_map="elu"),
    "hedgehog-conv": dict(window=0, sinks=0, decay="scalar", short_conv=2, delta_feature_map="hedgehog"),
}


def _layer(opts: dict, heads=4, kv_heads=2, d=8, perturb=True, dtype=torch.float64, **extra) -> DeltaAttention:
    mod = DeltaAttention(PolyAttnConfig.for_kind("delta", **{**opts, **extra}), heads, d, kv_heads).to(dtype)
    if perturb:  # off their initial values, so that every parameter's role is checked
        gen = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for p in mod.parameters():
                p.add_(0.3 * torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.dtype))
    return mod


@pytest.mark.parametrize("side", [None, "left", "right", "holes"])
@pytest.mark.parametrize("layer", list(LAYERS))
def test_layer_equals_reference(layer, side):
    """70 tokens (two chunks of 64), GQA 4/2, float64."""
    mod = _layer(LAYERS[layer])
    q, k, v = qkv(2, 4, 2, 70, 70, 8, seed=1)
    mask = padding_mask(2, 70, side)
    out = mod(q, k, v, causal=True, key_padding_mask=mask)
    ref = reference_delta(mod, q, k, v, causal=True, key_padding_mask=mask)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)


def test_fewer_queries_than_keys():
    """Causal rows bottom-right aligned: 5 queries on the last 5 of 70 keys (no short conv: it needs every query)."""
    mod = _layer(LAYERS["window-sinks-gate"])
    q, k, v = qkv(2, 4, 2, 5, 70, 8, seed=2)
    torch.testing.assert_close(mod(q, k, v, causal=True), reference_delta(mod, q, k, v, causal=True), rtol=0,
                               atol=1e-12)


@pytest.mark.parametrize("side", [None, "left"])
@pytest.mark.parametrize("layer", list(LAYERS))
def test_decode_equals_no_cache(layer, side):
    """A chunk of 70 tokens with a state, then tokens one at a time, then a chunk of 9: every output and the growth
    of nothing (the state's bytes are the same after 80 tokens as after 71)."""
    mod = _layer(LAYERS[layer])
    n = 80
    q, k, v = qkv(2, 4, 2, n, n, 8, seed=3)
    mask = padding_mask(2, n, side)
    full = mod(q, k, v, causal=True, key_padding_mask=mask)
    state, outs, sizes = mod.init_state(), [], []
    for lo, hi in [(0, 70), *((t, t + 1) for t in range(70, 71)), (71, n)]:
        m = None if mask is None else mask[:, lo:hi]
        out, state = mod(q[:, :, lo:hi], k[:, :, lo:hi], v[:, :, lo:hi], causal=True, key_padding_mask=m,
                         state=state)
        outs.append(out)
        sizes.append(state.nbytes())
    torch.testing.assert_close(torch.cat(outs, dim=2), full, rtol=0, atol=1e-12)
    assert state.length == n and sizes[-1] == sizes[-2]
    for t in range(n, n + 3):  # and token by token beyond
        one = qkv(2, 4, 2, 1, 1, 8, seed=10 + t)
        out, state = mod(*one, causal=True, state=state)
        assert state.nbytes() == sizes[-1]


@pytest.mark.parametrize("layer", ["window-sinks-gate", "conv-gate"])
def test_causal(layer):
    """The output at position t does not move when any input after t changes."""
    mod = _layer(LAYERS[layer])
    q, k, v = qkv(1, 4, 2, 40, 40, 8, seed=4)
    base = mod(q, k, v, causal=True)
    for t in (0, 17, 39):
        q2, k2, v2 = q.clone(), k.clone(), v.clone()
        for x in (q2, k2, v2):
            x[:, :, t + 1 :] += torch.randn_like(x[:, :, t + 1 :])
        out = mod(q2, k2, v2, causal=True)
        torch.testing.assert_close(out[:, :, : t + 1], base[:, :, : t + 1], rtol=0, atol=0)


@pytest.mark.parametrize("layer", list(LAYERS))
def test_left_padding_changes_no_real_row(layer):
    mod = _layer(LAYERS[layer])
    q, k, v = qkv(1, 4, 2, 30, 30, 8, seed=5)
    alone = mod(q, k, v, causal=True)
    pad = 7
    qp, kp, vp = (torch.cat([torch.randn_like(x[:, :, :pad]), x], dim=2) for x in (q, k, v))  # garbage in the pads
    mask = torch.ones(1, 30 + pad, dtype=torch.bool)
    mask[:, :pad] = False
    torch.testing.assert_close(mod(qp, kp, vp, causal=True, key_padding_mask=mask)[:, :, pad:], alone, rtol=0,
                               atol=1e-12)


def test_layer_gradients_equal_the_reference():
    """Every input's and parameter's gradient equals the naive definition's (autograd through both), float64."""
    mod = _layer(LAYERS["window-learned-scalar-conv"], decay="gate", learned_sinks=0, sinks=1)
    q, k, v = qkv(2, 4, 2, 70, 70, 8, seed=6, grad=True)
    mask = padding_mask(2, 70, "left")
    params = [p for p in mod.parameters()]
    names = ["dq", "dk", "dv"] + [n for n, _ in mod.named_parameters()]
    got = torch.autograd.grad(mod(q, k, v, causal=True, key_padding_mask=mask).square().sum(), [q, k, v, *params])
    want = torch.autograd.grad(reference_delta(mod, q, k, v, causal=True, key_padding_mask=mask).square().sum(),
                               [q, k, v, *params])
    assert len(params) == 7  # write strength (2), gate (2), mix, two convolutions
    for name, a, b in zip(names, got, want):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10, msg=name)


def test_layer_gradcheck():
    mod = _layer(dict(window=2, sinks=1, decay="gate", short_conv=2), heads=2, kv_heads=1, d=3)
    q, k, v = qkv(1, 2, 1, 6, 6, 3, seed=8, grad=True)
    assert torch.autograd.gradcheck(lambda a, b, c: mod(a, b, c, causal=True), (q, k, v))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("layer", ["window-sinks-gate", "conv-gate"])
def test_half_precision_is_finite_and_near_float32(layer, dtype):
    """A half-precision layer over 300 tokens (5 chunks) with q, k, v of size ~30: finite outputs and gradients
    (of a mean loss: fp16 parameter gradients of a sum over 300 tokens of squared outputs near 70 pass 65504, as
    any fp16 parameter's would without loss scaling), within the half inputs' rounding of the float32 layer."""
    mod32 = _layer(LAYERS[layer], dtype=torch.float32)
    mod = _layer(LAYERS[layer], dtype=dtype)
    q, k, v = (30 * x for x in qkv(1, 4, 2, 300, 300, 8, seed=9, dtype=torch.float32))
    qh, kh, vh = (x.to(dtype).requires_grad_() for x in (q, k, v))
    out = mod(qh, kh, vh, causal=True)
    assert out.dtype == dtype and torch.isfinite(out).all()
    grads = torch.autograd.grad(out.float().square().mean(), [qh, kh, vh, *mod.parameters()])
    assert all(torch.isfinite(g).all() for g in grads)
    ref = mod32(*(x.detach().float() for x in (qh, kh, vh)), causal=True)
    assert ((out.float() - ref).norm() / ref.norm()).item() < 2e-2


def test_starts_as_the_window_and_sinks_model():
    """delta_mix_init 0 (the default): the layer is exactly its sliding window + sinks layer (StreamingLLM)."""
    opts = dict(window=6, sinks=2, decay="gate", short_conv=3)
    mod = DeltaAttention(PolyAttnConfig.for_kind("delta", **opts), 4, 8, 2)
    window = SlidingWindowAttention(PolyAttnConfig.for_kind("sliding_window", window=6, sinks=2), 4, 8, 2)
    q, k, v = qkv(2, 4, 2, 50, 50, 8, seed=11, dtype=torch.float32)
    mask = padding_mask(2, 50, "left")
    torch.testing.assert_close(mod(q, k, v, causal=True, key_padding_mask=mask),
                               window(q, k, v, causal=True, key_padding_mask=mask), rtol=0, atol=0)
    with torch.no_grad():
        mod.delta_mix.fill_(0.1)
    assert (mod(q, k, v, causal=True) - window(q, k, v, causal=True)).abs().max() > 1e-3


def test_memory_is_linear_in_the_length():
    """Forward + backward peak in query-sized fp32 units (1 x 4 heads x n x 32) at n = 256 and 1,024: the chunk
    blocks (n x 64 per head) and one state per chunk grow with n; an n x n tensor per kv head would add n / 64 units
    (16 at 1,024). Measured on the 2-core Xeon: 35.06 units at 256, 35.10 at 1,024, 35.11 at 2,048 (window 32, 4 sinks,
    gate, short conv 4)."""
    def units(n: int) -> float:
        mod = DeltaAttention(PolyAttnConfig.for_kind("delta", window=32, sinks=4, decay="gate", short_conv=4), 4, 32,
                             2)
        q, k, v = qkv(1, 4, 2, n, n, 32, seed=12, dtype=torch.float32, grad=True)
        tracker = PeakLive()
        with tracker:
            mod(q, k, v, causal=True).sum().backward()
        return tracker.peak / q.numel() / 4

    small, large = units(256), units(1024)
    assert large <= 1.15 * small, (small, large)


def test_refusals_name_the_problem():
    with pytest.raises(ValueError, match="delta_mix_init=0.5 .* needs window > 0"):
        PolyAttnConfig.for_kind("delta", window=0, sinks=0, delta_mix_init=0.5)
    with pytest.raises(ValueError, match="delta_beta_init"):
        PolyAttnConfig.for_kind("delta", delta_beta_init=1.0)
    with pytest.raises(ValueError, match="does not read local_exact"):
        PolyAttnConfig.for_kind("delta", local_exact=True)
    mod = _layer(LAYERS["delta"], perturb=False)
    q, k, v = qkv(1, 4, 2, 6, 6, 8, seed=0)
    with pytest.raises(ValueError, match="kind='delta' is causal only"):
        mod(q, k, v, causal=False)


def test_backend_dispatch():
    """'torch': the chunked path for a chunk of tokens, the recurrent step for one token; both the same numbers."""
    args = _rule_inputs(n=1)
    torch.testing.assert_close(delta_rule(*args)[0], delta_rule_chunked(*args)[0], rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="delta_backend must be 'torch' or 'fla'"):
        delta_rule(*args, backend="triton")
