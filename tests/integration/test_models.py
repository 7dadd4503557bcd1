"""Every kind x every architecture: forward, backward, persistence, padding, causality."""

from __future__ import annotations

import json

import pytest
import torch
from integration_helpers import (
    ARCHS,
    CAUSAL_ARCHS,
    KIND_CONFIGS,
    VOCAB,
    arch_kind_params,
    auto_class,
    build,
    has_tensors,
    perturb_polyattn,
)
from safetensors import safe_open
from transformers import AttentionInterface

import hf_polyattn
from hf_polyattn import PolyAttnConfig

MATRIX = arch_kind_params(ARCHS)
CAUSAL_MATRIX = arch_kind_params(CAUSAL_ARCHS)


def _ids(batch=2, length=12, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (batch, length), generator=gen)


def _logits(model, arch, ids, mask=None, position_ids=None):
    kwargs = {"input_ids": ids, "attention_mask": mask}
    if position_ids is not None and arch.pass_position_ids:
        kwargs["position_ids"] = position_ids
    if arch.causal:
        kwargs["use_cache"] = False  # the cached (recurrent) path is tested in test_generation.py
    return model(**kwargs).logits


@pytest.fixture
def mask_spy(monkeypatch):
    """Record the attention_mask every polyattn call receives (must be None or 2-D)."""
    seen = []

    def install(kind):
        inner = AttentionInterface._global_mapping[kind]

        def spy(module, query, key, value, attention_mask, **kwargs):
            seen.append(None if attention_mask is None else tuple(attention_mask.shape))
            return inner(module, query, key, value, attention_mask, **kwargs)

        monkeypatch.setitem(AttentionInterface._global_mapping, kind, spy)
        return seen

    return install


@pytest.mark.parametrize("arch_name,kind", MATRIX)
def test_forward_backward_routes_through_polyattn(arch_name, kind, mask_spy):
    arch = ARCHS[arch_name]
    model = build(arch_name, kind)
    seen = mask_spy(kind)
    ids = _ids()
    mask = torch.ones_like(ids)
    mask[1, -3:] = 0
    out = model(input_ids=ids, attention_mask=mask, labels=ids, **({"use_cache": False} if arch.causal else {}))
    assert torch.isfinite(out.logits).all() and torch.isfinite(out.loss)
    # Both layers went through our function, and never with an n x n mask.
    assert len(seen) == 2, seen
    assert all(s is None or len(s) == 2 for s in seen), seen
    assert (2, 12) in seen  # the padding reached the kernel as a (batch, keys) mask
    out.loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    proj = [g for n, g in grads.items() if "polyattn" not in n and g is not None]
    assert proj and all(torch.isfinite(g).all() for g in proj)
    trainable = {n: g for n, g in grads.items() if ".polyattn." in n}
    cfg = KIND_CONFIGS[kind]
    if cfg.qk_norm or cfg.sketch == "learned" and kind == "polysketch":
        assert trainable, "learned polyattn parameters must be trainable"
        assert all(g is not None and torch.isfinite(g).all() for g in trainable.values())
        assert any(g.abs().sum() > 0 for g in trainable.values())


@pytest.mark.parametrize("arch_name,kind", MATRIX)
def test_attention_really_changes(arch_name, kind):
    """Not a silent softmax model: the converted logits differ from the softmax ones."""
    arch = ARCHS[arch_name]
    ids = _ids()
    soft = _logits(build(arch_name, None), arch, ids)
    model = build(arch_name, kind)
    calls = []
    for m in model.modules():
        if isinstance(m, hf_polyattn.HFPolyAttention):
            m.register_forward_hook(lambda mod, args, out: calls.append(mod.layer_idx))
    poly = _logits(model, arch, ids)
    assert sorted(calls) == [0, 1]  # every layer ran its polyattn module
    # and the result is not softmax's: 1e-3 for most kinds; nystrom's landmarks and taylor's 1 + q^.k^ stay within
    # 1e-4..1e-3 of the tiny random models' near-uniform softmax: 1e-5 there, still 100 times float32 rounding
    assert (soft - poly).abs().max() > (1e-5 if kind in ("nystrom", "taylor") else 1e-3)


def _polyattn_tensors(model):
    sd = model.state_dict()
    return {k: v.clone() for k, v in sd.items() if ".polyattn." in k}


@pytest.mark.parametrize("arch_name,kind", MATRIX)
def test_save_reload_chain(arch_name, kind, tmp_path):
    arch = ARCHS[arch_name]
    model = build(arch_name, kind)
    perturb_polyattn(model)  # so that re-initialising from the seed would be caught
    ids = _ids()
    ref = _logits(model, arch, ids)
    ref_tensors = _polyattn_tensors(model)
    assert bool(ref_tensors) == has_tensors(kind)  # elu+1, the window alone, nystrom, fnet: no tensors

    first = tmp_path / "first"
    model.save_pretrained(first)
    cfg_json = json.loads((first / "config.json").read_text())
    assert cfg_json["attn_implementation"] == kind
    assert PolyAttnConfig.from_dict(cfg_json["polyattn"]) == KIND_CONFIGS[kind]
    with safe_open(first / "model.safetensors", "pt") as f:
        assert {k for k in f.keys() if ".polyattn." in k} == set(ref_tensors)

    loaded = auto_class(arch).from_pretrained(first)
    assert type(loaded).__name__ == arch.model_cls
    assert loaded.config._attn_implementation == kind
    assert hf_polyattn.get_polyattn_config(loaded) == KIND_CONFIGS[kind]
    got = _polyattn_tensors(loaded)
    for k, v in ref_tensors.items():
        torch.testing.assert_close(got[k], v, rtol=0, atol=0, msg=k)  # loaded keys are never re-initialised
    torch.testing.assert_close(_logits(loaded, arch, ids), ref, rtol=0, atol=1e-5)

    second = tmp_path / "second"
    loaded.save_pretrained(second)  # load -> save -> load keeps the settings
    cfg2 = json.loads((second / "config.json").read_text())
    assert cfg2["attn_implementation"] == kind and cfg2["polyattn"] == cfg_json["polyattn"]
    again = auto_class(arch).from_pretrained(second)
    torch.testing.assert_close(_logits(again, arch, ids), ref, rtol=0, atol=1e-5)


def _pad(rows, side, pad_id):
    length = max(len(r) for r in rows)
    ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), length), dtype=torch.long)
    for i, r in enumerate(rows):
        sl = slice(0, len(r)) if side == "right" else slice(length - len(r), length)
        ids[i, sl] = r
        mask[i, sl] = 1
    position_ids = (mask.cumsum(-1) - 1).clamp_min(0)
    return ids, mask, position_ids


# bigbird places its blocks and global tokens at absolute positions: left padding shifts them (documented, warned
# once), so it is checked on the right only
@pytest.mark.parametrize("arch_name,kind,side", [pytest.param(*p.values, side, id=f"{p.id}-{side}") for p in MATRIX
                                                 for side in ("left", "right")
                                                 if not (side == "left" and p.values[1] == "bigbird")])
def test_padded_batch_equals_unpadded_rows(arch_name, kind, side):
    arch = ARCHS[arch_name]
    model = build(arch_name, kind)
    full = _ids(1, 12, seed=3)[0]
    # Lengths differ by a multiple of block_size (4): with local_exact the exact diagonal
    # blocks are aligned to the first key of the sequence (see docs/integration.md).
    rows = [full, full[:8].clone()]
    rows[1][0] = 5
    ids, mask, pos = _pad(rows, side, arch.pad_id)
    batched = _logits(model, arch, ids, mask, pos)
    for i, r in enumerate(rows):
        alone = _logits(model, arch, r[None])
        sl = slice(0, len(r)) if side == "right" else slice(ids.shape[1] - len(r), ids.shape[1])
        torch.testing.assert_close(batched[i, sl], alone[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch_name,kind", CAUSAL_MATRIX)
def test_decoders_are_causal(arch_name, kind):
    arch = ARCHS[arch_name]
    model = build(arch_name, kind)
    ids = _ids(1, 12, seed=5)
    changed = ids.clone()
    changed[0, 7] = (changed[0, 7] + 1) % VOCAB
    a, b = _logits(model, arch, ids), _logits(model, arch, changed)
    torch.testing.assert_close(a[:, :7], b[:, :7], rtol=0, atol=1e-6)  # the past never sees the future
    assert (a[:, 7:] - b[:, 7:]).abs().max() > 1e-4


@pytest.mark.parametrize("arch_name,kind", arch_kind_params(["llama", "bert", "gpt2"]))
def test_stock_checkpoint_with_kind_defaults(arch_name, kind, tmp_path):
    """from_pretrained(stock, attn_implementation=KIND): the kind's defaults, deterministic init."""
    arch = ARCHS[arch_name]
    stock = build(arch_name, None)
    stock.save_pretrained(tmp_path)
    model = auto_class(arch).from_pretrained(tmp_path, attn_implementation=kind)
    assert hf_polyattn.get_polyattn_config(model) == PolyAttnConfig.for_kind(kind)
    mods = [m for m in model.modules() if isinstance(m, hf_polyattn.HFPolyAttention)]
    assert len(mods) == 2
    for m in mods:
        fresh = hf_polyattn.HFPolyAttention(m.config, m.num_heads, m.head_dim, m.num_kv_heads, m.layer_idx)
        want = dict(fresh.state_dict())
        for k, v in m.state_dict().items():
            torch.testing.assert_close(v, want[k], rtol=0, atol=0, msg=k)  # not torch.empty memory
    # the stock weights themselves were loaded, not re-initialised
    stock_sd = stock.state_dict()
    for k, v in model.state_dict().items():
        if k in stock_sd:
            torch.testing.assert_close(v, stock_sd[k], rtol=0, atol=0, msg=k)
    out = _logits(model, arch, _ids())
    assert torch.isfinite(out).all()
    # Persisted even though the attention came from attn_implementation=, not convert().
    model.save_pretrained(tmp_path / "saved")
    cfg = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert cfg["attn_implementation"] == kind and cfg["polyattn"]["kind"] == kind
    again = auto_class(arch).from_pretrained(tmp_path / "saved")
    torch.testing.assert_close(_logits(again, arch, _ids()), out, rtol=0, atol=1e-5)


def test_layers_never_share_parameters():
    model = build("llama", "polysketch")
    ptrs = [t.data_ptr() for n, t in model.state_dict().items() if ".polyattn." in n]
    assert len(ptrs) == len(set(ptrs))
    a, b = (m for m in model.modules() if isinstance(m, hf_polyattn.HFPolyAttention))
    assert not torch.equal(a.feature_map.sketch.factors[0].weight, b.feature_map.sketch.factors[0].weight)


def test_default_options_once():
    """The full defaults (sketch 32, block 256) on one model of each family."""
    for arch_name, kind in [("llama", "polysketch"), ("bert", "performer"), ("gpt2", "linear")]:
        arch = ARCHS[arch_name]
        model = build(arch_name, PolyAttnConfig(kind=kind))
        assert torch.isfinite(_logits(model, arch, _ids())).all()


def test_polynomial_learned_coefficients_roundtrip(tmp_path):
    cfg = PolyAttnConfig(kind="polynomial", poly_coefficients=(0.5, 1.0, 0.25), learn_coefficients=True)
    model = build("qwen2", cfg)
    coeffs = [m.coefficients for m in model.modules() if isinstance(m, hf_polyattn.HFPolyAttention)]
    assert all(isinstance(c, torch.nn.Parameter) for c in coeffs)
    with torch.no_grad():
        coeffs[1].add_(0.1)
    ids = _ids()
    ref = _logits(model, ARCHS["qwen2"], ids)
    model.save_pretrained(tmp_path)
    loaded = auto_class(ARCHS["qwen2"]).from_pretrained(tmp_path)
    torch.testing.assert_close(_logits(loaded, ARCHS["qwen2"], ids), ref, rtol=0, atol=1e-5)


def test_meta_module_refuses_to_run_and_other_loaders_are_trusted():
    with torch.device("meta"):
        pa = hf_polyattn.HFPolyAttention(PolyAttnConfig(kind="performer", num_features=8), 4, 16, 2, 0)
    with pytest.raises(RuntimeError, match="still on the meta device"):
        pa.check_ready()
    pa = pa.to_empty(device="cpu")
    want = hf_polyattn.HFPolyAttention(PolyAttnConfig(kind="performer", num_features=8), 4, 16, 2, 0).state_dict()
    loaded = {k: v + 1.0 for k, v in want.items()}
    pa.load_state_dict(loaded)  # e.g. accelerate's load_checkpoint_and_dispatch
    pa.check_ready()
    torch.testing.assert_close(pa.state_dict()["feature_map.omega"], loaded["feature_map.omega"])
