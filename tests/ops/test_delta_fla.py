"""delta_backend='fla': fla-core's gated delta rule kernels (``chunk_gated_delta_rule``, forward + backward;
``fused_recurrent_gated_delta_rule``, forward only) for kind 'delta'.

* Everywhere: the glue (layout, the per-group copies, the initial and final state, the dispatch, the refusals)
  against a stand-in with fla-core 0.6.0's documented contract ((B, T, heads, K) inputs, log-gates g and write
  strengths beta (B, T, heads), state (N, heads, K, V) K first, o_t = scale S_t^T q_t).
* Under Triton's interpreter (TRITON_INTERPRET=1, no GPU) where fla-core is installed: the real fused recurrent
  kernel against the PyTorch path. fla-core 0.6.0's chunk kernel does not run there (its autotuner asks the GPU
  driver: "0 active drivers"), so it is tested on CUDA only (``test_real_chunk_kernel_on_cuda``).
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

import tests.ops.triton_setup  # noqa: F401  (TRITON_INTERPRET=1 before fla-core's kernels are imported, no GPU)
from hf_polyattn import PolyAttnConfig
from hf_polyattn.kinds.delta import DeltaAttention
from hf_polyattn.ops import delta as delta_ops
from hf_polyattn.ops.delta import delta_rule, delta_rule_chunked, delta_rule_fla, l2_normalise
from tests.kinds.inputs import padding_mask, qkv


def _contract(calls: list, name: str):
    def kernel(q, k, v, g=None, beta=None, scale=None, initial_state=None, output_final_state=False, **kwargs):
        b, t, h, dk = q.shape
        assert k.shape == q.shape and v.shape[:3] == (b, t, h) and g.shape == beta.shape == (b, t, h), \
            "fla-core takes (B, T, heads, K), one key head per query head here"
        assert all(x.is_contiguous() for x in (q, k, v, g, beta)), "fla-core reads contiguous (B, T, heads, ...)"
        assert initial_state is None or initial_state.shape == (b, h, dk, v.shape[-1])
        calls.append(dict(kernel=name, shape=tuple(q.shape), scale=scale, dtype=q.dtype))
        s = torch.zeros(b, h, dk, v.shape[-1], dtype=q.dtype) if initial_state is None else initial_state.clone()
        outs = []
        for i in range(t):
            s = s * g[:, i].exp()[..., None, None]
            u = beta[:, i, :, None] * (v[:, i] - torch.einsum("bhk,bhkv->bhv", k[:, i], s))
            s = s + k[:, i, :, :, None] * u[:, :, None, :]
            outs.append(scale * torch.einsum("bhk,bhkv->bhv", q[:, i], s))
        return torch.stack(outs, dim=1), (s if output_final_state else None)

    return kernel


@pytest.fixture
def standin(monkeypatch):
    calls = []
    fla, ops, gdr = (types.ModuleType(n) for n in ("fla", "fla.ops", "fla.ops.gated_delta_rule"))
    gdr.chunk_gated_delta_rule = _contract(calls, "chunk")
    gdr.fused_recurrent_gated_delta_rule = _contract(calls, "recurrent")
    fla.ops, ops.gated_delta_rule = ops, gdr
    for name, module in (("fla", fla), ("fla.ops", ops), ("fla.ops.gated_delta_rule", gdr)):
        monkeypatch.setitem(sys.modules, name, module)
    return calls


def _rule_inputs(n=37, gates=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = l2_normalise(torch.randn(2, 3, 2, n, 8, generator=gen))
    k = l2_normalise(torch.randn(2, 3, 1, n, 8, generator=gen))
    v = torch.randn(2, 3, 1, n, 5, generator=gen)
    beta = torch.rand(2, 3, 1, n, generator=gen)
    log_gate = torch.nn.functional.logsigmoid(torch.randn(2, 3, 1, n, generator=gen) + 2) if gates else None
    s0 = torch.randn(2, 3, 1, 8, 5, generator=gen)
    return q, k, v, beta, log_gate, s0


@pytest.mark.parametrize("recurrent", [False, True], ids=["chunk", "recurrent"])
@pytest.mark.parametrize("gates", [True, False], ids=["gated", "plain"])
def test_glue_layout_groups_and_state(standin, recurrent, gates):
    """Each (kv head, group) of a row is one fla head (3 x 2 = 6); scale 1; outputs and final state as ours."""
    args = _rule_inputs(gates=gates)
    out, final = delta_rule_fla(*args, recurrent=recurrent)
    assert standin == [dict(kernel="recurrent" if recurrent else "chunk", shape=(2, 37, 6, 8), scale=1.0,
                            dtype=torch.float32)]
    want, want_final = delta_rule_chunked(*args)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(final, want_final, rtol=1e-5, atol=1e-5)


def test_layer_on_fla_equals_torch(standin, monkeypatch):
    """The layer (window, sinks, gate, short conv, left padding, GQA) on the 'fla' glue: outputs, gradients and the
    decoding state as on 'torch'. The dispatch is pointed at the chunk kernel (CPU tensors: the real one refuses)."""
    monkeypatch.setattr(delta_ops, "resolve_delta_backend", lambda requested, *a: "torch" if requested == "torch"
                        else "fla-chunk")
    opts = dict(window=5, sinks=2, decay="gate", short_conv=3, delta_mix_init=0.7)
    mods = {b: DeltaAttention(PolyAttnConfig.for_kind("delta", **opts, delta_backend=b), 4, 8, 2)
            for b in ("torch", "fla")}
    mods["fla"].load_state_dict(mods["torch"].state_dict())
    q, k, v = qkv(2, 4, 2, 29, 29, 8, seed=1, dtype=torch.float32, grad=True)
    mask = padding_mask(2, 29, "left")
    results = {}
    for which, mod in mods.items():
        out, state = mod(q, k, v, causal=True, key_padding_mask=mask, state=mod.init_state())
        results[which] = (out, state.kv, torch.autograd.grad(out.square().sum(), (q, k, v)))
    assert standin and all(c["kernel"] == "chunk" for c in standin)
    torch.testing.assert_close(results["fla"][0], results["torch"][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(results["fla"][1], results["torch"][1], rtol=1e-5, atol=1e-5)
    for name, a, b in zip("qkv", results["fla"][2], results["torch"][2]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=f"d{name}")


def test_dispatch_and_refusals(standin, monkeypatch):
    args = _rule_inputs(n=5)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match=r"runs fla-core's Triton kernels on CUDA tensors \(got cpu\)"):
        delta_rule(*args, backend="fla")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with torch.no_grad():
        delta_rule(*args, backend="fla")  # the forward-only recurrent kernel under the interpreter
    assert standin[-1]["kernel"] == "recurrent"
    with pytest.raises(ValueError, match="without gradients"):
        delta_rule(*(t.requires_grad_() if t is not None else t for t in args), backend="fla")
    for name in ("fla", "fla.ops", "fla.ops.gated_delta_rule"):
        monkeypatch.setitem(sys.modules, name, None)  # fla-core absent
    with pytest.raises(ValueError, match=r"delta_backend='fla' needs fla-core: pip install 'hf_polyattn\[fla\]'"):
        delta_rule(*_rule_inputs(n=5), backend="fla")
    with pytest.raises(ValueError, match="delta_backend"):
        PolyAttnConfig.for_kind("delta", delta_backend="triton")


def _real_fla_interpreted() -> bool:
    if torch.cuda.is_available():
        return False
    try:
        from fla.ops.gated_delta_rule import fused_recurrent as fr
    except Exception:
        return False
    kernel = fr.fused_recurrent_gated_delta_rule_fwd_kernel
    while hasattr(kernel, "fn") and type(kernel).__name__ != "InterpretedFunction":
        kernel = kernel.fn
    return type(kernel).__name__ == "InterpretedFunction"


@pytest.mark.skipif(not _real_fla_interpreted(),
                    reason="needs fla-core (pip install 'hf_polyattn[fla]') imported under TRITON_INTERPRET=1, no GPU")
def test_real_recurrent_kernel_under_the_interpreter():
    """fla-core's fused recurrent kernel (interpreted) against the PyTorch chunked path: the layer's prefill with a
    state and a decoding step, float32."""
    opts = dict(window=4, sinks=1, decay="gate", short_conv=2, delta_mix_init=0.5)
    mods = {b: DeltaAttention(PolyAttnConfig.for_kind("delta", **opts, delta_backend=b), 4, 16, 2)
            for b in ("torch", "fla")}
    mods["fla"].load_state_dict(mods["torch"].state_dict())
    q, k, v = qkv(2, 4, 2, 21, 21, 16, seed=2, dtype=torch.float32)
    mask = padding_mask(2, 21, "left")
    with torch.no_grad():
        res = {}
        for which, mod in mods.items():
            out, state = mod(q[:, :, :20], k[:, :, :20], v[:, :, :20], causal=True, key_padding_mask=mask[:, :20],
                             state=mod.init_state())
            step, state = mod(q[:, :, 20:], k[:, :, 20:], v[:, :, 20:], causal=True, state=state)
            res[which] = (out, step, state.kv)
    for a, b in zip(res["fla"], res["torch"]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def _real_fla_cuda() -> bool:
    return torch.cuda.is_available() and delta_ops.fla_delta_available()


@pytest.mark.skipif(not _real_fla_cuda(), reason="CUDA only: needs a GPU and fla-core (pip install 'hf_polyattn[fla]')")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_real_chunk_kernel_on_cuda(dtype):
    """fla-core's chunk kernel (forward + backward) against the PyTorch chunked path on CUDA: 300 tokens, GQA."""
    opts = dict(window=16, sinks=4, decay="gate", short_conv=4, delta_mix_init=0.5)
    mods = {b: DeltaAttention(PolyAttnConfig.for_kind("delta", **opts, delta_backend=b), 8, 64, 2).cuda()
            for b in ("torch", "fla")}
    mods["fla"].load_state_dict(mods["torch"].state_dict())
    q, k, v = (x.cuda().to(dtype).requires_grad_() for x in qkv(2, 8, 2, 300, 300, 64, seed=3,
                                                                  dtype=torch.float32))
    res = {}
    for which, mod in mods.items():
        out = mod(q, k, v, causal=True)
        res[which] = (out.float(), *torch.autograd.grad(out.float().square().sum(), (q, k, v)))
    for name, a, b in zip(["out", "dq", "dk", "dv"], res["fla"], res["torch"]):
        assert ((a.float() - b.float()).norm() / b.float().norm()).item() < 2**-7, name
