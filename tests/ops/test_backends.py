"""The causal product's implementations (loop, batched, and their dispatch), the chunked exact
tensor path, and the device contract of the seeded initialisation."""

from __future__ import annotations

import pytest
import torch

import hf_polyattn.ops.backend as backend_mod
import hf_polyattn.ops.exact as attention_mod
from hf_polyattn import PolyAttnConfig
from hf_polyattn.ops import PolyAttention, reference_attention
from hf_polyattn.ops.backend import ENV_VAR, lt_product, product_backend, resolve_backend
from hf_polyattn.ops.causal import lt_multiply, lt_multiply_batched


def _dense(a, b, c, block, include_diag, square):
    s = a @ b.transpose(-1, -2)
    if square:
        s = s * s
    n = a.shape[-2]
    i = torch.arange(n)
    keep = i[None, :] <= i[:, None]
    if not include_diag:
        keep = keep & ((i[None, :] // block) != (i[:, None] // block))
    return torch.where(keep, s, torch.zeros_like(s)) @ c


@pytest.mark.parametrize("square", [False, True], ids=["identity", "square"])
@pytest.mark.parametrize("include_diag", [True, False], ids=["diag", "nodiag"])
@pytest.mark.parametrize("n,block", [(1, 4), (7, 8), (37, 8), (64, 16)], ids=lambda v: str(v))
def test_batched_equals_loop_and_dense(n, block, include_diag, square):
    gen = torch.Generator().manual_seed(n)
    a = torch.randn(2, 3, 2, n, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    b = torch.randn(2, 3, 1, n, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    c = torch.randn(2, 3, 1, n, 7, generator=gen, dtype=torch.float64, requires_grad=True)
    ref = _dense(a, b, c, block, include_diag, square)
    g = torch.randn_like(ref)
    want = torch.autograd.grad(ref, (a, b, c), g)
    for fn in (lt_multiply, lt_multiply_batched):
        out = fn(a, b, c, block, include_diag, square)
        torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
        for name, got, exp in zip("abc", torch.autograd.grad(out, (a, b, c), g), want):
            torch.testing.assert_close(got, exp, rtol=1e-10, atol=1e-10, msg=f"{fn.__name__} d{name}")


def test_batched_is_causal():
    gen = torch.Generator().manual_seed(0)
    a, b, c = (torch.randn(1, 1, 1, 40, 4, generator=gen) for _ in range(3))
    out = lt_multiply_batched(a, b, c, 8, True, True)
    b2, c2 = b.clone(), c.clone()
    b2[..., 20:, :] += 5.0
    c2[..., 20:, :] -= 3.0
    out2 = lt_multiply_batched(a, b2, c2, 8, True, True)
    assert torch.equal(out[..., :20, :], out2[..., :20, :])
    assert not torch.allclose(out[..., 20:, :], out2[..., 20:, :])


def test_resolve_backend_by_device(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert resolve_backend("auto", torch.device("cpu")) == "loop"
    monkeypatch.setattr(backend_mod, "triton_available", lambda: False)
    assert resolve_backend("auto", torch.device("cuda")) == "batched"
    assert resolve_backend("auto", torch.device("mps")) == "batched"
    monkeypatch.setattr(backend_mod, "triton_available", lambda: True)
    assert resolve_backend("auto", torch.device("cuda")) == "triton"
    assert resolve_backend("auto", torch.device("cuda"), torch.float64) == "batched"  # Triton is float32
    assert resolve_backend("auto", torch.device("cpu")) == "loop"
    assert resolve_backend("batched", torch.device("cpu")) == "batched"
    assert resolve_backend("loop", torch.device("cuda")) == "loop"


def test_auto_takes_batched_for_a_decayed_product_on_cpu(monkeypatch):
    # the loop's per-block decay factors made it ~2x slower on the CPU (benchmark_backends --set decay)
    monkeypatch.delenv(ENV_VAR, raising=False)
    cpu = torch.device("cpu")
    assert product_backend("auto", cpu, torch.float32, 64) == "loop"
    assert product_backend("auto", cpu, torch.float32, 64, decay=True) == "batched"
    assert product_backend("loop", cpu, torch.float32, 64, decay=True) == "loop"  # an explicit choice wins
    monkeypatch.setenv(ENV_VAR, "loop")
    assert product_backend("auto", cpu, torch.float32, 64, decay=True) == "loop"  # and so does the variable
    monkeypatch.delenv(ENV_VAR)
    # the choice is the product's route: the same result as the loop's
    gen = torch.Generator().manual_seed(0)
    a, b, c = (torch.randn(2, 100, 8, generator=gen) for _ in range(3))
    logs = -torch.rand(2, 100, generator=gen).cumsum(-1) * 0.05
    seen, batched = [], backend_mod.lt_multiply_batched
    monkeypatch.setattr(backend_mod, "lt_multiply_batched", lambda *args: seen.append("batched") or batched(*args))
    out = lt_product(a, b, c, 16, True, False, decay=(logs, logs))
    assert seen == ["batched"]
    monkeypatch.setenv(ENV_VAR, "loop")
    torch.testing.assert_close(out, lt_product(a, b, c, 16, True, False, decay=(logs, logs)))
    assert seen == ["batched"]


def test_resolve_backend_env_and_errors(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "batched")
    assert resolve_backend("auto", torch.device("cpu")) == "batched"
    assert resolve_backend("loop", torch.device("cpu")) == "loop"  # an explicit config wins over the env
    monkeypatch.setenv(ENV_VAR, "fast")
    with pytest.raises(ValueError, match=ENV_VAR):
        resolve_backend("auto", torch.device("cpu"))
    monkeypatch.delenv(ENV_VAR)
    with pytest.raises(ValueError, match="backend must be one of"):
        resolve_backend("cuda", torch.device("cpu"))
    monkeypatch.setattr(backend_mod, "triton_available", lambda: False)
    with pytest.raises(ValueError, match=r"hf_polyattn\[gpu\]"):
        resolve_backend("triton", torch.device("cuda"))
    monkeypatch.setattr(backend_mod, "triton_available", lambda: True)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        resolve_backend("triton", torch.device("cpu"))
    with pytest.raises(ValueError, match="float64"):
        resolve_backend("triton", torch.device("cuda"), torch.float64)


def test_lt_product_dispatches(monkeypatch):
    calls = []
    monkeypatch.setattr(backend_mod, "lt_multiply", lambda *a: calls.append("loop") or lt_multiply(*a))
    monkeypatch.setattr(backend_mod, "lt_multiply_batched",
                        lambda *a: calls.append("batched") or lt_multiply_batched(*a))
    monkeypatch.delenv(ENV_VAR, raising=False)
    x = torch.randn(1, 1, 9, 3)
    lt_product(x, x, x, 4, True, False)
    lt_product(x, x, x, 4, True, False, "batched")
    monkeypatch.setenv(ENV_VAR, "batched")
    lt_product(x, x, x, 4, True, False)
    assert calls == ["loop", "batched", "batched"]


LINEAR_TIME = [
    dict(kind="polysketch", sketch="srht", sketch_size=8),
    dict(kind="polysketch", sketch="learned", sketch_size=8, local_exact=True),
    dict(kind="linear", feature_map="elu", local_exact=True),
    dict(kind="performer", num_features=16),
    dict(kind="polynomial", degree=2, exact_path="tensor"),
]


@pytest.mark.parametrize("opts", LINEAR_TIME, ids=lambda o: "-".join(str(v) for v in o.values()))
def test_module_backends_agree(monkeypatch, opts):
    """A whole attention layer gives the same outputs and gradients with the loop and the batched product."""
    cfg = PolyAttnConfig(block_size=8, **opts)
    pa = PolyAttention(cfg, 4, 8, 2, layer_idx=1).double()
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, 29, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 2, 29, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 2, 29, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    mask = torch.ones(2, 29, dtype=torch.bool)
    mask[1, 22:] = False
    results = []
    for which in ("loop", "batched"):
        monkeypatch.setenv(ENV_VAR, which)
        out = pa(q, k, v, causal=True, key_padding_mask=mask)
        results.append((out, torch.autograd.grad(out.sum(), (q, k, v))))
    ref = reference_attention(pa, q, k, v, causal=True, key_padding_mask=mask)
    torch.testing.assert_close(results[0][0], ref, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(results[1][0], ref, rtol=1e-9, atol=1e-9)
    for g0, g1 in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(g0, g1, rtol=1e-9, atol=1e-9)


# ------------------------------------------------------------------ exact tensor path, chunked
@pytest.fixture
def small_tensor_chunks(monkeypatch):
    """Chunks of one block (8 keys) for F = C(8+1, 2) = 36 features: many chunks at n = 37."""
    monkeypatch.setattr(attention_mod, "_TENSOR_CHUNK_ELEMENTS", 36 * 8)


def _record_feature_rows(pa, monkeypatch):
    rows = []
    fm = pa.feature_map
    orig = type(fm).forward

    def spy(self, x, is_query):
        rows.append(x.shape[-2])
        return orig(self, x, is_query)

    monkeypatch.setattr(type(fm), "forward", spy)
    return rows


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
def test_tensor_path_chunks_bound_memory_and_match_reference(small_tensor_chunks, monkeypatch, causal):
    cfg = PolyAttnConfig(kind="polynomial", degree=2, exact_path="tensor", block_size=8, qk_norm=True)
    pa = PolyAttention(cfg, 4, 8, 2)
    assert pa.num_features == 36 and pa.tensor_chunk() == 8
    rows = _record_feature_rows(pa, monkeypatch)
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(2, 4, 37, 8, generator=gen, requires_grad=True)
    k = torch.randn(2, 2, 37, 8, generator=gen, requires_grad=True)
    v = torch.randn(2, 2, 37, 8, generator=gen, requires_grad=True)
    mask = torch.ones(2, 37, dtype=torch.bool)
    mask[0, :5] = False
    out = pa(q, k, v, causal=causal, key_padding_mask=mask)
    out.square().sum().backward()
    assert rows and max(rows) <= 8  # never more than one chunk of features at a time, backward included
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    ref = reference_attention(pa, q.double(), k.double(), v.double(), causal=causal, key_padding_mask=mask)
    ref.square().sum().backward()
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-6)
    for g, t in zip(grads, (q, k, v)):
        torch.testing.assert_close(g, t.grad, rtol=1e-4, atol=1e-5)


def test_tensor_path_chunked_prefill_and_decode_equal_full(small_tensor_chunks):
    cfg = PolyAttnConfig(kind="polynomial", degree=2, exact_path="tensor", block_size=8)
    pa = PolyAttention(cfg, 4, 8, 2)
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, h, 30, 8, generator=gen) for h in (4, 2, 2))
    full = pa(q, k, v, causal=True)
    state = pa.init_state()
    outs = []
    for s, t in ((0, 19), (19, 20), (20, 21), (21, 30)):
        o, state = pa(q[:, :, s:t], k[:, :, s:t], v[:, :, s:t], causal=True, state=state)
        outs.append(o)
    assert state.kv.dtype == torch.float64 and state.k is None  # constant-size float64 state
    torch.testing.assert_close(torch.cat(outs, dim=2), full, rtol=1e-6, atol=1e-7)


def test_tensor_path_precision_matches_quadratic():
    """The tensor path's error against a float64 reference is the quadratic path's order (the
    float32 tensor features lost 1.2e-4 where the quadratic path loses 6.5e-7)."""
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 4, 64, 16, generator=gen) * 2 for _ in range(3))
    errs = {}
    for path in ("tensor", "quadratic"):
        pa = PolyAttention(PolyAttnConfig(kind="polynomial", degree=4, exact_path=path), 4, 16)
        ref = reference_attention(pa, q.double(), k.double(), v.double(), causal=True)
        errs[path] = (pa(q, k, v, causal=True).double() - ref).abs().max().item()
    assert errs["tensor"] <= 4 * errs["quadratic"] + 1e-7, errs


# ------------------------------------------------------------------ device contract
BACKEND_CASES = [
    dict(kind="polysketch", sketch="gaussian"),
    dict(kind="polysketch", sketch="srht"),
    dict(kind="polysketch", sketch="learned", qk_norm=True),
    dict(kind="performer", num_features=16),
    dict(kind="polynomial", poly_coefficients=(1.0, -0.5), learn_coefficients=True),
]


@pytest.mark.parametrize("opts", BACKEND_CASES, ids=lambda o: "-".join(str(v) for v in o.values()))
def test_seeded_init_is_device_independent(opts):
    """Built under a meta-device context (as from_pretrained does), then materialised and
    re-initialised: the same tensors as on the CPU. The draws use a CPU generator, which
    used to fail under any non-CPU default device ('Expected a 'cuda' device type for generator')."""
    cfg = PolyAttnConfig(**opts, seed=3)
    cpu = PolyAttention(cfg, 4, 8, 2, layer_idx=2)
    with torch.device("meta"):
        meta = PolyAttention(cfg, 4, 8, 2, layer_idx=2)
    assert all(t.is_meta for t in meta.state_dict().values())
    meta = meta.to_empty(device="cpu")
    meta.reset_parameters()
    for (n1, t1), (n2, t2) in zip(cpu.state_dict().items(), meta.state_dict().items()):
        assert n1 == n2
        assert torch.equal(t1, t2), n1


@pytest.mark.parametrize("opts", BACKEND_CASES, ids=lambda o: "-".join(str(v) for v in o.values()))
def test_reset_under_another_default_device(opts):
    """reset_parameters() of a CPU module while another device is the default (convert() of a
    CUDA model runs inside ``torch.device('cuda')``): the draws stay on the CPU generator's
    device and land in the module's tensors (was: 'Cannot copy out of meta tensor' here, and
    'Expected a 'cuda' device type for generator' on a GPU)."""
    pa = PolyAttention(PolyAttnConfig(**opts), 4, 8, 2)
    want = {k: t.clone() for k, t in pa.state_dict().items()}
    with torch.no_grad():
        for t in pa.state_dict().values():
            t.zero_()
    with torch.device("meta"):
        pa.reset_parameters()
    for name, t in pa.state_dict().items():
        assert torch.equal(t, want[name]), name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("opts", BACKEND_CASES + [dict(kind="linear", local_exact=True)],
                         ids=lambda o: "-".join(str(v) for v in o.values()))
def test_half_precision_module(opts, dtype):
    """Parameters in half precision (a half model) with half inputs: finite, float32 inside, and
    equal to the float32 computation with the same (rounded) parameters."""
    cfg = PolyAttnConfig(**opts, block_size=8)
    half = PolyAttention(cfg, 4, 8, 2).to(dtype)
    full = PolyAttention(cfg, 4, 8, 2)
    full.load_state_dict({k: t.float() for k, t in half.state_dict().items()})
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, h, 40, 8, generator=gen).to(dtype) * 3 for h in (4, 2, 2))
    out = half(q, k, v, causal=True)
    assert out.dtype == dtype and torch.isfinite(out).all()
    want = full(q.float(), k.float(), v.float(), causal=True)
    tol = float(torch.finfo(dtype).eps) * 4 * want.abs().max().item()  # the final rounding to half only
    torch.testing.assert_close(out.float(), want, rtol=0, atol=tol)
