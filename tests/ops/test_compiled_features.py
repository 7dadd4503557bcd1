"""The compiled feature side (``PolyAttention._compiled_side``, ``feature_maps.compiled_activation_features``): the
long-context default's projection, q/k LayerNorm and elu + 1 in one torch.compile graph on CUDA. Run here on the CPU
by adding "cpu" to the devices that get it (Inductor compiles for the CPU too): the same outputs and gradients as
the eager chunked recomputation, causal, taken only for elementwise maps."""

from __future__ import annotations

import pytest
import torch

import hf_polyattn.ops.attention as attention_mod
import hf_polyattn.ops.feature_maps as fm_mod
from hf_polyattn import PolyAttnConfig
from hf_polyattn.bench import kind_rows
from hf_polyattn.ops import PolyAttention
from hf_polyattn.ops.feature_maps import activation_features

# the long-context default as the benchmark builds it, with the retrofit's projection to head_dim
DEFAULT = {**kind_rows()["linear-elu-window128-gate"], "feature_proj": 64}


@pytest.fixture
def compiled_on_cpu(monkeypatch):
    """Hands out the compiled function on the CPU too and counts its calls."""
    calls = []
    monkeypatch.setattr(fm_mod, "COMPILED_FEATURE_DEVICES", ("cuda", "cpu"))
    real = fm_mod.compiled_activation_features

    def counting(device):
        fn = real(device)
        if fn is None:
            return None

        def call(*args):
            calls.append(args[1])  # the activation applied (None: the kernel input)
            return fn(*args)
        return call

    monkeypatch.setattr(attention_mod, "compiled_activation_features", counting)
    return calls


def _layer(dtype, **overrides):
    torch.manual_seed(0)
    pa = PolyAttention(PolyAttnConfig(**{**DEFAULT, **overrides}), 4, 64)
    with torch.no_grad():  # trained-looking parameters: every one reaches the output through its own path
        for p in pa.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return pa.to(dtype)


def _run(pa, q, k, v):
    pa.zero_grad()
    for t in (q, k, v):
        t.grad = None
    out = pa(q, k, v, causal=True)
    out.float().pow(2).sum().backward()
    return (out.detach().float(), [t.grad.float() for t in (q, k, v)],
            {n: p.grad.float() for n, p in pa.named_parameters() if p.grad is not None})


def _inputs(dtype, n=300):
    torch.manual_seed(1)
    return [torch.randn(1, 4, n, 64, dtype=dtype, requires_grad=True) for _ in range(3)]


def _close(a, b, rtol):
    scale = b.abs().max().clamp_min(1e-6)
    assert (a - b).abs().max() <= rtol * scale, ((a - b).abs().max().item(), scale.item())


@pytest.mark.slow(seconds=30)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_compiled_side_matches_eager(compiled_on_cpu, monkeypatch, dtype):
    pa = _layer(dtype)
    q, k, v = _inputs(dtype)
    monkeypatch.setattr(attention_mod, "COMPILED_FEATURES", False)
    o0, g0, p0 = _run(pa, q, k, v)
    assert compiled_on_cpu == []
    monkeypatch.setattr(attention_mod, "COMPILED_FEATURES", True)
    o1, g1, p1 = _run(pa, q, k, v)
    assert compiled_on_cpu == ["elu", "elu"]  # both sides, the map applied in the graph (the window reads features)
    assert torch.isfinite(o1).all() and all(torch.isfinite(g).all() for g in g1)
    # fp32: the same operations in another order (Inductor's fused LayerNorm); bf16: the eager path's upcasts and
    # the graph's are the same, its roundings of the bf16 parameters' gradients differ by an ulp
    rtol = 1e-5 if dtype == torch.float32 else 2e-2
    _close(o1, o0, rtol)
    for a, b in zip(g1, g0):
        _close(a, b, rtol)
    assert set(p1) == set(p0) and {"feature_proj.weight", "q_norm.weight", "k_norm.bias"} <= set(p1)
    for name in p0:
        _close(p1[name], p0[name], rtol if dtype == torch.float32 else 5e-2)


@pytest.mark.slow(seconds=15)
def test_compiled_side_is_causal(compiled_on_cpu):
    pa = _layer(torch.float32)
    q, k, v = (t.detach() for t in _inputs(torch.float32, n=260))
    q2, k2, v2 = (t.clone() for t in (q, k, v))
    for t in (q2, k2, v2):
        t[..., 200:, :] += 3.0  # the future of rows < 200
    outs = []
    for x in ((q, k, v), (q2, k2, v2)):  # a training forward: parameters that need gradients
        outs.append(pa(*x, causal=True).detach())
    assert compiled_on_cpu == ["elu", "elu", "elu", "elu"]
    assert torch.equal(outs[0][..., :200, :], outs[1][..., :200, :])
    assert not torch.allclose(outs[0][..., 200:, :], outs[1][..., 200:, :])


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA: the device the compiled side is handed out on")


@pytest.mark.slow(seconds=30)
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_layers_with_other_head_layouts_share_the_limit(compiled_on_cpu, device):
    """A hybrid model's layers keep different numbers of kernel heads, each side its own layout: a prefill of a
    retrofitted SmolLM2 on an H100 had gone past torch.compile's 8 recompilations and failed. Layers of four layouts
    and two lengths train through the compiled side, each matching its eager side."""
    for kv_heads, groups in ((2, 3), (1, 3), (3, 1), (1, 1)):
        torch.manual_seed(kv_heads * 10 + groups)
        pa = PolyAttention(PolyAttnConfig(**DEFAULT), kv_heads * groups, 64, num_kv_heads=kv_heads).to(device)
        for n in (200, 330):
            q = torch.randn(1, kv_heads * groups, n, 64, device=device, requires_grad=True)
            k, v = (torch.randn(1, kv_heads, n, 64, device=device, requires_grad=True) for _ in range(2))
            before = len(compiled_on_cpu)
            got = _run(pa, q, k, v)
            assert len(compiled_on_cpu) == before + 2
            attention_mod.COMPILED_FEATURES = False
            try:
                want = _run(pa, q, k, v)
            finally:
                attention_mod.COMPILED_FEATURES = True
            rtol = 1e-5 if device == "cpu" else 1e-4  # as test_compiled_side_on_cuda: fp32 kernels may differ there
            _close(got[0], want[0], rtol)
            for a, b in zip(got[1], want[1]):
                _close(a, b, rtol)


def test_past_the_recompile_limit_runs_eagerly(compiled_on_cpu, monkeypatch):
    """With torch.compile's limit at 1 (and the module's raise off), layers of new layouts run the function eagerly,
    with the eager side's numbers, instead of failing as a ``fullgraph`` compile does there."""
    import torch._dynamo.config as dynamo_config

    monkeypatch.setattr(fm_mod, "RECOMPILE_LIMIT", 1)
    with dynamo_config.patch(recompile_limit=1):  # the config module's own patch (monkeypatch's undo deletes it)
        _layouts_past_the_limit(monkeypatch)
    assert len(compiled_on_cpu) == 4


def _layouts_past_the_limit(monkeypatch):
    # float64: a dtype no other test compiles for, so these calls need graphs of their own whatever ran before
    for kv_heads, groups in ((2, 2), (1, 4)):
        pa = PolyAttention(PolyAttnConfig(**DEFAULT), kv_heads * groups, 64, num_kv_heads=kv_heads).double()
        q = torch.randn(1, kv_heads * groups, 150, 64, dtype=torch.float64, requires_grad=True)
        k, v = (torch.randn(1, kv_heads, 150, 64, dtype=torch.float64, requires_grad=True) for _ in range(2))
        got = _run(pa, q, k, v)
        monkeypatch.setattr(attention_mod, "COMPILED_FEATURES", False)
        want = _run(pa, q, k, v)
        monkeypatch.setattr(attention_mod, "COMPILED_FEATURES", True)
        _close(got[0], want[0], 1e-5)
        for a, b in zip(got[1], want[1]):
            _close(a, b, 1e-5)


def test_calls_raise_the_recompile_limit(monkeypatch):
    """Each call runs under torch.compile's limit raised to RECOMPILE_LIMIT (every layer's graphs count against one
    limit), and passes the parameters as views (plain tensors: no static shapes held for parameters)."""
    import torch._dynamo.config as dynamo_config

    seen = {}

    def fake(x, activation, proj, weight, bias, eps):
        seen.update(limit=dynamo_config.recompile_limit, param=isinstance(weight, torch.nn.Parameter))
        return x

    w = torch.nn.Parameter(torch.ones(2, 1, 1, 4))
    fm_mod._call_compiled(fake, torch.zeros(1, 2, 1, 3, 4), "elu", None, w, w, 1e-5)
    assert seen == {"limit": max(fm_mod.RECOMPILE_LIMIT, 8), "param": False} and fm_mod.RECOMPILE_LIMIT >= 32
    assert dynamo_config.recompile_limit == 8  # restored after the call


def test_inference_keeps_the_eager_side(compiled_on_cpu):
    pa = _layer(torch.float32)
    q, k, v = _inputs(torch.float32, n=64)
    with torch.no_grad():
        pa(q, k, v, causal=True)
    assert compiled_on_cpu == []


def test_activation_features_is_kernel_input_then_map():
    pa = _layer(torch.float32)
    x = torch.randn(1, 4, 50, 64)
    for is_query, norm in ((True, pa.q_norm), (False, pa.k_norm)):
        want = pa.feature_map(pa.kernel_input(x, is_query), is_query)
        got = activation_features(x, "elu", pa.feature_proj.weight, norm.weight, norm.bias, norm.eps)
        assert torch.equal(got, want)
    assert torch.equal(activation_features(x, None), x)


def test_not_taken_off_cuda_or_for_other_maps(compiled_on_cpu, monkeypatch):
    monkeypatch.setattr(fm_mod, "COMPILED_FEATURE_DEVICES", ("cuda",))
    assert fm_mod.compiled_activation_features(torch.device("cpu")) is None
    pa = _layer(torch.float32)
    q, k, v = _inputs(torch.float32, n=64)
    pa(q, k, v, causal=True)
    assert compiled_on_cpu == []
    # a map that is not elementwise keeps its eager side wherever the compiled function is handed out
    monkeypatch.setattr(fm_mod, "COMPILED_FEATURE_DEVICES", ("cuda", "cpu"))
    hedgehog = _layer(torch.float32, feature_map="hedgehog")
    assert hedgehog._compiled_side(q, True, True, None) is None
    hedgehog(q, k, v, causal=True)
    assert compiled_on_cpu == []


@CUDA
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_compiled_side_on_cuda(monkeypatch, dtype):
    """On CUDA as it ships (no patching): the compiled side is taken, with the eager side's outputs and gradients."""
    calls = []
    real = fm_mod.compiled_activation_features
    monkeypatch.setattr(attention_mod, "compiled_activation_features",
                        lambda device: calls.append(device.type) or real(device))
    pa = _layer(dtype).cuda()
    q, k, v = (t.detach().cuda().requires_grad_() for t in _inputs(dtype, n=1000))
    monkeypatch.setattr(attention_mod, "COMPILED_FEATURES", False)
    o0, g0, p0 = _run(pa, q, k, v)
    monkeypatch.setattr(attention_mod, "COMPILED_FEATURES", True)
    o1, g1, p1 = _run(pa, q, k, v)
    assert calls == ["cuda", "cuda"]
    rtol = 1e-4 if dtype == torch.float32 else 2e-2  # fp32 on CUDA: the projection's matmul may take tf32 either way
    assert torch.isfinite(o1).all()
    _close(o1, o0, rtol)
    for a, b in zip(g1, g0):
        _close(a, b, rtol)
    for name in p0:
        _close(p1[name], p0[name], rtol if dtype == torch.float32 else 5e-2)
