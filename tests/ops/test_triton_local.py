"""Triton exact diagonal blocks (``local_exact``) against the PyTorch ``_local_blocks`` and the O(n^2) reference.

Without a GPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set by tests/ops/triton_setup.py before the
kernels are first imported; every dot is then a full fp32 numpy matmul, so fp32 tolerances are
tight). With a GPU the same tests run the compiled kernels on CUDA.
"""

from __future__ import annotations

import pytest
import torch

from hf_polyattn import PolyAttnConfig
from hf_polyattn.ops import PolyAttention
from hf_polyattn.ops.backend import ENV_VAR
from hf_polyattn.ops.common import _with_normaliser
from hf_polyattn.ops.reference import reference_attention
from hf_polyattn.ops.triton import local_blocks_triton
from tests.ops.triton_setup import DEVICE  # sets TRITON_INTERPRET before the kernels load

# fp32 inputs: fp32 accumulation over <= 16..80 terms of a block, in another summation order than
# PyTorch's matmul (and the softmax's online max rescales partial sums): ~1e-6 relative to the
# largest term. Degree-4 weights reach ~1e3 here, so the tolerance is relative to the output's scale.
FP32_REL = 1e-5
# Half inputs: the kernels convert them to fp32 on load, and on a GPU take tf32 dots for them
# (operands rounded to 2^-11, a product 2^-10; the polynomial raises a score's relative error p-fold).
# Compared normwise with the fp32 PyTorch blocks on the same (half-representable) values; 2^-6 leaves
# margin over p = 4 times 2^-10. The interpreter does fp32 dots, where the bound holds trivially.
HALF_REL = 2**-6

BLOCK = 16
N = 37  # two full blocks and a partial one of 5
B, HKV, G, D = 2, 2, 2, 8


def _module(kernel: str, degree: int = 2, block: int = BLOCK, backend: str = "auto", kind: str = "polysketch",
            **extra) -> PolyAttention:
    opts = dict(sketch_size=4, degree=degree) if kind == "polysketch" else dict(feature_map="elu")
    if kind == "performer":
        opts = dict(num_features=8)
    cfg = PolyAttnConfig(kind=kind, local_exact=True, local_kernel=kernel, block_size=block, backend=backend,
                         **opts, **extra)
    return PolyAttention(cfg, HKV * G, D, HKV).to(DEVICE)


def _mask(kind: str | None, n: int = N) -> torch.Tensor | None:
    if kind is None:
        return None
    mask = torch.ones(B, n, dtype=torch.bool)
    if kind == "right":
        mask[1, n - 9:] = False
        mask[0, n - 1:] = False
    else:  # left: 3 and 20 leading pads (the first block of row 1 sees no key at all)
        mask[0, :3] = False
        mask[1, :20] = False
    return mask.to(DEVICE)


def _inputs(n=N, dtype=torch.float32, seed=0, q_scale=1.0, log_scale=False):
    gen = torch.Generator().manual_seed(seed)
    q = (q_scale * torch.randn(B, HKV, G, n, D, generator=gen)).to(DEVICE, dtype).requires_grad_()
    k = torch.randn(B, HKV, 1, n, D, generator=gen).to(DEVICE, dtype).requires_grad_()
    v = torch.randn(B, HKV, 1, n, D, generator=gen).to(DEVICE, dtype).requires_grad_()
    c = (0.3 * torch.randn(B, HKV, G, n, 1, generator=gen)).to(DEVICE).requires_grad_() if log_scale else None
    return q, k, v, c


def _close(x, y, rel, what):
    """|x - y| <= rel * max|y| elementwise (the error scale of fp32 sums of terms up to max|y|)."""
    assert torch.isfinite(x).all(), f"{what}: not finite"
    err = (x.double() - y.double()).abs().max().item()
    bound = rel * max(y.double().abs().max().item(), 1e-30)
    assert err <= bound, f"{what}: max error {err:.3e} > {bound:.3e}"


def _normwise(x, y, rel, what):
    assert torch.isfinite(x).all(), f"{what}: not finite"
    err = ((x.double() - y.double()).norm() / y.double().norm().clamp_min(1e-30)).item()
    assert err <= rel, f"{what}: relative Frobenius error {err:.2e} > {rel:.2e}"


def _run(mod, q, k, v, c, mask, causal, scale, kernel, via):
    """(loc, far_scale) of ``via`` = 'triton' (the dispatch of _local_exact, forced) or 'torch' (_local_blocks)."""
    vext = _with_normaliser(v, mask)
    if via == "torch":
        return mod._local_blocks(q, k, vext, mask, causal, scale, kernel, c)
    return mod._local_exact(q, k, vext, mask, causal, scale, kernel, c)


def _loss_and_grads(loc, far, xs, seed=1):
    gen = torch.Generator().manual_seed(seed)
    g1 = torch.randn(loc.shape, generator=gen).to(loc.device)
    loss = (loc.double() * g1).sum()
    if far is not None:
        loss = loss + (far.double() * torch.randn(far.shape, generator=gen).to(far.device)).sum()
    return torch.autograd.grad(loss, [x for x in xs if x is not None])


@pytest.fixture
def only_triton(monkeypatch):
    """Force the triton backend and make the PyTorch blocks unreachable through ``_local_exact``."""
    monkeypatch.setenv(ENV_VAR, "triton")

    def refuse(*args, **kwargs):
        raise AssertionError("_local_exact fell back to the PyTorch blocks")

    return refuse


def _compare(kernel, degree, causal, mask_kind, log_scale, monkeypatch, refuse, n=N, block=BLOCK, q_scale=1.0,
             extra=None):
    mod = _module(kernel, degree, block)
    if extra:  # fields validated configs do not reach with local_exact (alpha, beta): set on the config
        for name, value in extra.items():
            setattr(mod.config, name, value)
    mask = _mask(mask_kind, n)
    q, k, v, c = _inputs(n, q_scale=q_scale, log_scale=log_scale)
    scale = D ** -0.5
    ref, ref_far = _run(mod, q, k, v, c, mask, causal, scale, kernel, "torch")
    ref_grads = _loss_and_grads(ref, ref_far, (q, k, v, c))
    with monkeypatch.context() as m:
        m.setattr(mod, "_local_blocks", refuse)
        loc, far = _run(mod, q, k, v, c, mask, causal, scale, kernel, "triton")
    assert loc.shape == ref.shape and loc.dtype == torch.float32
    _close(loc, ref, FP32_REL, "loc")
    if kernel == "softmax" or log_scale:
        assert far is not None and far.shape == ref_far.shape
        _close(far, ref_far, FP32_REL, "far_scale")
    else:
        assert far is None and ref_far is None
    grads = _loss_and_grads(loc, far, (q, k, v, c))
    for name, a, b in zip("qkvc", grads, ref_grads):
        _close(a, b, FP32_REL, f"d{name}")


@pytest.mark.parametrize("mask_kind", [None, "right", "left"], ids=["nomask", "right", "left"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
@pytest.mark.parametrize("kernel,degree", [("softmax", 2), ("polynomial", 2), ("polynomial", 4)],
                         ids=["softmax", "poly2", "poly4"])
def test_matches_pytorch_blocks(kernel, degree, causal, mask_kind, monkeypatch, only_triton):
    """Outputs, far_scale and gradients of q, k, v: n = 37 (last block partial), GQA (H=4, Hkv=2)."""
    _compare(kernel, degree, causal, mask_kind, False, monkeypatch, only_triton)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
@pytest.mark.parametrize("kernel,degree", [("softmax", 2), ("polynomial", 2)], ids=["softmax", "poly2"])
def test_with_performer_log_scale(kernel, degree, causal, monkeypatch, only_triton):
    """A per-row log scale (FAVOR+'s q_log_scale) goes into far_scale with the softmax's -m; its gradient too."""
    _compare(kernel, degree, causal, "left", True, monkeypatch, only_triton)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
def test_large_scores_and_degree_8_and_alpha_beta(causal, monkeypatch, only_triton):
    """Softmax scores ~ +-60 (exp would overflow fp32 without the stabiliser); p = 8; ((x + alpha)/beta)^4."""
    _compare("softmax", 2, causal, "right", False, monkeypatch, only_triton, q_scale=8.0)
    _compare("polynomial", 8, causal, None, False, monkeypatch, only_triton, q_scale=0.5)
    _compare("polynomial", 4, causal, "right", False, monkeypatch, only_triton, extra=dict(alpha=0.5, beta=2.0))


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
@pytest.mark.parametrize("kernel", ["softmax", "polynomial"])
def test_blocks_of_several_tiles(kernel, causal, monkeypatch, only_triton):
    """block 80 = two row tiles of 64 (the second partial), n = 170: 2 full blocks and a partial one."""
    _compare(kernel, 2, causal, "right", False, monkeypatch, only_triton, n=170, block=80)


def test_layouts_broadcast_and_strided(monkeypatch):
    """Keys/values broadcast over the batch (stride 0), queries a strided view: gradients summed back."""
    mod = _module("softmax")
    gen = torch.Generator().manual_seed(3)
    qt = torch.randn(B, HKV, G, D, N, generator=gen).to(DEVICE).requires_grad_()
    k = torch.randn(1, HKV, 1, N, D, generator=gen).to(DEVICE).requires_grad_()
    v = torch.randn(1, HKV, 1, N, D + 1, generator=gen).to(DEVICE).requires_grad_()
    q = qt.transpose(-1, -2)  # (B, Hkv, G, N, D), not contiguous
    mask = _mask("right")
    loc, log_far = local_blocks_triton(q, k, v, BLOCK, True, 0.3, "softmax", mask)
    ref, ref_far = mod._local_blocks(q, k.expand(B, -1, -1, -1, -1), v.expand(B, -1, -1, -1, -1), mask, True, 0.3,
                                     "softmax")
    _close(loc, ref, FP32_REL, "loc")
    _close(log_far.exp(), ref_far, FP32_REL, "exp(log_far)")
    assert not log_far.requires_grad
    g = torch.randn_like(ref)
    for name, a, b in zip("qkv", torch.autograd.grad((loc * g).sum(), (qt, k, v)),
                          torch.autograd.grad((ref * g).sum(), (qt, k, v))):
        assert a.shape == b.shape
        _close(a, b, FP32_REL, f"d{name}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("kernel,degree", [("softmax", 2), ("polynomial", 4)], ids=["softmax", "poly4"])
def test_half_inputs(kernel, degree, dtype):
    """Half inputs: fp32 outputs, finite, within HALF_REL (normwise) of the fp32 blocks on the same values."""
    mod = _module(kernel, degree)
    q, k, v, _ = _inputs(dtype=dtype)
    mask = _mask("right")
    vext = _with_normaliser(v, mask)
    loc, log_far = local_blocks_triton(q, k, vext, BLOCK, True, D ** -0.5, kernel, mask, degree)
    assert loc.dtype == torch.float32
    q32, k32, v32 = (x.detach().float().requires_grad_() for x in (q, k, v))
    ref, ref_far = mod._local_blocks(q32, k32, _with_normaliser(v32, mask), mask, True, D ** -0.5, kernel)
    _normwise(loc, ref, HALF_REL, "loc")
    if kernel == "softmax":
        _normwise(log_far.exp(), ref_far, HALF_REL, "exp(log_far)")
    g = torch.randn_like(ref)
    grads = torch.autograd.grad((loc * g).sum(), (q, k, v))
    for name, a, b, x in zip("qkv", grads, torch.autograd.grad((ref * g).sum(), (q32, k32, v32)), (q, k, v)):
        assert a.dtype == x.dtype
        _normwise(a, b, HALF_REL, f"d{name}")


# ------------------------------------------------------------------ through the attention module
MODULE_KINDS = [
    dict(kind="polysketch", sketch="learned", sketch_size=4, local_exact=True),  # polynomial blocks
    dict(kind="polysketch", sketch="learned", sketch_size=4, local_exact=True, local_kernel="softmax"),
    dict(kind="linear", feature_map="elu", local_exact=True),  # softmax blocks
    dict(kind="performer", num_features=8, local_exact=True),  # softmax blocks with FAVOR+'s q_log_scale
]


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
@pytest.mark.parametrize("opts", MODULE_KINDS, ids=lambda o: "-".join(str(v) for v in o.values()))
def test_attention_module_on_triton_backend(opts, causal, monkeypatch):
    """PolyAttention with local_exact on backend='triton' equals backend='loop' and the O(n^2) reference."""
    import hf_polyattn.ops.triton as triton_pkg

    calls = []
    real = triton_pkg.local_blocks_triton
    monkeypatch.setattr(triton_pkg, "local_blocks_triton", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    monkeypatch.delenv(ENV_VAR, raising=False)
    mods = {which: PolyAttention(PolyAttnConfig(block_size=BLOCK, backend=which, **opts), 4, 8, 2).to(DEVICE)
            for which in ("loop", "triton")}
    mods["triton"].load_state_dict(mods["loop"].state_dict())
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(2, h, N, 8, generator=gen).to(DEVICE).requires_grad_() for h in (4, 2, 2))
    mask = torch.ones(2, N, dtype=torch.bool, device=DEVICE)
    mask[1, 30:] = False
    results = {}
    for which, mod in mods.items():
        out = mod(q, k, v, causal=causal, key_padding_mask=mask)
        results[which] = (out, torch.autograd.grad(out.square().sum(), (q, k, v)))
    assert calls, "the triton backend did not reach local_blocks_triton"
    ref = reference_attention(mods["loop"], q, k, v, causal=causal, key_padding_mask=mask)
    torch.testing.assert_close(results["triton"][0], results["loop"][0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(results["triton"][0], ref, rtol=1e-4, atol=1e-4)
    for name, g_t, g_l in zip("qkv", results["triton"][1], results["loop"][1]):
        torch.testing.assert_close(g_t, g_l, rtol=1e-4, atol=1e-5 * g_l.abs().max().item(), msg=f"d{name}")


def test_cpu_auto_keeps_the_pytorch_blocks(monkeypatch):
    """backend='auto' on the CPU (no env override) never calls the Triton local blocks."""
    import hf_polyattn.ops.triton as triton_pkg

    monkeypatch.delenv(ENV_VAR, raising=False)

    def refuse(*args, **kwargs):
        raise AssertionError("auto on the CPU reached the Triton local blocks")

    monkeypatch.setattr(triton_pkg, "local_blocks_triton", refuse)
    mod = _module("softmax").cpu()
    q, k, v, _ = _inputs()
    mod._local_exact(q.cpu(), k.cpu(), _with_normaliser(v.cpu(), None), None, True, 0.3, "softmax")


def test_poly_coefficients_fall_back_to_pytorch(monkeypatch):
    """Squared coefficient polynomials stay on the PyTorch blocks even on backend='triton' (explicit fallback)."""
    import hf_polyattn.ops.triton as triton_pkg

    monkeypatch.setenv(ENV_VAR, "triton")

    def refuse(*args, **kwargs):
        raise AssertionError("poly_coefficients reached the Triton local blocks")

    monkeypatch.setattr(triton_pkg, "local_blocks_triton", refuse)
    mod = _module("polynomial")
    # validated configs do not combine local_exact with poly_coefficients today; the dispatch guards it anyway
    mod.config.poly_coefficients = (0.5, 1.0, 0.25)
    mod.register_buffer("coefficients", torch.tensor(mod.config.poly_coefficients, device=DEVICE))
    q, k, v, _ = _inputs()
    vext = _with_normaliser(v, None)
    loc, far = mod._local_exact(q, k, vext, None, True, 0.3, "polynomial")
    ref, _ = mod._local_blocks(q, k, vext, None, True, 0.3, "polynomial")
    torch.testing.assert_close(loc, ref)
    assert far is None
    # the softmax blocks of such a module still take the kernels
    monkeypatch.setattr(triton_pkg, "local_blocks_triton", lambda *a, **kw: (_ for _ in ()).throw(KeyError("hit")))
    with pytest.raises(KeyError, match="hit"):
        mod._local_exact(q, k, vext, None, True, 0.3, "softmax")


def test_argument_checks():
    x = torch.randn(1, 2, 2, 10, 4, device=DEVICE)
    kv = torch.randn(1, 2, 1, 10, 4, device=DEVICE)
    v = torch.randn(1, 2, 1, 10, 5, device=DEVICE)
    with pytest.raises(ValueError, match="kernel must be"):
        local_blocks_triton(x, kv, v, 4, True, 1.0, "relu")
    with pytest.raises(ValueError, match="block_size must be"):
        local_blocks_triton(x, kv, v, 0, True, 1.0, "softmax")
    with pytest.raises(ValueError, match="power must be"):
        local_blocks_triton(x, kv, v, 4, True, 1.0, "polynomial", power=0)
    with pytest.raises(ValueError, match="one group slot"):
        local_blocks_triton(x, x, v, 4, True, 1.0, "softmax")
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        local_blocks_triton(x.double(), kv, v, 4, True, 1.0, "softmax")
    with pytest.raises(ValueError, match="mask needs shape"):
        local_blocks_triton(x, kv, v, 4, True, 1.0, "softmax", torch.ones(1, 9, dtype=torch.bool, device=DEVICE))
    with pytest.raises(ValueError, match="at most 128"):
        big = torch.randn(1, 1, 1, 4, 130, device=DEVICE)
        local_blocks_triton(big, big, v[:, :1, :, :4], 4, True, 1.0, "softmax")
    with pytest.raises(ValueError, match="same length"):
        local_blocks_triton(x, kv[..., :9, :], v, 4, True, 1.0, "softmax")
