"""backend='fla': fla-core's ``chunk_linear_attn`` for identity features (linear, performer).

fla-core's kernels need CUDA (its autotuner does not run under Triton's interpreter, and its kernels do not
interpret either: fla-core 0.6.0, triton 3.9). On the CPU the glue is tested against a stand-in with fla-core's
documented contract (B, T, H, K) inputs, o_i = scale sum_{j <= i} (q_i . k_j) v_j, one key head per query head,
same dtype, contiguous): the layout, the query-group copies, the dtype, the gradients, the dispatch and every
refusal. A window's exact part runs through FlexAttention on 'fla', here its dense stand-in (PyTorch runs no
FlexAttention backward on the CPU; tests/ops/flex_fla_standins.py). ``test_real_fla_on_cuda`` runs the real kernels
where a GPU and fla-core are present.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

import hf_polyattn.ops.backend as backend_mod
import hf_polyattn.ops.flex as flex_mod
from hf_polyattn import PolyAttnConfig
from hf_polyattn.ops import PolyAttention
from hf_polyattn.ops.backend import ENV_VAR, lt_multiply_fla, lt_product
from hf_polyattn.ops.causal import lt_multiply_batched

from .flex_fla_standins import dense_flex, hide_fla


def _standin(calls: list):
    """A module tree ``fla.ops.linear_attn`` whose ``chunk_linear_attn`` is the dense product of fla's contract."""

    def chunk_linear_attn(q, k, v, scale=None, initial_state=None, output_final_state=False, normalize=True,
                          cu_seqlens=None):
        assert q.dim() == k.dim() == v.dim() == 4 and q.shape == k.shape and q.shape[:3] == v.shape[:3], \
            "fla-core takes (B, T, H, K), one key head per query head"
        assert q.dtype == k.dtype == v.dtype, "fla-core takes one dtype"
        assert all(x.is_contiguous() for x in (q, k, v)), "fla-core reads (B, T, H, K) contiguous"
        calls.append(dict(shape=tuple(q.shape), v_shape=tuple(v.shape), dtype=q.dtype, scale=scale,
                          normalize=normalize))
        s = torch.einsum("bihk,bjhk->bhij", q, k) * (k.shape[-1] ** -0.5 if scale is None else scale)
        s = s.tril()
        o = torch.einsum("bhij,bjhv->bihv", s, v)
        if normalize:
            o = o / s.sum(-1).transpose(1, 2)[..., None]
        return o, None

    fla = types.ModuleType("fla")
    ops = types.ModuleType("fla.ops")
    linear_attn = types.ModuleType("fla.ops.linear_attn")
    linear_attn.chunk_linear_attn = chunk_linear_attn
    fla.ops, ops.linear_attn = ops, linear_attn
    return {"fla": fla, "fla.ops": ops, "fla.ops.linear_attn": linear_attn}


@pytest.fixture
def fla_standin(monkeypatch):
    calls = []
    for name, module in _standin(calls).items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(backend_mod, "_FLA_DEVICES", ("cuda", "cpu"))  # the stand-in runs anywhere
    monkeypatch.setattr(flex_mod, "_flex_function", lambda device: dense_flex)
    monkeypatch.delenv(ENV_VAR, raising=False)
    return calls


def _inputs(n=23, r=5, e=7, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(2, 3, 2, n, r, generator=gen).to(dtype).requires_grad_()  # 2 query groups per kv head
    b = torch.randn(2, 3, 1, n, r, generator=gen).to(dtype).requires_grad_()
    c = torch.randn(2, 3, 1, n, e, generator=gen).to(dtype).requires_grad_()
    return a, b, c


def test_product_layout_groups_and_gradients(fla_standin):
    """Every (batch, kv head, group) becomes one fla head; B, C copied per group; fp32 out; gradients summed back."""
    a, b, c = _inputs()
    out = lt_product(a, b, c, 8, True, False, backend="fla")
    assert fla_standin == [dict(shape=(1, 23, 12, 5), v_shape=(1, 23, 12, 7), dtype=torch.float32, scale=1.0,
                                normalize=False)]
    ref = lt_multiply_batched(a, b, c, 8, True, False)
    assert out.shape == ref.shape == (2, 3, 2, 23, 7) and out.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(ref)
    for name, x, y in zip("abc", torch.autograd.grad(out, (a, b, c), g), torch.autograd.grad(ref, (a, b, c), g)):
        assert x.shape == y.shape
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5, msg=f"d{name}")


@pytest.mark.parametrize("e, kernel_columns", [(65, 64), (66, 64), (129, 128), (64, 64), (69, 69), (7, 7)])
def test_columns_past_a_tile_by_cumulative_sum(e, kernel_columns, fla_standin):
    """[v, 1] with d = 64 has 65 columns: fla-core's kernel gets the 64 value columns (a second 64-wide tile would
    recompute every chunk's q k^T) and the normaliser comes from a float32 cumulative sum (at most 4 such columns;
    more go to the kernel); the same product and gradients as the batched path."""
    a, b, c = _inputs(n=40, r=6, e=e, seed=1)
    out = lt_product(a, b, c, 8, True, False, backend="fla")
    assert [x["v_shape"] for x in fla_standin] == [(1, 40, 12, kernel_columns)]
    ref = lt_multiply_batched(a, b, c, 8, True, False)
    assert out.shape == ref.shape == (2, 3, 2, 40, e) and out.dtype == torch.float32
    assert ((out - ref).norm() / ref.norm()).item() < 1e-6  # float32 sums in another order
    g = torch.randn_like(ref)
    for name, x, y in zip("abc", torch.autograd.grad(out, (a, b, c), g), torch.autograd.grad(ref, (a, b, c), g)):
        assert ((x - y).norm() / y.norm()).item() < 1e-6, f"d{name}"


def test_bf16_values_feed_fla_in_bf16(fla_standin):
    """A bf16 model's values (float32 features): fla-core reads features and values in bf16, as its own rows do,
    and the normaliser's cumulative sum reads the same rounded features in float32 (so numerator and denominator
    agree); an fp16 model's product stays float32 (its unnormalised sums would pass fp16's range)."""
    a, b, c = _inputs(n=50, r=8, e=65, seed=2)
    out = lt_product(a, b, c.detach().bfloat16(), 8, True, False, backend="fla")
    assert fla_standin[-1]["dtype"] == torch.bfloat16 and fla_standin[-1]["v_shape"][-1] == 64
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    rounded = lt_multiply_batched(*(x.detach().bfloat16().float() for x in (a, b, c)), 8, True, False)
    assert ((out - rounded).norm() / rounded.norm()).item() < 2**-7  # the kernel's output rounded to bf16
    torch.testing.assert_close(out[..., -1], rounded[..., -1], rtol=1e-5, atol=1e-5)  # the float32 normaliser
    (da,) = torch.autograd.grad(out.sum(), (a,))
    assert torch.isfinite(da).all()
    lt_product(a, b, c.detach().half(), 8, True, False, backend="fla")
    assert fla_standin[-1]["dtype"] == torch.float32


def test_mixed_dtypes_run_in_the_common_one(fla_standin):
    a, b, c = _inputs(dtype=torch.bfloat16)
    out = lt_multiply_fla(a, b, c.float())
    assert fla_standin[-1]["dtype"] == torch.float32 and out.dtype == torch.float32
    out = lt_multiply_fla(a, b, c)
    assert fla_standin[-1]["dtype"] == torch.bfloat16 and out.dtype == torch.float32
    out = lt_multiply_fla(a.float(), b.float(), c)  # bf16 values: features rounded to them (the precision doc)
    assert fla_standin[-1]["dtype"] == torch.bfloat16 and out.dtype == torch.float32


def test_refusals_name_the_problem(fla_standin):
    a, b, c = _inputs()
    with pytest.raises(ValueError, match="squared features"):
        lt_product(a, b, c, 8, True, True, backend="fla")
    with pytest.raises(ValueError, match="dropped diagonal blocks"):
        lt_product(a, b, c, 8, False, False, backend="fla")
    wide = torch.randn(1, 1, 1, 4, 300)
    with pytest.raises(ValueError, match="r = 300 > 256"):
        lt_product(wide, wide, torch.randn(1, 1, 1, 4, 3), 8, True, False, backend="fla")
    with pytest.raises(ValueError, match="float64"):
        lt_product(a.double(), b.double(), c.double(), 8, True, False, backend="fla")
    assert fla_standin == []


def test_refused_without_fla_or_cuda(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    hide_fla(monkeypatch)  # import fla -> ImportError, even after a real import (every fla.* module hidden)
    a, b, c = _inputs()
    with pytest.raises(ValueError, match=r"needs fla-core: pip install 'hf_polyattn\[fla\]'"):
        lt_product(a, b, c, 8, True, False, backend="fla")
    for name, module in _standin([]).items():
        monkeypatch.setitem(sys.modules, name, module)
    with pytest.raises(ValueError, match="CUDA tensors"):  # installed, but these are CPU tensors
        lt_product(a, b, c, 8, True, False, backend="fla")


def test_env_var_selects_fla(fla_standin, monkeypatch):
    monkeypatch.setenv(ENV_VAR, "fla")
    a, b, c = _inputs()
    lt_product(a, b, c, 8, True, False, backend="auto")
    assert len(fla_standin) == 1
    monkeypatch.delenv(ENV_VAR)
    lt_product(a, b, c, 8, True, False, backend="auto")  # auto never picks fla
    assert len(fla_standin) == 1


MODULE_KINDS = [
    dict(kind="linear", feature_map="elu"),
    dict(kind="performer", num_features=8),
    dict(kind="linear", feature_map="elu", window=5),  # the window's far part is a shifted product
]


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
@pytest.mark.parametrize("opts", MODULE_KINDS, ids=lambda o: "-".join(str(v) for v in o.values()))
def test_module_on_fla_equals_loop(opts, causal, fla_standin):
    mods = {which: PolyAttention(PolyAttnConfig(block_size=8, backend=which, **opts), 4, 8, 2)
            for which in ("loop", "fla")}
    mods["fla"].load_state_dict(mods["loop"].state_dict())
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, h, 29, 8, generator=gen).requires_grad_() for h in (4, 2, 2))
    mask = torch.ones(2, 29, dtype=torch.bool)
    mask[1, 25:] = False
    results = {}
    for which, mod in mods.items():
        out = mod(q, k, v, causal=causal, key_padding_mask=mask)
        results[which] = (out, torch.autograd.grad(out.square().sum(), (q, k, v)))
    if causal:
        assert fla_standin, "backend='fla' did not reach fla-core's kernel"
    torch.testing.assert_close(results["fla"][0], results["loop"][0], rtol=1e-4, atol=1e-5)
    for name, x, y in zip("qkv", results["fla"][1], results["loop"][1]):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5 * y.abs().max().item(), msg=f"d{name}")


def test_polysketch_on_fla_is_refused_by_name(fla_standin):
    pa = PolyAttention(PolyAttnConfig(kind="polysketch", sketch_size=4, backend="fla"), 4, 8, 2)
    q, k, v = (torch.randn(1, h, 20, 8) for h in (4, 2, 2))
    with pytest.raises(ValueError, match="backend='fla' computes identity features"):
        pa(q, k, v, causal=True)


def _real_fla() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        from fla.ops.linear_attn import chunk_linear_attn  # noqa: F401
    except Exception:
        return False
    return True


@pytest.mark.skipif(not _real_fla(), reason="needs CUDA and fla-core (pip install 'hf_polyattn[fla]')")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_real_fla_on_cuda(dtype):
    """fla-core's kernels against the batched fp32 product: tf32 dots (fp32) / bf16 inputs, 2^-7 normwise."""
    a, b, c = (x.detach().cuda().requires_grad_() for x in _inputs(n=300, r=64, e=65, dtype=dtype))
    out = lt_multiply_fla(a, b, c)
    a32, b32, c32 = (x.detach().float().requires_grad_() for x in (a, b, c))
    ref = lt_multiply_batched(a32, b32, c32, 64, True, False)
    assert ((out - ref).norm() / ref.norm()).item() < 2**-7
    g = torch.randn_like(ref)
    for x, y in zip(torch.autograd.grad(out, (a, b, c), g), torch.autograd.grad(ref, (a32, b32, c32), g)):
        assert ((x.float() - y).norm() / y.norm()).item() < 2**-7
