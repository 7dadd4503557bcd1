"""Decay in the attention module of every kernel kind (``PolyAttnConfig.decay``): against the naive twin in
ops/reference.py (values and every gradient, the decay's parameters included), causality, padding, grouped-query
attention, cache = no cache, half precision, strong gates, configuration and labels."""

from __future__ import annotations

import math

import pytest
import torch

from hf_polyattn import PolyAttnConfig
from hf_polyattn.ops import PolyAttention, reference_attention
from hf_polyattn.ops.backend import ENV_VAR

from .test_attention import _padding_mask
from .test_window import CHUNKS, recurrent_outputs

D = 8
DECAYS = ("scalar", "gate")
# every kernel kind (and linear's feature maps) with a window; the block-diagonal local part, no local part and the
# per-token cumsum path on a few. decay_horizon 4: gates far from 1 at these lengths, so the decay matters
KINDS = [
    ("polysketch-w5", dict(kind="polysketch", sketch_size=8, window=5)),
    ("polysketch-learned-poly-w6", dict(kind="polysketch", sketch="learned", sketch_size=8, window=6,
                                        local_kernel="polynomial", qk_norm=True)),
    ("linear-elu-w4-mix", dict(kind="linear", window=4, window_mix=True)),
    ("linear-hedgehog-w4", dict(kind="linear", feature_map="hedgehog", window=4)),
    ("linear-taylor-w4-proj", dict(kind="linear", feature_map="taylor", window=4, feature_proj=12)),
    ("performer-w4", dict(kind="performer", num_features=16, window=4)),
    ("taylor-w3", dict(kind="taylor", window=3)),
    # attention sinks and learned slots beside the window: exact, never decayed (a sink's own gate, its row's first
    # real key's, multiplies no kernel term)
    ("polysketch-w4-sinks", dict(kind="polysketch", sketch_size=8, window=4, sinks=2, learned_sinks=2)),
    ("polysketch-local", dict(kind="polysketch", sketch_size=8, local_exact=True)),
    ("performer-local", dict(kind="performer", num_features=16, local_exact=True)),
    ("linear-relu", dict(kind="linear", feature_map="relu")),
    ("polysketch", dict(kind="polysketch", sketch_size=8)),
    ("taylor-cumsum", dict(kind="taylor", causal_algorithm="cumsum")),
]
CONFIGS = {f"{name}-{decay}": dict(opts, decay=decay) for name, opts in KINDS for decay in DECAYS}
# a bounded memory (decay_max_horizon 2: log-gates at most -1/2, where the gates above drawn from horizon 4 reach
# about -0.05): some gates capped, some not
CONFIGS.update({f"{name}-gate-max2": dict(opts, decay="gate", decay_max_horizon=2.0) for name, opts in KINDS
                if name in ("linear-elu-w4-mix", "linear-hedgehog-w4", "polysketch-w4-sinks", "performer-local")})


def _params(*names):
    return [pytest.param(CONFIGS[name], id=name) for name in (names or CONFIGS)]

# (id, batch, heads, kv_heads, q_len, kv_len, padding)
SHAPES = [
    ("n1", 1, 2, 2, 1, 1, None),
    ("n29-gqa", 2, 4, 2, 29, 29, None),
    ("n23-padleft", 2, 2, 2, 23, 23, "left"),
    ("n23-padright-gqa", 2, 2, 1, 23, 23, "right"),
    ("q5-after-past21", 2, 4, 2, 5, 21, "left"),
]
DECAY_PARAMS = {"scalar": ("decay_theta",), "gate": ("gate_weight", "gate_bias")}


def _module(opts, heads=4, kv_heads=2, horizon=4.0):
    pa = PolyAttention(PolyAttnConfig(block_size=4, decay_horizon=horizon, **opts), heads, D, kv_heads,
                       layer_idx=1).double()
    with torch.no_grad():  # learnable tensors off their initial values (gate weights off 0: gates that vary)
        for p in pa.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return pa


def _qkv(b, h, hkv, lq, lk, seed, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(b, n, length, D, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
            for n, length in ((h, lq), (hkv, lk), (hkv, lk))]


@pytest.mark.parametrize("shape", SHAPES, ids=[s[0] for s in SHAPES])
@pytest.mark.parametrize("opts", _params())
def test_matches_reference(opts, shape):
    _, b, h, hkv, lq, lk, pad = shape
    pa = _module(opts, h, hkv)
    q, k, v = _qkv(b, h, hkv, lq, lk, seed=lq * 7 + lk)
    mask = _padding_mask(b, lk, pad)
    out = pa(q, k, v, causal=True, key_padding_mask=mask)
    ref = reference_attention(pa, q, k, v, causal=True, key_padding_mask=mask)
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-9)
    names = [n for n, _ in pa.named_parameters()]
    params = [p for _, p in pa.named_parameters()]
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v, *params), g, allow_unused=True)
    want = torch.autograd.grad(ref, (q, k, v, *params), g, allow_unused=True)
    for name, x, y in zip(("q", "k", "v", *names), got, want):
        if x is None or y is None:  # unused (no key beyond a window of n = 1): the other must be zero too
            assert (x is None or not x.abs().any()) and (y is None or not y.abs().any()), name
        else:
            torch.testing.assert_close(x, y, rtol=1e-8, atol=1e-9, msg=lambda m, nm=name: f"d{nm}: {m}")
    if lk > 8:  # keys beyond the window: the decay's parameters move the output
        for name in DECAY_PARAMS[opts["decay"]]:
            assert got[3 + names.index(name)].abs().sum() > 1e-6, name


def test_decay_changes_only_the_kernel_part():
    """Gates near 0 leave exactly the window (the kind 'sliding_window'); gates 1 (log gamma -> 0) give the
    undecayed hybrid: the decay scales the kernel part and nothing else."""
    q, k, v = (x.detach() for x in _qkv(2, 4, 2, 30, 30, seed=1))
    for opts in (dict(kind="linear", window=4), dict(kind="polysketch", sketch_size=8, window=5)):
        decayed = PolyAttention(PolyAttnConfig(block_size=4, decay="scalar", **opts), 4, D, 2).double()
        plain = PolyAttention(PolyAttnConfig(block_size=4, **opts), 4, D, 2).double()
        plain.load_state_dict(decayed.state_dict(), strict=False)
        alone = PolyAttention(PolyAttnConfig(kind="sliding_window", window=opts["window"]), 4, D, 2).double()
        with torch.no_grad():
            decayed.decay_theta.fill_(math.log(800.0))  # log gamma = -800: nothing of the kernel part is left
            torch.testing.assert_close(decayed(q, k, v, causal=True), alone(q, k, v, causal=True), rtol=1e-12,
                                       atol=1e-12)
            decayed.decay_theta.fill_(-60.0)  # log gamma = -exp(-60): 1e-26 per token
            torch.testing.assert_close(decayed(q, k, v, causal=True), plain(q, k, v, causal=True), rtol=1e-12,
                                       atol=1e-12)


@pytest.mark.parametrize("opts", _params("polysketch-w5-scalar", "linear-elu-w4-mix-gate", "polysketch-local-scalar",
                                         "linear-relu-gate", "taylor-cumsum-gate", "polysketch-w4-sinks-gate"))
def test_causal_and_cache(opts):
    pa = _module(opts)
    q, k, v = (x.detach() for x in _qkv(2, 4, 2, 26, 26, seed=3))
    full = pa(q, k, v, causal=True)
    # causality: future keys and values (the gates read the values) do not change earlier outputs
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 15:] += 3.0
    v2[:, :, 15:] -= 2.0
    assert torch.equal(pa(q, k2, v2, causal=True)[:, :, :15], full[:, :, :15])
    # cache = no cache: chunks shorter and longer than the window and the blocks, then token by token
    torch.testing.assert_close(recurrent_outputs(pa, q, k, v, CHUNKS), full, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("opts", _params("polysketch-w5-scalar", "polysketch-learned-poly-w6-gate",
                                         "performer-local-gate", "polysketch-scalar", "polysketch-w4-sinks-scalar"))
def test_left_padding_changes_no_row(opts):
    """Padded keys have gate 1 and no value: a left-padded row equals the row alone, in one call and cached."""
    pa = _module(opts, 2, 2)
    q, k, v = (x.detach() for x in _qkv(1, 2, 2, 13, 13, seed=4))
    alone = pa(q, k, v, causal=True)
    pad = 4  # a multiple of block_size: local_exact's blocks stay where they were
    qp, kp, vp = (torch.cat([torch.randn(1, 2, pad, D, dtype=torch.float64), t], dim=2) for t in (q, k, v))
    mask = torch.ones(1, 13 + pad, dtype=torch.bool)
    mask[:, :pad] = False
    torch.testing.assert_close(pa(qp, kp, vp, causal=True, key_padding_mask=mask)[:, :, pad:], alone, rtol=1e-10,
                               atol=1e-10)
    chunks = ((0, 6), *((i, i + 1) for i in range(6, 13 + pad)))
    torch.testing.assert_close(recurrent_outputs(pa, qp, kp, vp, chunks, mask)[:, :, pad:], alone, rtol=1e-10,
                               atol=1e-10)


@pytest.mark.parametrize("decay", DECAYS)
def test_softmax_heads_hybrid(decay):
    """The kernel heads of a softmax_heads hybrid decay (their parameters per kernel kv head), the softmax heads do
    not: against ops.hybrid.hybrid_reference and cached."""
    from hf_polyattn.ops.hybrid import build_attention, hybrid_reference

    cfg = PolyAttnConfig(kind="linear", window=4, block_size=4, decay=decay, decay_horizon=4.0,
                         softmax_heads=((1, 0),))
    hy = build_attention(cfg, 4, D, 2, layer_idx=1).double()
    assert all(n.startswith("kernel.") and p.shape[0] == 1 for n, p in hy.named_parameters())  # 1 kernel kv head
    with torch.no_grad():
        for p in hy.parameters():
            p.add_(0.3 * torch.randn_like(p))
    q, k, v = (x.detach() for x in _qkv(2, 4, 2, 26, 26, seed=9))
    mask = _padding_mask(2, 26, "left")
    out = hy(q, k, v, causal=True, key_padding_mask=mask)
    torch.testing.assert_close(out, hybrid_reference(hy, q, k, v, causal=True, key_padding_mask=mask), rtol=1e-9,
                               atol=1e-9)
    torch.testing.assert_close(recurrent_outputs(hy, q, k, v, CHUNKS, mask), out, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("opts", [
    pytest.param(dict(kind="linear", window=4, decay="gate"), id="linear-w4-gate"),
    pytest.param(dict(kind="linear", decay="scalar"), id="linear-elu-scalar"),  # elu + 1 applied by the kernels
    pytest.param(dict(kind="polysketch", sketch_size=8, local_exact=True, decay="gate"), id="polysketch-local-gate"),
])
def test_triton_backend_matches_reference(monkeypatch, opts):
    """The module on the Triton kernels (interpreter without a GPU), fp32, against the float64 reference."""
    pytest.importorskip("triton")
    from tests.ops.triton_setup import DEVICE

    monkeypatch.setenv(ENV_VAR, "triton")
    pa = _module(opts, 4, 2)
    q, k, v = _qkv(2, 4, 2, 37, 37, seed=5)
    mask = _padding_mask(2, 37, "left")
    dev = [x.detach().to(DEVICE, torch.float32).requires_grad_() for x in (q, k, v)]
    out = pa.float().to(DEVICE)(*dev, causal=True, key_padding_mask=None if mask is None else mask.to(DEVICE))
    pa = pa.double().cpu()
    ref = reference_attention(pa, q, k, v, causal=True, key_padding_mask=mask)
    torch.testing.assert_close(out.cpu().double(), ref, rtol=1e-4, atol=1e-4)
    g = torch.randn_like(ref)
    got = torch.autograd.grad(out, dev, g.to(DEVICE, torch.float32))
    want = torch.autograd.grad(ref, (q, k, v), g)
    for name, x, y in zip("qkv", got, want):
        torch.testing.assert_close(x.cpu().double(), y, rtol=1e-4, atol=1e-4, msg=lambda m, nm=name: f"d{nm}: {m}")


@pytest.mark.parametrize("max_horizon", [0.0, 2.0], ids=["free", "max2"])
@pytest.mark.parametrize("backend", ["loop", "triton"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_precision_is_finite(monkeypatch, backend, dtype, max_horizon):
    """bf16 / fp16 models: outputs and gradients finite, near the float64 result (the math runs in fp32); also with
    the gates capped (decay_max_horizon 2: every gate at most e^-1/2 a token, where they start near 1)."""
    if backend == "triton":
        pytest.importorskip("triton")
        from tests.ops.triton_setup import DEVICE
    else:
        DEVICE = "cpu"
    opts = dict(kind="polysketch", sketch_size=8, window=5, decay="gate", decay_max_horizon=max_horizon)
    pa = _module(opts, 4, 2)
    q, k, v = (x.detach() for x in _qkv(2, 4, 2, 40, 40, seed=6))
    ref = pa(q, k, v, causal=True)  # float64, on the CPU's backend
    monkeypatch.setenv(ENV_VAR, backend)
    half = [x.to(DEVICE, dtype).requires_grad_() for x in (q, k, v)]
    out = pa.to(DEVICE, dtype)(*half, causal=True)
    assert out.dtype == dtype and torch.isfinite(out).all()
    torch.testing.assert_close(out.cpu().double(), ref, rtol=0.05, atol=0.05)
    out.float().square().sum().backward()
    for x in (*half, *pa.parameters()):
        assert x.grad is not None and torch.isfinite(x.grad).all()


@pytest.mark.parametrize("decay", DECAYS)
def test_long_sequence_with_strong_gates(decay):
    """4096 tokens with gates of about e^-30 a token (G reaches -1.2e5): finite values and gradients, the far part
    gone (only the window's keys count), and the float32 model agrees with the float64 one."""
    pa = PolyAttention(PolyAttnConfig(kind="linear", window=16, decay=decay, block_size=256), 2, D, 1).double()
    with torch.no_grad():
        if decay == "scalar":
            pa.decay_theta.fill_(math.log(30.0))
        else:
            pa.gate_bias.fill_(-30.0)
            pa.gate_weight.normal_()  # the gates vary with the token around e^-30
    q, k, v = _qkv(1, 2, 1, 4096, 4096, seed=7, dtype=torch.float32)
    out = pa.float()(q, k, v, causal=True)
    out.sum().backward()
    assert all(torch.isfinite(x).all() for x in (out, q.grad, k.grad, v.grad, *(p.grad for p in pa.parameters())))
    alone = PolyAttention(PolyAttnConfig(kind="sliding_window", window=16), 2, D, 1)
    with torch.no_grad():
        torch.testing.assert_close(out, alone(q, k, v, causal=True), rtol=1e-5, atol=1e-5)
        want = pa.double()(q.double(), k.double(), v.double(), causal=True)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)


def test_parameters_initialise_to_the_horizon():
    for decay, names in DECAY_PARAMS.items():
        pa = PolyAttention(PolyAttnConfig(kind="linear", window=4, decay=decay, decay_horizon=256.0), 4, D, 2)
        assert sorted(n for n, _ in pa.named_parameters()) == sorted(names)
        assert all(p.shape[0] == 2 for p in pa.parameters())  # per kv head: its query heads share one state
        v5 = torch.randn(3, 2, 1, 5, D)
        gates = pa.log_gates(v5, None)
        want = -1.0 / 256.0 if decay == "scalar" else math.log(1.0 - 1.0 / 256.0)
        torch.testing.assert_close(gates, torch.full((3, 2, 1, 5), want))
        mask = torch.ones(3, 5, dtype=torch.bool)
        mask[1, :2] = False
        assert not pa.log_gates(v5, mask)[1, :, :, :2].any()  # padded keys: gate 1
        before = {n: p.detach().clone() for n, p in pa.named_parameters()}
        with torch.no_grad():
            for p in pa.parameters():
                p.add_(1.0)
        pa.reset_parameters()
        for n, p in pa.named_parameters():
            assert torch.equal(p, before[n]), n


def test_bidirectional_calls_are_refused():
    pa = _module(dict(kind="linear", window=4, decay="scalar"), 2, 2)
    q, k, v = _qkv(1, 2, 2, 9, 9, seed=8)
    with pytest.raises(ValueError, match="decay='scalar' is defined for causal attention only"):
        pa(q, k, v, causal=False)
    with pytest.raises(ValueError, match="causal attention only"):
        reference_attention(pa, q, k, v, causal=False)


@pytest.mark.parametrize("kwargs,match", [
    (dict(kind="linear", decay="exp"), r"decay must be one of \['none', 'scalar', 'gate'\], got 'exp'"),
    (dict(kind="linear", decay="gate", decay_horizon=1.0), "decay_horizon must be a real number > 1"),
    (dict(kind="linear", decay="scalar", decay_horizon=float("inf")), "decay_horizon must be a finite real number"),
    (dict(kind="linear", decay="scalar", decay_horizon="1024"), "decay_horizon must be a finite real number"),
    (dict(kind="linear", decay_horizon=64.0), "decay_horizon=64.0 needs decay='scalar' or 'gate'"),
    (dict(kind="sliding_window", window=4, decay="scalar"), "kind='sliding_window' does not read decay"),
    (dict(kind="polynomial", decay="gate"), "kind='polynomial' does not read decay"),
    (dict(kind="linear", decay="gate", decay_max_horizon=1.0), r"decay_max_horizon must be 0 \(no bound\) or a real"),
    (dict(kind="linear", decay="gate", decay_max_horizon=-5.0), "decay_max_horizon must be 0"),
    (dict(kind="linear", decay_max_horizon=256.0), "decay_max_horizon=256.0 needs decay='scalar' or 'gate'"),
    (dict(kind="polynomial", decay_max_horizon=256.0), "kind='polynomial' does not read decay_max_horizon"),
])
def test_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PolyAttnConfig(**kwargs)


def test_labels_and_round_trip():
    scalar = PolyAttnConfig(kind="polysketch", window=64, decay="scalar")
    gate = PolyAttnConfig(kind="performer", window=64, decay="gate", decay_horizon=300.0)
    assert "scalar decay (horizon 1024)" in scalar.spec.table_label(scalar)
    assert "gated decay" in gate.spec.table_label(gate)
    plain = PolyAttnConfig(kind="linear", window=64)
    assert "decay" not in plain.spec.table_label(plain)
    for cfg in (scalar, gate, PolyAttnConfig(kind="taylor", decay="scalar", decay_horizon=16.5)):
        assert PolyAttnConfig.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize("decay", DECAYS)
def test_max_horizon_caps_every_gate(decay):
    """``decay_max_horizon`` h: each log-gate is min(its own, -1/h) (a gate at most 1 - ~1/h), padded keys 0; the
    uncapped ones are unchanged, and the module's label states the bound."""
    capped = _module(dict(kind="linear", window=4, decay=decay, decay_max_horizon=3.0))
    free = _module(dict(kind="linear", window=4, decay=decay))
    free.load_state_dict(capped.state_dict())
    if decay == "scalar":  # log gamma = -exp(theta): -0.1 for one head (above the cap), -1 for the other
        with torch.no_grad():
            capped.decay_theta.copy_(torch.tensor([0.1, 1.0], dtype=torch.float64).log())
        free.load_state_dict(capped.state_dict())
    _, _, v = _qkv(2, 4, 2, 11, 11, seed=3)
    mask = _padding_mask(2, 11, "left")
    got, want = capped.log_gates(v.detach().unsqueeze(2), mask), free.log_gates(v.detach().unsqueeze(2), mask)
    real = mask[:, None, None, :].expand_as(got)
    torch.testing.assert_close(got[real], want[real].clamp(max=-1 / 3.0), rtol=0, atol=0)
    assert not got[~real].any()
    assert bool((want[real] > -1 / 3.0).any()) and bool((want[real] < -1 / 3.0).any()), "the cap must bite on some"
    assert "memory at most 3 tokens" in capped.config.spec.table_label(capped.config)
