"""Hybrid layers (PolyAttnConfig.softmax_heads): some kv heads exact softmax, the rest the kind, against the naive
one-head-at-a-time reference (ops/hybrid.py: hybrid_reference), values and every gradient in float64."""

from __future__ import annotations

import pytest
import torch

from hf_polyattn import PolyAttnConfig
from hf_polyattn.ops import HybridAttention, HybridState, RecurrentState, build_attention, softmax_attention
from hf_polyattn.ops.hybrid import hybrid_reference

from .test_attention import D, _inputs, _padding_mask, assert_causal, assert_grads_match

LAYER = 1

# (id, config kwargs): kernel kinds with their learnable and exact local parts, the window alone, and a kind
# defined on whole sequences (bigbird: a KVCacheAttention)
KINDS = [
    ("polysketch-learned-local-norm", dict(kind="polysketch", sketch="learned", sketch_size=6, local_exact=True,
                                           qk_norm=True, block_size=8)),
    ("linear-elu-window-mix-proj", dict(kind="linear", window=5, window_mix=True, feature_proj=10, block_size=8)),
    ("performer", dict(kind="performer", num_features=16)),
    ("sliding-window4", dict(kind="sliding_window", window=4)),
    ("bigbird", dict(kind="bigbird", options=dict(block=2, random_blocks=1))),
]
# (id, softmax kv heads of layer LAYER, heads, kv heads): mixed and not contiguous (the merge permutes), one kv head
# per query head, and every kv head softmax (no kernel module)
SPLITS = [
    ("gqa-kv0-2-of-3", (0, 2), 6, 3),
    ("mha-kv1-of-4", (1,), 4, 4),
    ("all-softmax", (0, 1), 4, 2),
]
# (id, batch, q_len, kv_len, causal, padding)
SHAPES = [
    ("causal-n1", 1, 1, 1, True, None),
    ("causal-n19", 2, 19, 19, True, None),
    ("causal-n19-padleft", 2, 19, 19, True, "left"),
    ("causal-n19-padright", 2, 19, 19, True, "right"),
    ("causal-q5-after-past19-padleft", 2, 5, 19, True, "left"),
    ("causal-q5-after-past19", 2, 5, 19, True, None),
    ("bidir-n19-padleft", 2, 19, 19, False, "left"),
    ("bidir-n19-padright", 2, 19, 19, False, "right"),
    ("bidir-q7-kv19", 2, 7, 19, False, "right"),
]


def _config(kwargs, soft, layers=(LAYER,)) -> PolyAttnConfig:
    pairs = [(layer, h) for layer in layers for h in soft]
    return PolyAttnConfig(**kwargs, softmax_heads=pairs)


def _module(kwargs, soft, heads, kv_heads, dtype=torch.float64) -> HybridAttention:
    mod = build_attention(_config(kwargs, soft), heads, D, kv_heads, LAYER).to(dtype)
    with torch.no_grad():  # learnable parameters off their neutral init, so that their gradients matter
        for name, p in mod.named_parameters():
            if "norm" in name or "feature_proj" in name or "window_mix" in name:
                p.add_(0.1 * torch.randn_like(p))
    return mod


@pytest.mark.parametrize("shape", SHAPES, ids=[s[0] for s in SHAPES])
@pytest.mark.parametrize("split", SPLITS, ids=[s[0] for s in SPLITS])
@pytest.mark.parametrize("kind", KINDS, ids=[k[0] for k in KINDS])
def test_hybrid_matches_reference(kind, split, shape):
    _, kwargs = kind
    _, soft, heads, kv_heads = split
    _, batch, lq, lk, causal, pad = shape
    mod = _module(kwargs, soft, heads, kv_heads)
    q, k, v = _inputs(batch, heads, kv_heads, lq, lk)
    mask = _padding_mask(batch, lk, pad)
    local = mod.config.local_exact or mod.config.window  # sliding_window: the window alone
    if mod.kernel is not None and local and not causal and lq != lk:  # the kind's own refusal, unchanged
        with pytest.raises(ValueError, match="q_len"):
            mod(q, k, v, causal=causal, key_padding_mask=mask)
        return
    out = mod(q, k, v, causal=causal, key_padding_mask=mask, scaling=0.4)
    ref = hybrid_reference(mod, q, k, v, causal=causal, key_padding_mask=mask, scaling=0.4)
    assert out.shape == (batch, heads, lq, D) and out.dtype == torch.float64
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-10)
    assert_grads_match(mod, out, ref, (q, k, v))


def test_softmax_heads_are_softmax_and_kernel_heads_the_kind():
    """The reference is not circular: the softmax query heads equal a plain softmax computation, the others the
    kind's own module on those heads (with the same tensors) and differ from softmax."""
    kwargs = dict(kind="performer", num_features=16)
    mod = _module(kwargs, (0, 2), 6, 3)
    q, k, v = _inputs(2, 6, 3, 12, 12)
    out = mod(q, k, v, causal=True)
    scores = (q @ k.repeat_interleave(2, dim=1).transpose(-1, -2)) / D**0.5
    scores = scores.masked_fill(~torch.ones(12, 12, dtype=torch.bool).tril(), float("-inf"))
    soft = torch.softmax(scores, -1) @ v.repeat_interleave(2, dim=1)
    for h in (0, 1, 4, 5):  # kv heads 0 and 2
        torch.testing.assert_close(out[:, h], soft[:, h], rtol=1e-12, atol=1e-12)
    alone = PolyAttnConfig(**kwargs).spec.module_class()(PolyAttnConfig(**kwargs), 2, D, 1, LAYER).double()
    alone.load_state_dict(mod.kernel.state_dict())
    torch.testing.assert_close(out[:, 2:4], alone(q[:, 2:4], k[:, 1:2], v[:, 1:2], causal=True), rtol=0, atol=0)
    assert (out[:, 2:4] - soft[:, 2:4]).abs().max() > 1e-3


def test_kernel_module_is_built_for_the_other_heads_only():
    cfg = _config(dict(kind="polysketch", sketch="learned", sketch_size=6, qk_norm=True), (0, 2))
    mod = build_attention(cfg, 6, D, 3, LAYER)
    assert isinstance(mod, HybridAttention) and mod.softmax_kv_heads == (0, 2) and mod.kernel_kv_heads == (1,)
    assert (mod.kernel.num_heads, mod.kernel.num_kv_heads) == (2, 1) and mod.kernel.config.softmax_heads is None
    assert mod.kernel.q_norm.weight.shape[:2] == (1, 2)  # one kv head of 2 query heads: parameters for it alone
    assert all(name.startswith("kernel.") for name, _ in mod.named_parameters())
    other = build_attention(cfg, 6, D, 3, LAYER + 1)  # a layer without softmax heads: the kind's own module
    assert type(other) is cfg.spec.module_class() and other.q_norm.weight.shape[:2] == (3, 2)
    everything = build_attention(_config(dict(kind="linear"), (0, 1, 2)), 6, D, 3, LAYER)
    assert everything.kernel is None and not list(everything.parameters()) and everything.num_features == 0


def test_build_errors_name_the_problem():
    cfg = _config(dict(kind="linear"), (3,))
    with pytest.raises(ValueError, match=r"softmax_heads names kv head 3 of layer 1, which has 3 kv heads \(0..2\)"):
        build_attention(cfg, 6, D, 3, LAYER)
    with pytest.raises(ValueError, match=r"names kv heads \[0\] of layer 1, which LinearAttention would run as "
                                         r"kind='linear'"):
        cfg.spec.module_class()(_config(dict(kind="linear"), (0,)), 6, D, 3, LAYER)
    with pytest.raises(ValueError, match="HybridAttention needs softmax heads in layer 2"):
        HybridAttention(_config(dict(kind="linear"), (0,)), 6, D, 3, 2)


@pytest.mark.parametrize("kind", KINDS, ids=[k[0] for k in KINDS])
def test_causality(kind):
    """Changing tokens >= t leaves outputs < t (and their gradients w.r.t. earlier tokens) unchanged."""
    assert_causal(_module(kind[1], (0, 2), 6, 3), n=29, t=11)  # every head, softmax and kernel


@pytest.mark.parametrize("padded", [False, True], ids=["nopad", "padleft"])
@pytest.mark.parametrize("split", SPLITS, ids=[s[0] for s in SPLITS])
@pytest.mark.parametrize("kind", KINDS, ids=[k[0] for k in KINDS])
def test_chunked_prefill_and_steps_equal_full_causal(kind, split, padded):
    _, soft, heads, kv_heads = split
    mod = _module(kind[1], soft, heads, kv_heads)
    n = 23
    q, k, v = _inputs(2, heads, kv_heads, n, n)
    mask = _padding_mask(2, n, "left") if padded else None
    full = mod(q, k, v, causal=True, key_padding_mask=mask)
    state = mod.init_state()
    assert isinstance(state, HybridState) and (state.kernel is None) == (mod.kernel is None)
    outs = []
    for s, e in [(0, 6), (6, 15)] + [(i, i + 1) for i in range(15, n)]:  # chunks across blocks, then token by token
        m = None if mask is None else mask[:, s:e]
        o, state = mod(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], causal=True, key_padding_mask=m, state=state)
        outs.append(o)
    torch.testing.assert_close(torch.cat(outs, dim=2), full, rtol=1e-9, atol=1e-10)
    assert state.length == n and state.k.shape == (2, len(soft), n, D)  # every key of the softmax heads
    assert (state.mask is None) == (not padded)


def test_state_bytes_grow_only_with_the_softmax_heads():
    """A kernel kind's state is constant: per token the hybrid's state grows by the softmax heads' k, v alone."""
    mod = _module(dict(kind="performer", num_features=16), (1,), 6, 3)
    q, k, v = _inputs(1, 6, 3, 30, 30)
    state = mod.init_state()
    sizes, kernel_sizes = [], []
    with torch.no_grad():
        for i in range(30):
            _, state = mod(q[:, :, i:i + 1], k[:, :, i:i + 1], v[:, :, i:i + 1], causal=True, state=state)
            sizes.append(state.nbytes())
            kernel_sizes.append(state.kernel.nbytes())
    assert isinstance(state.kernel, RecurrentState) and len(set(kernel_sizes)) == 1 and kernel_sizes[0] > 0
    per_token = 2 * 1 * D * 8  # k and v of one softmax kv head, float64
    # the softmax heads' keys and values seen: one token more per step, every one of them kept
    assert state.keys.shape == (1, 1, 30, D) and torch.equal(state.keys, k[:, 1:2])
    # held: the kernel's constant state and the softmax heads' buffers, with room for the next tokens written in
    # place (hybrid._MIN_ROOM tokens here, 1/8 of the length at long contexts), grown only when full
    capacity = state.k.shape[2]
    assert sizes[-1] == kernel_sizes[-1] + capacity * per_token and 30 <= capacity <= 30 + 256
    assert len(set(sizes)) == 1  # 30 tokens fit the first buffer: nothing was copied after the first step


def test_state_batch_operations():
    mod = _module(dict(kind="linear", window=3), (0,), 4, 2)
    q, k, v = _inputs(3, 4, 2, 7, 7)
    mask = _padding_mask(3, 7, "left")
    _, state = mod(q, k, v, causal=True, key_padding_mask=mask, state=mod.init_state())
    picked = state.index_select(torch.tensor([2, 0]))
    assert torch.equal(picked.k, state.k[[2, 0]]) and torch.equal(picked.mask, state.mask[[2, 0]])
    assert torch.equal(picked.kernel.kv, state.kernel.kv[[2, 0]]) and picked.length == 7
    rep = state.repeat_interleave(2)
    assert torch.equal(rep.v, state.v.repeat_interleave(2, 0)) and rep.kernel.k.shape[0] == 6
    assert state.nbytes() == (state.k.numel() + state.v.numel()) * 8 + state.mask.numel() + state.kernel.nbytes()


def test_softmax_attention_against_naive_and_empty_rows():
    """The exact part alone: causal bottom-right rows, padding, GQA; a row that sees no key is 0 with finite
    gradients (SDPA's NaN for such rows would reach later layers through 0 * NaN)."""
    q, k, v = _inputs(2, 4, 2, 5, 9)
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[0, :5] = False  # row 0 of the first sequence (position 4) sees no key, row 1 one key
    out = softmax_attention(q, k, v, causal=True, scale=0.3, key_padding_mask=mask)
    allowed = (torch.arange(9)[None, :] <= torch.arange(5)[:, None] + 4)[None, None] & mask[:, None, None, :]
    x = (q @ k.repeat_interleave(2, 1).transpose(-1, -2) * 0.3).masked_fill(~allowed, float("-inf"))
    ref = (torch.softmax(x, -1) @ v.repeat_interleave(2, 1)).nan_to_num(0.0)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    assert out[0, :, 0].abs().max() == 0 and out[0, :, 1].abs().max() > 0
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    assert all(torch.isfinite(g).all() for g in grads)
    assert torch.autograd.gradcheck(lambda a, b, c: softmax_attention(a, b, c, causal=True, scale=0.3,
                                                                      key_padding_mask=mask), (q, k, v))


def _count_sdpa(monkeypatch) -> list:
    """A list that gets an item for every SDPA call softmax_attention makes from now on (in this test)."""
    from hf_polyattn.ops import hybrid

    sdpa = torch.nn.functional.scaled_dot_product_attention
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(hybrid.F, "scaled_dot_product_attention", counted)
    return calls


@pytest.mark.parametrize("lq", [1, 3, 8, 9])
def test_softmax_attention_few_queries_of_one_head(monkeypatch, lq):
    """One query head of one sequence, at most 8 queries (a decoding step over a cache): the explicit
    q k^T -> softmax -> v path that replaces CPU SDPA there, against the naive reference with a padded key and a
    row that sees no key, gradients included; at 9 queries SDPA serves again. SDPA's calls are counted, so a lost
    route fails the test."""

    lk = 37
    q, k, v = _inputs(1, 1, 1, lq, lk)
    mask = torch.ones(1, lk, dtype=torch.bool)
    mask[0, 2] = False
    if lq > 1:  # the first query's causal keys (positions 0 .. lk - lq) all padded: it sees none
        mask[0, : lk - lq + 1] = False
    calls = _count_sdpa(monkeypatch)
    out = softmax_attention(q, k, v, causal=True, scale=0.3, key_padding_mask=mask)
    assert len(calls) == (lq > 8)
    allowed = (torch.arange(lk)[None, :] <= torch.arange(lq)[:, None] + lk - lq)[None, None] & mask[:, None, None, :]
    x = (q @ k.transpose(-1, -2) * 0.3).masked_fill(~allowed, float("-inf"))
    ref = (torch.softmax(x, -1) @ v).nan_to_num(0.0)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    if lq > 1:
        assert out[0, 0, 0].abs().max() == 0 and out[0, 0, -1].abs().max() > 0
    assert torch.autograd.gradcheck(lambda a, b, c: softmax_attention(a, b, c, causal=True, scale=0.3,
                                                                      key_padding_mask=mask), (q, k, v))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_precision_is_finite_and_close_to_fp32(dtype):
    mod = _module(dict(kind="polysketch", sketch_size=6, local_exact=True, block_size=8), (0,), 4, 2,
                  dtype=torch.float32)
    q, k, v = _inputs(2, 4, 2, 40, 40, dtype=torch.float32, scale=4.0)  # scores of O(10): exp past fp16's range
    mask = _padding_mask(2, 40, "left")
    ref = mod(q, k, v, causal=True, key_padding_mask=mask)
    out = mod(q.to(dtype), k.to(dtype), v.to(dtype), causal=True, key_padding_mask=mask)
    assert out.dtype == dtype and torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), ref, rtol=0.05, atol=0.05)


def test_state_is_checked():
    mod = _module(dict(kind="linear"), (0,), 4, 2)
    q, k, v = _inputs(1, 4, 2, 3, 3)
    with pytest.raises(TypeError, match="state must be a HybridState"):
        mod(q, k, v, causal=True, state=RecurrentState(None, None, None, None, 0))
    with pytest.raises(ValueError, match="causal attention only"):
        mod(q, k, v, causal=False, state=mod.init_state())


@pytest.mark.parametrize("padded", [False, True], ids=["no-padding", "left-padding"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_softmax_heads_reach_sdpa_in_their_dtype_with_expanded_kv(monkeypatch, dtype, padded):
    """On CUDA a half-precision exact part goes to SDPA in its own dtype with the kv heads expanded (no fp32 upcast,
    no enable_gqa: that pair sent a 32k bf16 prefill to SDPA's math path, 86 GiB on an H200). The route is taken
    here on the CPU by patching the device test; SDPA's inputs are recorded, and the output is checked against the
    float64 reference (causal bottom-right after a past, left padding with a row that sees no key) and is finite."""
    from hf_polyattn.ops import hybrid

    sdpa = torch.nn.functional.scaled_dot_product_attention
    seen = []

    def recorded(q, k, v, **kwargs):
        seen.append((q.dtype, k.dtype, q.shape[1], k.shape[1], kwargs.get("enable_gqa", False)))
        return sdpa(q, k, v, **kwargs)

    monkeypatch.setattr(hybrid.F, "scaled_dot_product_attention", recorded)
    monkeypatch.setattr(hybrid, "_fused_half", lambda q: q.dtype in (torch.bfloat16, torch.float16))
    lq, lk = 12, 20
    q, k, v = _inputs(2, 6, 2, lq, lk, dtype=torch.float64)
    mask = torch.ones(2, lk, dtype=torch.bool)
    if padded:
        mask[0, :9] = False  # the first sequence's first query (position 8) sees no key
    kw = dict(causal=True, scale=0.25, key_padding_mask=mask if padded else None)
    out = softmax_attention(q.to(dtype), k.to(dtype), v.to(dtype), **kw)
    assert seen == [(dtype, dtype, 6, 6, False)]
    ref = softmax_attention(q, k, v, **kw)
    assert out.dtype == dtype and torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, rtol=2e-2, atol=2e-2)
    if padded:
        assert out[0, :, 0].abs().max() == 0


@pytest.mark.parametrize("hkv", [1, 3])
@pytest.mark.parametrize("lk", [63, 64, 80, 83])
def test_one_query_over_many_keys_is_split_in_chunks(monkeypatch, hkv, lk):
    """A decoding query of one sequence over at least _SPLIT_MIN_KEYS keys (64 here, chunks of 16: whole chunks,
    a tail, one key short of the threshold) runs the chunked path instead of SDPA (its calls counted), on keys that
    are a view of a buffer with room after them (the cache's layout), and equals the naive softmax in float64 with
    scores up to ~60 apart (one max over every chunk), gradients included."""
    from hf_polyattn.ops import hybrid

    monkeypatch.setattr(hybrid, "_SPLIT_MIN_KEYS", 64)
    monkeypatch.setattr(hybrid, "_SPLIT_CHUNK", 16)
    g, d = 3, 8
    gen = torch.Generator().manual_seed(lk + hkv)
    kbuf = torch.randn(1, hkv, lk + 20, d, generator=gen, dtype=torch.float64)
    vbuf = torch.randn(1, hkv, lk + 20, d, generator=gen, dtype=torch.float64)
    k, v = kbuf[:, :, :lk], vbuf[:, :, :lk]
    q = 4 * torch.randn(1, hkv * g, 1, d, generator=gen, dtype=torch.float64)
    calls = _count_sdpa(monkeypatch)
    out = softmax_attention(q, k, v, causal=True, scale=0.9)
    assert len(calls) == (lk < 64)
    kk, vv = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    x = q @ kk.transpose(-1, -2) * 0.9
    assert (x.amax(-1) - x.amin(-1)).max() > 30
    torch.testing.assert_close(out, torch.softmax(x, -1) @ vv, rtol=1e-12, atol=1e-12)
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    assert torch.autograd.gradcheck(lambda a, b, c: softmax_attention(a, b, c, causal=True, scale=0.9), (q, k, v))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_split_keys_from_half_inputs_work_in_float32(monkeypatch, dtype):
    """bf16 / fp16 keys of a long cache: the chunked path runs in float32 (softmax_attention's to_work) and returns
    q's dtype, finite and as close to the float32 result as the inputs' rounding allows, with scores large enough
    that exp of an unshifted score would overflow fp16."""
    from hf_polyattn.ops import hybrid

    monkeypatch.setattr(hybrid, "_SPLIT_MIN_KEYS", 64)
    monkeypatch.setattr(hybrid, "_SPLIT_CHUNK", 16)
    gen = torch.Generator().manual_seed(3)
    q = 6 * torch.randn(1, 6, 1, 16, generator=gen)
    k, v = torch.randn(1, 2, 90, 16, generator=gen), torch.randn(1, 2, 90, 16, generator=gen)
    qh, kh, vh = q.to(dtype), k.to(dtype), v.to(dtype)
    out = softmax_attention(qh, kh, vh, causal=True, scale=1.0)
    ref = softmax_attention(qh.float(), kh.float(), vh.float(), causal=True, scale=1.0)
    assert out.dtype == dtype and torch.isfinite(out).all()
    assert (q @ k.repeat_interleave(3, 1).transpose(-1, -2)).max() > 11.1  # exp of it overflows fp16 (ln 65504)
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("split", [SPLITS[0], SPLITS[2]], ids=[SPLITS[0][0], SPLITS[2][0]])
def test_decoding_steps_over_a_long_cache_split_the_keys(monkeypatch, split):
    """A hybrid layer decoding token by token after a prompt, with the split threshold at 8 keys (chunks of 4):
    every step's softmax heads take the chunked path over the state's buffer (counted) and the outputs equal the
    full causal call. (A single softmax query head takes the explicit product first: test_softmax_attention_few_
    queries_of_one_head.)"""
    from hf_polyattn.ops import hybrid

    monkeypatch.setattr(hybrid, "_SPLIT_MIN_KEYS", 8)
    monkeypatch.setattr(hybrid, "_SPLIT_CHUNK", 4)
    taken = []
    real = hybrid._split_key_softmax

    def counted(*args, **kwargs):
        taken.append(args[1].shape[2])
        return real(*args, **kwargs)

    monkeypatch.setattr(hybrid, "_split_key_softmax", counted)
    _, soft, heads, kv_heads = split
    mod = _module(KINDS[1][1], soft, heads, kv_heads)
    n = 19
    q, k, v = _inputs(1, heads, kv_heads, n, n)
    full = mod(q, k, v, causal=True)
    assert taken == []  # a prompt's queries are not one
    o, state = mod(q[:, :, :7], k[:, :, :7], v[:, :, :7], causal=True, state=mod.init_state())
    outs = [o]
    with torch.no_grad():
        for i in range(7, n):
            o, state = mod(q[:, :, i : i + 1], k[:, :, i : i + 1], v[:, :, i : i + 1], causal=True, state=state)
            outs.append(o)
    assert taken == list(range(8, n + 1))  # from the step with 8 keys on, every one
    torch.testing.assert_close(torch.cat(outs, dim=2), full.detach(), rtol=1e-10, atol=1e-11)
