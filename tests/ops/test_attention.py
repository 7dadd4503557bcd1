"""Every fast path against its naive O(n^2) twin in ops/reference.py: outputs and gradients."""

from __future__ import annotations

import pytest
import torch

from hf_polyattn import PolyAttnConfig
from hf_polyattn.ops import PolyAttention, reference_attention

D = 8
BLOCK = 16

# (id, config kwargs): every kind and option of the kernels issue.
CASES = [
    ("poly4-quadratic", dict(kind="polynomial", degree=4, exact_path="quadratic")),
    ("poly2-tensor", dict(kind="polynomial", degree=2, exact_path="tensor")),
    ("poly2-tensor-alpha-beta-norm", dict(kind="polynomial", degree=2, alpha=0.5, beta=2.0, qk_norm=True,
                                          exact_path="tensor")),
    ("poly4-plus-one", dict(kind="polynomial", degree=4, denominator_offset=1.0, qk_norm=True)),
    ("sqpoly-learned-tensor", dict(kind="polynomial", poly_coefficients=(1.0, -0.5), learn_coefficients=True,
                                   exact_path="tensor")),
    ("sqpoly3-quadratic", dict(kind="polynomial", poly_coefficients=(1.0, 1.0, 1.0, 1.0), exact_path="quadratic")),
    ("ps4-gaussian", dict(kind="polysketch", degree=4, sketch="gaussian")),
    ("ps2-srht", dict(kind="polysketch", degree=2, sketch="srht")),
    ("ps8-srht", dict(kind="polysketch", degree=8, sketch="srht", sketch_size=8)),
    ("ps4-learned-local-poly", dict(kind="polysketch", sketch="learned", local_exact=True, qk_norm=True)),
    ("ps4-gaussian-local-softmax", dict(kind="polysketch", local_exact=True, local_kernel="softmax")),
    ("ps4-cumsum-plus-one", dict(kind="polysketch", causal_algorithm="cumsum", denominator_offset=1.0)),
    ("linear-elu", dict(kind="linear", feature_map="elu")),
    ("linear-relu", dict(kind="linear", feature_map="relu")),
    ("linear-taylor-local", dict(kind="linear", feature_map="taylor", local_exact=True)),
    ("performer", dict(kind="performer", num_features=32)),
    ("performer-local", dict(kind="performer", num_features=32, local_exact=True)),
    # regression: FAVOR+'s per-query stabiliser was not undone against exact polynomial blocks (error 1.1)
    ("performer-local-poly", dict(kind="performer", num_features=32, local_exact=True, local_kernel="polynomial")),
    ("linear-elu-local-poly", dict(kind="linear", feature_map="elu", local_exact=True, local_kernel="polynomial")),
    # learnable projection d -> d' of q and k before the kernel (then the LayerNorm)
    ("ps4-proj12-norm-local", dict(kind="polysketch", feature_proj=12, qk_norm=True, local_exact=True)),
    ("poly2-tensor-proj10", dict(kind="polynomial", degree=2, feature_proj=10, exact_path="tensor")),
    ("poly4-quadratic-proj8", dict(kind="polynomial", feature_proj=8, exact_path="quadratic")),
    ("performer-proj12-window", dict(kind="performer", num_features=32, feature_proj=12, qk_norm=True, window=5)),
    ("linear-elu-proj8-window-mix", dict(kind="linear", feature_proj=8, window=4, window_mix=True)),
    # Hedgehog's learnable softmax feature map; the window alone (kind sliding_window), softmax and polynomial
    ("linear-hedgehog", dict(kind="linear", feature_map="hedgehog")),
    ("linear-hedgehog-window", dict(kind="linear", feature_map="hedgehog", window=4)),
    ("sliding-window5", dict(kind="sliding_window", window=5)),
    ("sliding-window4-poly2", dict(kind="sliding_window", window=4, local_kernel="polynomial", degree=2)),
]

# (id, batch, heads, kv_heads, q_len, kv_len, causal, padding)
SHAPES = [
    ("causal-n1", 1, 2, 2, 1, 1, True, None),
    ("causal-n7-lt-block", 2, 2, 2, 7, 7, True, None),
    ("causal-n37-odd-gqa", 2, 4, 2, 37, 37, True, None),
    ("causal-n32-multiple-padleft", 2, 2, 2, 32, 32, True, "left"),
    ("causal-n37-padright", 2, 2, 1, 37, 37, True, "right"),
    ("causal-q5-after-past37", 2, 4, 2, 5, 37, True, "left"),
    ("bidir-n37-padright-gqa", 2, 4, 2, 37, 37, False, "right"),
    ("bidir-n20-padleft", 2, 2, 2, 20, 20, False, "left"),
    ("bidir-q9-kv37", 2, 2, 2, 9, 37, False, "right"),
]


def _padding_mask(batch: int, n: int, side: str | None) -> torch.Tensor | None:
    if side is None:
        return None
    mask = torch.ones(batch, n, dtype=torch.bool)
    if side == "left":
        mask[0, : n // 3] = False
    else:
        mask[0, n - n // 3 :] = False
    return mask


def _module(kwargs, heads, kv_heads, dtype=torch.float64):
    cfg = PolyAttnConfig(**{"block_size": BLOCK, "sketch_size": 6, **kwargs})
    mod = PolyAttention(cfg, num_heads=heads, head_dim=D, num_kv_heads=kv_heads, layer_idx=1).to(dtype)
    with torch.no_grad():  # move learnable parameters off their neutral init so their gradients matter
        for name, p in mod.named_parameters():
            if "norm" in name or name.endswith(".out") or "feature_proj" in name or "window_mix" in name:
                p.add_(0.1 * torch.randn_like(p))
    return mod


def _inputs(batch, heads, kv_heads, lq, lk, dtype=torch.float64, scale=1.0):
    q = (scale * torch.randn(batch, heads, lq, D, dtype=dtype)).requires_grad_()
    k = (scale * torch.randn(batch, kv_heads, lk, D, dtype=dtype)).requires_grad_()
    v = torch.randn(batch, kv_heads, lk, D, dtype=dtype).requires_grad_()
    return q, k, v


@pytest.mark.parametrize("shape", SHAPES, ids=[s[0] for s in SHAPES])
@pytest.mark.parametrize("kind", CASES, ids=[k[0] for k in CASES])
def test_fast_path_matches_reference(kind, shape):
    _, kwargs = kind
    _, batch, heads, kv_heads, lq, lk, causal, pad = shape
    mod = _module(kwargs, heads, kv_heads)
    if (mod.config.local_exact or mod.config.window) and not causal and lq != lk:
        with pytest.raises(ValueError, match="q_len == kv_len"):
            mod(*_inputs(batch, heads, kv_heads, lq, lk), causal=causal)
        return
    q, k, v = _inputs(batch, heads, kv_heads, lq, lk)
    mask = _padding_mask(batch, lk, pad)
    out = mod(q, k, v, causal=causal, key_padding_mask=mask, scaling=0.4)
    ref = reference_attention(mod, q, k, v, causal=causal, key_padding_mask=mask, scaling=0.4)
    assert out.shape == (batch, heads, lq, D)
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-10)
    assert_grads_match(mod, out, ref, (q, k, v))


def assert_grads_match(mod, out, ref, inputs):
    """d/d(q, k, v) and d/d(every trainable parameter of ``mod``) of <out, g> and <ref, g> agree, g random."""
    grad = torch.randn_like(out)
    params = [p for p in mod.parameters() if p.requires_grad]
    fast = torch.autograd.grad((out * grad).sum(), [*inputs, *params], allow_unused=True)
    slow = torch.autograd.grad((ref * grad).sum(), [*inputs, *params], allow_unused=True)
    names = ["dq", "dk", "dv"] + [n for n, p in mod.named_parameters() if p.requires_grad]
    for name, a, b in zip(names, fast, slow):
        if a is None or b is None:  # unused on one side (no key beyond a window): zero on the other
            assert (a is None or not a.abs().any()) and (b is None or not b.abs().any()), name
        else:
            torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-9, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("kind", CASES, ids=[k[0] for k in CASES])
def test_causality(kind):
    """Changing tokens >= t leaves outputs < t (and their gradients w.r.t. earlier tokens) unchanged."""
    assert_causal(_module(kind[1], 4, 2), n=45, t=19)  # t inside a block of 16: it mixes positions < t and >= t


def assert_causal(mod, n: int, t: int) -> None:
    """Changing tokens >= t leaves ``mod``'s outputs < t unchanged and reaches every head's later rows; no gradient
    flows from earlier outputs into later inputs."""
    q, k, v = _inputs(2, mod.num_heads, mod.num_kv_heads, n, n)
    out = mod(q, k, v, causal=True)
    q2, k2, v2 = (x.detach().clone() for x in (q, k, v))
    for x in (q2, k2, v2):
        x[:, :, t:] = 5.0 * torch.randn_like(x[:, :, t:])
    out2 = mod(q2, k2, v2, causal=True)
    torch.testing.assert_close(out2[:, :, :t], out[:, :, :t], rtol=0, atol=1e-12)
    for h in range(mod.num_heads):  # the change did reach later rows
        assert (out2[:, h, t:] - out[:, h, t:]).abs().max() > 1e-3, h
    for g in torch.autograd.grad(out[:, :, :t].sum(), (q, k, v)):
        assert g[:, :, t:].abs().max() == 0


STATE_KINDS = [k for k in CASES if k[1].get("causal_algorithm") != "cumsum"]


@pytest.mark.parametrize("kind", STATE_KINDS, ids=[k[0] for k in STATE_KINDS])
@pytest.mark.parametrize("padded", [False, True], ids=["nopad", "padleft"])
def test_chunked_prefill_and_steps_equal_full_causal(kind, padded):
    mod = _module(kind[1], 4, 2)
    n = 41
    q, k, v = _inputs(2, 4, 2, n, n)
    mask = _padding_mask(2, n, "left") if padded else None
    full = mod(q, k, v, causal=True, key_padding_mask=mask)
    state = mod.init_state()
    outs = []
    # prefill chunks that straddle block boundaries (16), then token-by-token
    for s, e in [(0, 11), (11, 30)] + [(i, i + 1) for i in range(30, n)]:
        m = None if mask is None else mask[:, s:e]
        o, state = mod(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], causal=True, key_padding_mask=m, state=state)
        outs.append(o)
    torch.testing.assert_close(torch.cat(outs, dim=2), full, rtol=1e-9, atol=1e-10)
    assert state.length == n


def test_recurrent_state_is_constant_size():
    mod = _module(dict(kind="polysketch"), 2, 2)
    q, k, v = _inputs(1, 2, 2, 200, 200)
    state = mod.init_state()
    sizes = []
    for i in range(200):
        _, state = mod(q[:, :, i : i + 1], k[:, :, i : i + 1], v[:, :, i : i + 1], causal=True, state=state)
        sizes.append(state.nbytes())
    assert len(set(sizes)) == 1 and state.k is None
    loc = _module(dict(kind="polysketch", local_exact=True), 2, 2)
    state = loc.init_state()
    peak = 0
    for i in range(200):
        _, state = loc(q[:, :, i : i + 1], k[:, :, i : i + 1], v[:, :, i : i + 1], causal=True, state=state)
        peak = max(peak, 0 if state.k is None else state.k.shape[2])
    assert peak == BLOCK - 1  # the buffer never holds a full block: it is folded at the boundary


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("kind", [k for k in CASES if k[0] in {"ps4-gaussian", "ps4-learned-local-poly",
                                                              "linear-elu", "performer-local", "poly4-quadratic"}],
                         ids=lambda k: k[0])
def test_half_precision_matches_fp32(kind, dtype):
    mod = _module(kind[1], 2, 2, dtype=torch.float32)
    q, k, v = _inputs(2, 2, 2, 40, 40, dtype=torch.float32, scale=2.0)
    ref = mod(q, k, v, causal=True)
    out = mod(q.to(dtype), k.to(dtype), v.to(dtype), causal=True)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), ref, rtol=0.05, atol=0.05)


def test_reference_kinds_differ():
    """Guard against a reference that silently ignores the kind (the tests above would pass)."""
    q, k, v = _inputs(1, 2, 2, 20, 20)
    outs = [reference_attention(_module(kw, 2, 2), q, k, v, causal=True) for _, kw in CASES[:10]]
    for i in range(len(outs)):
        for j in range(i + 1, len(outs)):
            assert not torch.allclose(outs[i], outs[j]), (CASES[i][0], CASES[j][0])


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
@pytest.mark.parametrize("kind", [k for k in CASES if k[1].get("local_exact")], ids=lambda k: k[0])
def test_local_blocks_in_several_rematerialised_groups(kind, causal):
    """n spans several groups of exact diagonal blocks (8 blocks of 16 per group)."""
    mod = _module(kind[1], 2, 1)
    q, k, v = _inputs(1, 2, 1, 300, 300)
    mask = _padding_mask(1, 300, "right")
    out = mod(q, k, v, causal=causal, key_padding_mask=mask)
    ref = reference_attention(mod, q, k, v, causal=causal, key_padding_mask=mask)
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-10)
    g = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad((out * g).sum(), (q, k, v)), torch.autograd.grad((ref * g).sum(), (q, k, v))):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-9)


def test_local_exact_warns_once_on_misaligned_left_padding():
    import hf_polyattn.ops.local as att

    att._WARNED_LEFT_PADDING = False
    mod = _module(dict(kind="polysketch", local_exact=True), 2, 2)
    q, k, v = _inputs(2, 2, 2, 40, 40)
    aligned = torch.ones(2, 40, dtype=torch.bool)
    aligned[0, :BLOCK] = False
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mod(q, k, v, causal=True, key_padding_mask=aligned)  # a multiple of the block: exact, no warning
    shifted = torch.ones(2, 40, dtype=torch.bool)
    shifted[0, :3] = False
    with pytest.warns(UserWarning, match="left padding"):
        mod(q, k, v, causal=True, key_padding_mask=shifted)


def test_feature_proj_starts_as_the_identity_and_trains():
    """An untrained projection (identity padded with zeros) computes today's kernel; its weight
    receives gradients; d' < head_dim is refused (it could not start as the identity)."""
    gen = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(1, 2, 20, D, generator=gen, dtype=torch.float64) for _ in range(3))
    for opts in (dict(kind="polysketch", sketch_size=8, local_exact=True), dict(kind="linear", window=4),
                 dict(kind="polynomial", degree=2, exact_path="tensor")):
        plain = PolyAttention(PolyAttnConfig(block_size=BLOCK, **opts), 2, D).double()
        proj = PolyAttention(PolyAttnConfig(block_size=BLOCK, feature_proj=D, **opts), 2, D).double()
        proj.load_state_dict(plain.state_dict(), strict=False)
        torch.testing.assert_close(proj(q, k, v, causal=True), plain(q, k, v, causal=True), rtol=1e-12, atol=1e-12)
        proj(q, k, v, causal=True).square().sum().backward()
        assert proj.feature_proj.weight.grad.abs().max() > 0
    # wider than head_dim: zero-padded q, k give the same dot products, so the exact polynomial kernel is
    # unchanged (feature maps see the extra zero coordinates: elu+1 adds 1 per coordinate)
    wide = PolyAttention(PolyAttnConfig(kind="polynomial", feature_proj=12), 2, D).double()
    narrow = PolyAttention(PolyAttnConfig(kind="polynomial"), 2, D).double()
    torch.testing.assert_close(wide(q, k, v, causal=False), narrow(q, k, v, causal=False), rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match=r"feature_proj must be 0 \(off\) or >= head_dim \(8\)"):
        PolyAttention(PolyAttnConfig(kind="linear", feature_proj=4), 2, D)
